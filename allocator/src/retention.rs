//! Retention: a background job deletes, in bounded batches, everything
//! older than a horizon (`--retention-hours`): ledger events, leases, the
//! report records that make reports exactly-once (I7), and agents that are
//! gone. Per-window summaries (the `pool` and `pool_region` rows that
//! `GET /v1/windows` reads) follow a longer horizon of their own
//! (`--window-retention-hours`), so I6 can still be checked for windows
//! well after their detail is gone.
//!
//! Deleting is safe because of what the endpoints refuse:
//!
//! * a report record is deleted only once the newest window it counts
//!   started beyond the horizon, and `POST /v1/reports` refuses an item of
//!   such a window (`422 report_expired`), so a report replayed after its
//!   record went can never apply twice;
//! * a pool is deleted only once its window ended beyond the summary
//!   horizon, which is never shorter than the report horizon, and grants
//!   take only the current or next window, so nothing recreates it;
//! * an agent row is deleted only when it registered before the horizon and
//!   no lease and no report names it any more (those go at the same
//!   horizon): it has not registered, been granted, released or reported for
//!   longer than the horizon. Its epoch is not lost: the highest deleted
//!   epoch of each region is kept (`agent_epoch_floor`, one row per region)
//!   and a registration of an unknown agent starts above it, so no epoch of
//!   a `(region, agent)` ever repeats or goes backwards (I4). Keeping every
//!   agent's own epoch instead would keep one row per pod name ever seen.
//! * an agent's status (the fleet pages' row, see [`crate::fleet`]) is
//!   deleted once it was not refreshed for longer than the horizon; nothing
//!   decides on it, and a live agent writes it again within seconds.
//! * a permit lease of a concurrency quota (see [`crate::permits`]) is
//!   deleted once it expired more than a day ago ([`PERMIT_LEASE_KEEP`]),
//!   whatever the horizon: its permits were back in the pool from the
//!   instant it expired, and a region that asks again starts from no lease
//!   (its stale `seq` is answered with the lease's `seq` 0 first).
//!
//! Batches bound each statement's lock footprint and WAL burst; the pause
//! between batches leaves the database to the grants. Cutoffs come from the
//! database's clock (see [`crate::time`]).

use crate::error::Result;
use crate::time::DbClock;
use chrono::{DateTime, Duration, Utc};
use sqlx::PgPool;

/// `--retention-hours` by default.
pub const DEFAULT_RETENTION_HOURS: u64 = 168;

/// How long an expired permit lease is kept (its row says when it last
/// held permits, for operators) before retention deletes it.
pub const PERMIT_LEASE_KEEP: Duration = Duration::days(1);

/// How the job runs.
#[derive(Debug, Clone)]
pub struct Retention {
    /// Ledger events, leases, reports and agents older than this go.
    pub horizon: Duration,
    /// Pools of windows that ended longer ago than this go; `None` keeps
    /// them. Never shorter than `horizon`.
    pub window_horizon: Option<Duration>,
    /// Rows per delete statement.
    pub batch: i64,
    /// Pause between two batches.
    pub pause: std::time::Duration,
    /// Time between two sweeps.
    pub every: std::time::Duration,
}

/// Hours as a duration, saturating instead of overflowing.
pub fn hours(h: u64) -> Duration {
    Duration::hours(h.min(i64::MAX as u64 / 3_600_000) as i64)
}

