//! What an explanation reads: the policy in force at `at`, then, in one
//! transaction on one snapshot, the window's pool and the region's account
//! as stored now and as rebuilt at `at`, the region's reports, the fallback
//! repaid from the pool, the region's leases and its latest refusals. Only
//! the reads; `assemble` turns them into the answer.

use crate::error::{Error, Result};
use crate::leases::LeaseRow;
use crate::ledger::{self, Event};
use crate::policies::{self, PolicyRow};
use crate::time::DbClock;
use chrono::{DateTime, Utc};
use quota_shared::window::Window;
use sqlx::PgPool;

/// Most leases and refusals one explanation lists.
pub const MAX_LEASES: i64 = 200;
/// Refusals listed, newest first.
pub const MAX_REFUSALS: i64 = 20;

/// Everything an explanation is assembled from, as read.
#[derive(Debug)]
pub struct Snapshot {
    pub tenant: String,
    pub resource: String,
    pub region: String,
    /// The policy version in force at `at`.
    pub policy: PolicyRow,
    /// Read just before the stored totals: every commit before it is in them.
    pub now: DateTime<Utc>,
    /// The pool and the region as stored now; `None` before the pool exists.
    pub pool: Option<PoolRow>,
    /// The pool and the region rebuilt as of `at`; `None` before the pool exists.
    pub pool_at: Option<PoolAtRow>,
    pub reports_at: ReportsAtRow,
    /// Fallback repaid from the pool by reports received up to `at`.
    pub owed_at: i64,
    /// The region's leases of the window up to `at`, oldest first, at most
    /// [`MAX_LEASES`].
    pub leases: Vec<LeaseRow>,
    /// The region's latest refusals up to `at`, newest first, at most
    /// [`MAX_REFUSALS`].
    pub refusals: Vec<Event>,
}

/// The pool and the region rebuilt as of `at` (`sql/explain_pool_at.sql`).
#[derive(Debug, Clone)]
pub struct PoolAtRow {
    pub created_at: DateTime<Utc>,
    pub stored_granted: i64,
    pub stored_returned: i64,
    pub lease_granted: i64,
    pub lease_returned: i64,
    pub granted: i64,
    pub returned: i64,
    pub r_lease_granted: i64,
    pub r_lease_returned: i64,
    pub r_granted: i64,
    pub r_returned: i64,
    pub r_demand: Option<f64>,
    pub r_last_want: Option<i64>,
    pub r_demand_at: Option<DateTime<Utc>>,
}

/// The region's reports of the window (`sql/explain_reports_at.sql`).
#[derive(Debug, Clone)]
pub struct ReportsAtRow {
    pub consumed: i64,
    pub fallback_admitted: i64,
    pub all_consumed: i64,
    pub all_fallback_admitted: i64,
}

/// The pool and the region as stored now (`sql/explain_pool.sql`).
#[derive(Debug, Clone)]
pub struct PoolRow {
    pub limit_tokens: i64,
    pub fallback_per_region: i64,
    pub granted: i64,
    pub returned: i64,
    /// Fallback reported while the window was open, repaid from the pool.
    pub fallback_owed: i64,
    pub r_granted: Option<i64>,
    pub r_returned: Option<i64>,
    pub r_consumed: Option<i64>,
    pub r_fallback: Option<i64>,
    pub r_demand: Option<f64>,
    pub r_last_want: Option<i64>,
    pub r_demand_at: Option<DateTime<Utc>>,
}

/// Reads the [`Snapshot`] of `tenant/resource` for `region` at `at`: the
/// policy in force at `at` (`404 unknown_quota` for an unknown quota, and
/// for an instant before its first policy), then every other part in one
/// transaction begun with [`crate::tx::begin`] on one snapshot, so the
/// parts rebuilt as of `at` can be checked against the stored totals,
/// which must not move in between.
pub async fn load(
    db: &PgPool,
    clock: &DbClock,
    tenant: String,
    resource: String,
    region: String,
    at: DateTime<Utc>,
) -> Result<Snapshot> {
    let policy = match policies::at(db, &tenant, &resource, at).await? {
        Some(p) => p,
        None => {
            // Tell an unknown quota from an instant before its first policy.
            let mut conn = db.acquire().await?;
            policies::require(&mut conn, &tenant, &resource).await?;
            return Err(Error::UnknownQuota(format!(
                "{tenant}/{resource} had no policy yet at {}",
                at.to_rfc3339()
            )));
        }
    };
    let window = Window::containing(at, policy.window_secs);
    // Read before the stored totals, so every commit before it is in them.
    let now = clock.now_on(db).await?;
    let mut tx = crate::tx::begin(db).await?;
    sqlx::query_file!("src/sql/read_snapshot.sql").execute(&mut *tx).await?;
    let pool = sqlx::query_file_as!(
        PoolRow,
        "src/sql/explain_pool.sql",
        tenant,
        resource,
        window.start,
        window.secs,
        region
    )
    .fetch_optional(&mut *tx)
    .await?;
    let pool_at = sqlx::query_file_as!(
        PoolAtRow,
        "src/sql/explain_pool_at.sql",
        tenant,
        resource,
        window.start,
        window.secs,
        at,
        region
    )
    .fetch_optional(&mut *tx)
    .await?;
    let reports_at = sqlx::query_file_as!(
        ReportsAtRow,
        "src/sql/explain_reports_at.sql",
        tenant,
        resource,
        region,
        at,
        Window { start: window.start - window.secs, secs: window.secs }.start_at(),
        window.start_at()
    )
    .fetch_one(&mut *tx)
    .await?;
    let owed_at = sqlx::query_file_scalar!(
        "src/sql/explain_fallback_owed_at.sql",
        tenant,
        resource,
        at,
        Window { start: window.start - window.secs, secs: window.secs }.start_at(),
        window.start_at(),
        window.end_at()
    )
    .fetch_one(&mut *tx)
    .await?;
    let leases = sqlx::query_file_as!(
        LeaseRow,
        "src/sql/explain_leases.sql",
        tenant,
        resource,
        window.start,
        window.secs,
        region,
        at,
        MAX_LEASES
    )
    .fetch_all(&mut *tx)
    .await?;
    let refusals = ledger::refusals(&mut tx, &tenant, &resource, &region, at, MAX_REFUSALS).await?;
    tx.commit().await?;
    Ok(Snapshot {
        tenant,
        resource,
        region,
        policy,
        now,
        pool,
        pool_at,
        reports_at,
        owed_at,
        leases,
        refusals,
    })
}
