//! Retention: ledger events and leases older than a horizon are deleted by a
//! background job in bounded batches, while the per-window summaries (the
//! `pool` and `pool_region` rows) stay, so `GET /v1/windows` still answers
//! for old windows and I6 can still be checked for them.
//!
//! Batches bound each statement's lock footprint and WAL burst; the pause
//! between batches leaves the database to the grants. Report rows (the I7
//! idempotency records) are kept: an agent may resend a report from its
//! outbox long after the fact, and forgetting its id would apply it twice.

use crate::Result;
use chrono::{DateTime, Duration, Utc};
use quota_shared::clock::Clock;
use sqlx::PgPool;
use std::sync::Arc;

/// How the job runs.
#[derive(Debug, Clone)]
pub struct Retention {
    /// Rows older than this go; must be positive (0 hours disables the job
    /// before it is built).
    pub horizon: Duration,
    /// Rows per delete statement.
    pub batch: i64,
    /// Pause between two batches.
    pub pause: std::time::Duration,
    /// Time between two sweeps.
    pub every: std::time::Duration,
}

impl Retention {
    /// The job for `--retention-hours`, `None` when it is 0 (disabled).
    pub fn from_hours(hours: u64, batch: i64) -> Option<Retention> {
        (hours > 0).then(|| Retention {
            horizon: Duration::hours(hours.min(i64::MAX as u64 / 3600) as i64),
            batch: batch.max(1),
            pause: std::time::Duration::from_millis(100),
            every: std::time::Duration::from_secs(600),
        })
    }
}

/// Rows one sweep deleted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Purged {
    pub ledger_events: u64,
    pub leases: u64,
}

/// Deletes ledger events stamped before `cutoff` and leases that expired
/// before it, `batch` rows per statement, until a statement deletes fewer
/// than a batch.
pub async fn purge(
    db: &PgPool,
    cutoff: DateTime<Utc>,
    batch: i64,
    pause: std::time::Duration,
) -> Result<Purged> {
    let mut purged = Purged::default();
    for (sql, count) in [
        (include_str!("sql/retention_ledger.sql"), &mut purged.ledger_events),
        (include_str!("sql/retention_lease.sql"), &mut purged.leases),
    ] {
        loop {
            let n = sqlx::query(sql).bind(cutoff).bind(batch).execute(db).await?.rows_affected();
            *count += n;
            if n < batch as u64 {
                break;
            }
            tokio::time::sleep(pause).await;
        }
    }
    Ok(purged)
}

/// Sweeps every `cfg.every` for ever; the caller aborts the task at
/// shutdown, which is safe because each batch is one atomic statement.
pub async fn run(db: PgPool, clock: Arc<dyn Clock>, cfg: Retention) {
    loop {
        let cutoff = clock.now_utc() - cfg.horizon;
        match purge(&db, cutoff, cfg.batch, cfg.pause).await {
            Ok(p) if p != Purged::default() => {
                tracing::info!(ledger_events = p.ledger_events, leases = p.leases, %cutoff, "retention purged rows")
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "retention sweep failed; retrying at the next sweep"),
        }
        tokio::time::sleep(cfg.every).await;
    }
}
