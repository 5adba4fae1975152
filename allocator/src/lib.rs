//! The central allocator (DESIGN §1–§5).
//!
//! It owns each quota's global pool per UTC window in PostgreSQL and hands
//! out leases: idempotent (I3), epoch-fenced (I4) and clamped to the window
//! end (I2), never more than the pool holds (I1).
//!
//! # Layout
//!
//! * [`config`]: command-line flags and environment variables.
//! * [`http`]: the router, auth, extractors and the request metrics layer.
//! * [`error`]: the one error enum and its mapping to status and JSON.
//! * [`policies`]: versioned policies; changes apply to open windows (I9).
//! * [`agents`]: registration and epochs (I4).
//! * [`grants`]: the grant transaction (I1, I2, I3, I4).
//! * [`share`]: the demand-weighted share arithmetic (DESIGN §4).
//! * [`leases`]: releases and lease reads.
//! * [`reports`]: consumption and fallback reports, exactly once (I7).
//! * [`windows`]: per-window accounting with the overshoot bound (I6).
//! * [`ledger`]: the append-only event log.
//! * [`explain`]: why admission looked the way it did for a region.
//! * [`retention`]: the background deletion of everything beyond a horizon.
//! * [`time`]: the one clock for windows, the database's (I8, DESIGN §6).
//! * [`ui`]: the read-only HTML dashboard with SVG charts.
//! * [`openapi`]: the OpenAPI document generated from the handlers.
//! * [`health`]: liveness, readiness and metrics endpoints.

pub mod agents;
pub mod config;
pub mod error;
pub mod explain;
pub mod grants;
pub mod health;
pub mod http;
pub mod leases;
pub mod ledger;
pub mod openapi;
pub mod policies;
pub mod reports;
pub mod retention;
pub mod share;
pub mod telemetry;
pub mod time;
pub mod ui;
pub mod windows;

use quota_shared::clock::{Clock, OffsetClock, SystemClock};
use quota_shared::prom::Registry;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::PgPool;
use std::future::Future;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;

pub use error::{Error, Result};

/// Migrations embedded from the workspace's `migrations/` folder.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../migrations");

/// `--retention-hours` by default.
pub const DEFAULT_RETENTION_HOURS: u64 = 168;

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
    /// Bearer tokens; `None` leaves that class of routes open (loopback only).
    pub auth: http::auth::Tokens,
}

impl AppState {
    /// State over an existing pool with the system clock and no tokens.
    pub fn new(db: PgPool) -> Self {
        AppState {
            db,
            clock: Arc::new(SystemClock),
            db_clock: time::DbClock::database(),
            report_horizon: Some(retention::hours(DEFAULT_RETENTION_HOURS)),
            metrics: Arc::new(http::metrics::registry()),
            auth: http::auth::Tokens::default(),
        }
    }
}

/// Connects to PostgreSQL with bounded timeouts and applies the migrations.
///
/// Every statement gets a server-side timeout so a stuck lock cannot hold a
/// request (and its pool connection) forever.
pub async fn connect(database_url: &str, max_connections: u32) -> Result<PgPool, String> {
    let options = PgConnectOptions::from_str(database_url)
        .map_err(|e| format!("DATABASE_URL is not a valid PostgreSQL URL: {e}"))?
        .options([("statement_timeout", "5000"), ("lock_timeout", "4000")]);
    let pool = PgPoolOptions::new()
        .max_connections(max_connections)
        .acquire_timeout(Duration::from_secs(3))
        .connect_with(options)
        .await
        .map_err(|e| format!("cannot connect to PostgreSQL: {e}"))?;
    MIGRATOR.run(&pool).await.map_err(|e| format!("cannot apply migrations: {e}"))?;
    Ok(pool)
}

/// Serves the allocator API on `listener` until `shutdown` resolves, then
/// stops accepting and finishes in-flight requests.
pub async fn run(
    listener: TcpListener,
    state: AppState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, http::router(state)).with_graceful_shutdown(shutdown).await
}

