//! The state every handler shares. It is made of pieces the crate's root
//! builds first (the connection pool, the metrics registry with every
//! family described, the tokens) and passes in; nothing here reaches up to
//! the handlers or down into the HTTP plumbing to make them, so each module
//! that reads the state stands above this one.

use crate::http::auth::Tokens;
use crate::{retention, time};
use quota_shared::clock::{Clock, SystemClock};
use quota_shared::prom::Registry;
use sqlx::PgPool;
use std::sync::Arc;

/// Shared state of every handler.
#[derive(Clone)]
pub struct AppState {
    /// The connection pool.
    pub db: PgPool,
    /// This replica's own clock. Nothing that decides or stamps a window
    /// reads it any more (all of that reads [`AppState::db_clock`]); the
    /// hidden `--test-clock-offset-ms` shifts it, so a test of replicas with
    /// skewed clocks fails if a decision ever reads it again.
    pub clock: Arc<dyn Clock>,
    /// The one clock for windows: the database's (I8, DESIGN §6).
    pub db_clock: time::DbClock,
    /// Report items of windows that started longer ago than this are
    /// refused (`report_expired`), which makes deleting report records
    /// beyond it safe; `None` accepts any age (retention disabled).
    pub report_horizon: Option<chrono::Duration>,
    /// Prometheus series.
    pub metrics: Arc<Registry>,
    /// Quotas whose open and previous windows `/metrics` shows
    /// (`--window-metrics-quotas`; 0: none).
    pub window_metrics_quotas: i64,
    /// Bearer tokens; `None` leaves that class of routes open (loopback only).
    pub auth: Tokens,
    /// Grant statements of one quota in flight at once (see [`crate::quota_gate`]).
    pub grant_gate: Arc<crate::quota_gate::QuotaGate>,
}

impl AppState {
    /// State over `db` from the pieces the root built: `metrics` with its
    /// families described, the number of quotas the window gauges cover and
    /// the tokens. The rest starts at its default: the system clock, the
    /// database's clock for windows, and reports accepted back to
    /// [`retention::DEFAULT_RETENTION_HOURS`].
    pub fn from_parts(db: PgPool, metrics: Arc<Registry>, window_metrics_quotas: i64, auth: Tokens) -> Self {
        AppState {
            db,
            clock: Arc::new(SystemClock),
            db_clock: time::DbClock::database(),
            report_horizon: Some(retention::hours(retention::DEFAULT_RETENTION_HOURS)),
            metrics,
            window_metrics_quotas,
            auth,
            grant_gate: Arc::default(),
        }
    }
}