impl Retention {
    /// The job for `--retention-hours` and `--window-retention-hours`,
    /// `None` when the first is 0 (disabled). A summary horizon shorter than
    /// the report horizon is raised to it: a pool deleted while reports of
    /// its window are still accepted would be recreated half empty.
    pub fn from_hours(hours_: u64, window_hours: u64, batch: i64) -> Option<Retention> {
        (hours_ > 0).then(|| Retention {
            horizon: hours(hours_),
            window_horizon: (window_hours > 0).then(|| hours(window_hours.max(hours_))),
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
    pub reports: u64,
    pub pools: u64,
    pub agents: u64,
    pub agent_statuses: u64,
    pub permit_leases: u64,
}

/// One kind of row the job deletes.
#[derive(Clone, Copy)]
enum Step<'a> {
    LedgerEvents,
    Leases,
    Reports,
    Pools,
    Agents { region: &'a str },
    AgentStatuses,
    PermitLeases,
}

impl Step<'_> {
    /// The step's name in its span.
    fn name(&self) -> &'static str {
        match self {
            Step::LedgerEvents => "ledger_events",
            Step::Leases => "leases",
            Step::Reports => "reports",
            Step::Pools => "pools",
            Step::Agents { .. } => "agents",
            Step::AgentStatuses => "agent_statuses",
            Step::PermitLeases => "permit_leases",
        }
    }
}

/// Deletes one batch of `step`'s rows older than `cutoff` (pools: whose
/// window ended before `cutoff`); answers how many went.
#[tracing::instrument(level = "debug", skip_all, fields(step = step.name(), batch = batch))]
async fn one_batch(db: &PgPool, step: Step<'_>, cutoff: DateTime<Utc>, batch: i64) -> Result<u64> {
    Ok(match step {
        Step::LedgerEvents => sqlx::query_file!("src/sql/retention_ledger.sql", cutoff, batch)
            .execute(db)
            .await?
            .rows_affected(),
        Step::Leases => {
            sqlx::query_file!("src/sql/retention_lease.sql", cutoff, batch).execute(db).await?.rows_affected()
        }
        Step::Reports => sqlx::query_file!("src/sql/retention_report.sql", cutoff.timestamp(), batch)
            .execute(db)
            .await?
            .rows_affected(),
        Step::Pools => sqlx::query_file!("src/sql/retention_pool.sql", cutoff.timestamp(), batch)
            .execute(db)
            .await?
            .rows_affected(),
        Step::AgentStatuses => sqlx::query_file!("src/sql/retention_agent_status.sql", cutoff, batch)
            .execute(db)
            .await?
            .rows_affected(),
        Step::PermitLeases => sqlx::query_file!("src/sql/retention_permit_lease.sql", cutoff, batch)
            .execute(db)
            .await?
            .rows_affected(),
        Step::Agents { region } => {
            let mut tx = crate::tx::begin(db).await?;
            sqlx::query_file!("src/sql/agent_region_lock_exclusive.sql", region).execute(&mut *tx).await?;
            let n = sqlx::query_file_scalar!("src/sql/retention_agent.sql", cutoff, batch, region)
                .fetch_one(&mut *tx)
                .await?;
            tx.commit().await?;
            n as u64
        }
    })
}

/// Runs `step` in batches until one deletes fewer than a batch.
async fn batches(db: &PgPool, step: Step<'_>, cutoff: DateTime<Utc>, cfg: &Retention) -> Result<u64> {
    let mut total = 0;
    loop {
        let n = one_batch(db, step, cutoff, cfg.batch).await?;
        total += n;
        if n < cfg.batch as u64 {
            return Ok(total);
        }
        tokio::time::sleep(cfg.pause).await;
    }
}

/// Deletes what is older than `now − horizon` (and pools older than
/// `now − window_horizon`), `batch` rows per statement. Agents go last:
/// whether one is gone depends on its leases and reports being deleted.
#[tracing::instrument(name = "retention", skip_all, fields(%now))]
pub async fn purge(db: &PgPool, now: DateTime<Utc>, cfg: &Retention) -> Result<Purged> {
    let cutoff = now - cfg.horizon;
    let mut purged = Purged {
        ledger_events: batches(db, Step::LedgerEvents, cutoff, cfg).await?,
        leases: batches(db, Step::Leases, cutoff, cfg).await?,
        reports: batches(db, Step::Reports, cutoff, cfg).await?,
        agent_statuses: batches(db, Step::AgentStatuses, cutoff, cfg).await?,
        permit_leases: batches(db, Step::PermitLeases, now - PERMIT_LEASE_KEEP, cfg).await?,
        ..Purged::default()
    };
    if let Some(wh) = cfg.window_horizon {
        purged.pools = batches(db, Step::Pools, now - wh, cfg).await?;
    }
    let regions =
        sqlx::query_file_scalar!("src/sql/retention_agent_regions.sql", cutoff).fetch_all(db).await?;
    for region in &regions {
        purged.agents += batches(db, Step::Agents { region }, cutoff, cfg).await?;
    }
    Ok(purged)
}

/// One sweep at the database's current time.
pub async fn sweep(db: &PgPool, clock: &DbClock, cfg: &Retention) -> Result<Purged> {
    let now = clock.now_on(db).await?;
    purge(db, now, cfg).await
}

/// Sweeps every `cfg.every` for ever; the caller aborts the task at
/// shutdown, which is safe because each batch is one transaction.
pub async fn run(db: PgPool, clock: DbClock, cfg: Retention) {
    loop {
        match sweep(&db, &clock, &cfg).await {
            Ok(p) if p != Purged::default() => tracing::info!(
                ledger_events = p.ledger_events,
                leases = p.leases,
                reports = p.reports,
                pools = p.pools,
                agents = p.agents,
                agent_statuses = p.agent_statuses,
                permit_leases = p.permit_leases,
                "retention purged rows"
            ),
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "retention sweep failed; retrying at the next sweep"),
        }
        tokio::time::sleep(cfg.every).await;
    }
}