/// What the binary does: validate the configuration, connect, serve until a
/// signal arrives, then stop within `--shutdown-timeout-secs`.
///
/// Shutdown is bounded whatever state PostgreSQL is in: the first signal
/// stops accepting, stops the retention job and lets in-flight requests
/// finish; requests still running at the deadline (a paused database does
/// not even let its own statement timeout fire) are cut by returning, which
/// drops their tasks and connections. A second signal exits at once.
pub async fn serve(config: config::Config) -> Result<(), String> {
    let database_url = config.database_url.clone().ok_or_else(|| {
        "DATABASE_URL is not set: pass --database-url postgres://USER@HOST/DB or set DATABASE_URL".to_string()
    })?;
    let tokens = http::auth::Tokens { agent: config.agent_token.clone(), admin: config.admin_token.clone() };
    let addr = config.listen;
    if !addr.ip().is_loopback() && (tokens.agent.is_none() || tokens.admin.is_none()) {
        return Err(format!(
            "refusing to listen on {addr} without QUOTA_AGENT_TOKEN and QUOTA_ADMIN_TOKEN; \
             set both or listen on a loopback address"
        ));
    }
    if tokens.agent.is_none() || tokens.admin.is_none() {
        tracing::warn!(%addr, "auth tokens not configured: routes without a token are open, loopback only");
    }
    let db = connect(&database_url, config.db_max_connections).await?;
    let listener = TcpListener::bind(addr).await.map_err(|e| format!("cannot listen on {addr}: {e}"))?;
    let mut state = AppState::new(db);
    state.auth = tokens;
    state.report_horizon = (config.retention_hours > 0).then(|| retention::hours(config.retention_hours));
    if config.test_clock_offset_ms != 0 {
        tracing::warn!(
            offset_ms = config.test_clock_offset_ms,
            "test flag: this replica's own clock is shifted"
        );
        state.clock = Arc::new(OffsetClock::new(chrono::Duration::milliseconds(config.test_clock_offset_ms)));
    }
    let sweeper = retention::Retention::from_hours(
        config.retention_hours,
        config.window_retention_hours,
        config.retention_batch,
    )
    .map(|cfg| tokio::spawn(retention::run(state.db.clone(), state.db_clock.clone(), cfg)));
    tracing::info!(addr = %listener.local_addr().map_err(|e| e.to_string())?, "allocator listening");

    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let mut server = tokio::spawn(run(listener, state.clone(), async move {
        let _ = stop_rx.await;
    }));
    let deadline = Duration::from_secs(config.shutdown_timeout_secs);
    let served = tokio::select! {
        r = &mut server => r,
        _ = telemetry::shutdown_signal() => {
            let _ = stop_tx.send(());
            if let Some(s) = &sweeper {
                s.abort();
            }
            // From here a second signal ends the process at once.
            tokio::spawn(async {
                telemetry::shutdown_signal().await;
                eprintln!("allocator: second signal, exiting at once");
                std::process::exit(1);
            });
            match tokio::time::timeout(deadline, &mut server).await {
                Ok(r) => r,
                Err(_) => {
                    tracing::warn!(deadline_secs = deadline.as_secs(), "in-flight requests cut at the shutdown deadline");
                    server.abort();
                    Ok(Ok(()))
                }
            }
        }
    };
    if let Some(s) = sweeper {
        s.abort();
    }
    match served {
        Ok(r) => r.map_err(|e| format!("server failed: {e}"))?,
        Err(e) if e.is_cancelled() => {}
        Err(e) => return Err(format!("server task failed: {e}")),
    }
    // Closing the pool waits for connections in use; a paused database would
    // hold it, so it is bounded too (the process exits right after).
    let _ = tokio::time::timeout(Duration::from_secs(1), state.db.close()).await;
    tracing::info!("allocator stopped");
    Ok(())
}
