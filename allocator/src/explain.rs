//! `GET /v1/explain/{tenant}/{resource}?region=&at=`: one answer to "why did
//! admission look like this for that region at that instant", assembled from
//! the policy history, the window's leases, the region's reports and its
//! recent refusals in the ledger.
//!
//! Every number is as of `at` where history allows (`as_of` names the
//! instant of each part): the pool's and the region's grants and returns are
//! rebuilt from the leases issued and released up to `at`, consumption and
//! fallback admits from the reports received up to `at`, the limit and the
//! fallback allowance from the policy in force at `at`, and "live" is judged
//! at `at`. Where retention has removed the history of the window the part
//! is the total as stored now, and `notes` says so. `current` always carries
//! the totals as stored now (reports arrive after the admits they count, so
//! they may know more about `at` than the reports received by then).

use crate::error::{Error, Result};
use crate::http::extract::{check_id, ApiPath, ApiQuery};
use crate::leases::LeaseRow;
use crate::ledger::{self, parse_time, Event};
use crate::policies;
use crate::state::AppState;
use axum::extract::State;
use axum::Json;
use chrono::{DateTime, Utc};
use quota_shared::window::Window;
use quota_shared::wire::{ErrorBody, Policy};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};
use uuid::Uuid;

/// Most leases and refusals one explanation lists.
pub const MAX_LEASES: i64 = 200;
/// Refusals listed, newest first.
pub const MAX_REFUSALS: i64 = 20;

/// Query of `GET /v1/explain/...`.
#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct ExplainQuery {
    /// The region to explain (required).
    pub region: Option<String>,
    /// RFC 3339 instant (default: now).
    pub at: Option<String>,
}

/// The pool of the window as stored.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
pub struct ExplainPool {
    /// Whether any grant or report created the pool yet.
    pub exists: bool,
    pub limit: i64,
    pub granted: i64,
    pub returned: i64,
    /// `limit − (granted − returned) − fallback repaid` (fallback reported
    /// while the window was open), never below 0.
    pub available: i64,
}

/// One lease of the region in the window.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
pub struct ExplainLease {
    pub lease_id: Uuid,
    pub agent: String,
    pub epoch: i64,
    pub seq: i64,
    pub tokens: i64,
    pub issued_at: DateTime<Utc>,
    pub expires_at: DateTime<Utc>,
    /// `expires_at ≤ at`.
    pub expired: bool,
    /// `tokens − unspent` as the agent reported on release; null until released.
    pub spent: Option<i64>,
    /// Tokens credited back to the pool on release; null until released.
    pub returned: Option<i64>,
    pub released_at: Option<DateTime<Utc>>,
}

/// The region's fallback position in the window.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
pub struct ExplainFallback {
    /// `fallback_per_region` of the window (0 in strict mode).
    pub allowance: i64,
    /// Fallback admits the region reported for the window.
    pub admitted: i64,
    /// `allowance − admitted`, never below 0.
    pub left: i64,
    /// The region reported fallback admits in this window, so it lost the
    /// allocator during it.
    pub in_fallback: bool,
}

/// The region's row of the window.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
pub struct ExplainRegion {
    pub region: String,
    pub granted: i64,
    pub returned: i64,
    /// Admits from leases, as reported.
    pub consumed: i64,
    pub demand_per_sec: f64,
    pub last_want: i64,
    pub demand_at: Option<DateTime<Utc>>,
}

/// The instant each part of an [`Explanation`] is from: `at`, or the
/// instant of `current` where the history to rebuild `at` is gone.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
pub struct ExplainInstants {
    /// `policy`: the version in force at this instant.
    pub policy: DateTime<Utc>,
    /// `pool`: leases issued and released up to this instant.
    pub pool: DateTime<Utc>,
    /// `region_account`: grants and returns as `pool`; consumption as
    /// reported up to this instant.
    pub region_account: DateTime<Utc>,
    /// `leases` and `live_lease_tokens`: issued, expired and released up to
    /// this instant.
    pub leases: DateTime<Utc>,
    /// `fallback`: admits reported up to this instant.
    pub fallback: DateTime<Utc>,
    /// `refusals`: recorded up to this instant.
    pub refusals: DateTime<Utc>,
}

/// The window's totals as stored when the explanation was made.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
pub struct ExplainCurrent {
    /// Read just before the totals (allocator clock): every commit before it
    /// is counted.
    pub as_of: DateTime<Utc>,
    pub pool: ExplainPool,
    pub region_account: ExplainRegion,
    pub fallback: ExplainFallback,
}

/// `GET /v1/explain/...` answer.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Explanation {
    pub tenant: String,
    pub resource: String,
    pub region: String,
    pub at: DateTime<Utc>,
    /// The policy version in force at `at`.
    pub policy: Policy,
    pub window_start: DateTime<Utc>,
    pub window_end: DateTime<Utc>,
    pub pool: ExplainPool,
    pub region_account: ExplainRegion,
    /// Leases issued to the region in the window up to `at`, oldest first.
    pub leases: Vec<ExplainLease>,
    /// Tokens of leases live at `at` (issued, not expired, not released).
    pub live_lease_tokens: i64,
    pub fallback: ExplainFallback,
    /// The region's latest refusals for this quota up to `at`, newest first.
    pub refusals: Vec<Event>,
    /// The first that applies: `leased` (a live lease at `at`), `fallback`
    /// (the region reported fallback admits in the window), `no demand` (no
    /// lease and no demand stated), `exhausted` (a grant got 0 tokens or the
    /// pool has none left), else `idle`.
    pub verdict: String,
    /// One sentence saying why.
    pub reason: String,
    /// The instant each part above is from.
    pub as_of: ExplainInstants,
    /// The same window's totals as stored now.
    pub current: ExplainCurrent,
    /// Which parts could not be rebuilt as of `at` and why, and what the
    /// reader should know about the numbers; empty when nothing applies.
    pub notes: Vec<String>,
}

/// The pool and the region rebuilt as of `at` (`sql/explain_pool_at.sql`).
struct PoolAtRow {
    created_at: DateTime<Utc>,
    stored_granted: i64,
    stored_returned: i64,
    lease_granted: i64,
    lease_returned: i64,
    granted: i64,
    returned: i64,
    r_lease_granted: i64,
    r_lease_returned: i64,
    r_granted: i64,
    r_returned: i64,
    r_demand: Option<f64>,
    r_last_want: Option<i64>,
    r_demand_at: Option<DateTime<Utc>>,
}

/// The region's reports of the window (`sql/explain_reports_at.sql`).
struct ReportsAtRow {
    consumed: i64,
    fallback_admitted: i64,
    all_consumed: i64,
    all_fallback_admitted: i64,
}

/// The pool and the region as stored now (`sql/explain_pool.sql`).
struct PoolRow {
    limit_tokens: i64,
    fallback_per_region: i64,
    granted: i64,
    returned: i64,
    /// Fallback reported while the window was open, repaid from the pool.
    fallback_owed: i64,
    r_granted: Option<i64>,
    r_returned: Option<i64>,
    r_consumed: Option<i64>,
    r_fallback: Option<i64>,
    r_demand: Option<f64>,
    r_last_want: Option<i64>,
    r_demand_at: Option<DateTime<Utc>>,
}

/// `GET /v1/explain/{tenant}/{resource}?region=&at=`.
#[utoipa::path(
    get,
    path = "/v1/explain/{tenant}/{resource}",
    params(("tenant" = String, Path), ("resource" = String, Path), ExplainQuery),
    responses(
        (status = 200, description = "Why admission looked this way for the region at that instant", body = Explanation),
        (status = 401, description = "Missing or wrong admin token", body = ErrorBody),
        (status = 404, description = "Unknown quota (or no policy yet at that instant)", body = ErrorBody),
        (status = 422, description = "Invalid parameter; the message names the field", body = ErrorBody),
    ),
    security(("admin_token" = [])),
    tag = "operator"
)]
#[tracing::instrument(name = "explain", skip_all, fields(tenant = %tenant, resource = %resource))]
pub(crate) async fn explain(
    State(state): State<AppState>,
    ApiPath((tenant, resource)): ApiPath<(String, String)>,
    ApiQuery(q): ApiQuery<ExplainQuery>,
) -> Result<Json<Explanation>> {
    check_id("tenant", &tenant)?;
    check_id("resource", &resource)?;
    let region = q.region.ok_or_else(|| Error::invalid("region", "is required"))?;
    check_id("region", &region)?;
    let at = match q.at.as_deref() {
        Some(s) => parse_time("at", s)?,
        None => state.db_clock.now_on(&state.db).await?,
    };
    let quota = format!("{tenant}/{resource}");
    let policy = match policies::at(&state.db, &tenant, &resource, at).await? {
        Some(p) => p,
        None => {
            // Tell an unknown quota from an instant before its first policy.
            let mut conn = state.db.acquire().await?;
            policies::require(&mut conn, &tenant, &resource).await?;
            return Err(Error::UnknownQuota(format!("{quota} had no policy yet at {}", at.to_rfc3339())));
        }
    };
    let window = Window::containing(at, policy.window_secs);
    // Read before the stored totals, so every commit before it is in them.
    let now = state.db_clock.now_on(&state.db).await?;
    // One snapshot for every read below: the rebuilt parts are checked
    // against the stored totals, which must not move in between.
    let mut tx = crate::tx::begin(&state.db).await?;
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
    let rows = sqlx::query_file_as!(
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

    let current = current_totals(pool.as_ref(), &policy, &region, now);
    let rebuilt = rebuild(&current, pool_at.as_ref(), &reports_at, owed_at, &policy, &region, at);
    let Rebuilt { pool: pool_view, region_account, fallback, as_of, mut notes } = rebuilt;
    if rows.len() as i64 == MAX_LEASES {
        notes.push(format!(
            "the region had more than {MAX_LEASES} leases in the window up to `at`: `leases` lists the \
             first {MAX_LEASES} and `live_lease_tokens` counts only those"
        ));
    }
    let live = |l: &LeaseRow| l.tokens > 0 && l.expires_at > at && l.released_at.is_none_or(|r| r > at);
    let live_lease_tokens: i64 = rows.iter().filter(|l| live(l)).map(|l| l.tokens).sum();
    let empty_grant = rows.iter().rev().find(|l| l.tokens == 0);
    let leases: Vec<ExplainLease> = rows
        .iter()
        .map(|l| {
            // A release after `at` had not happened yet at `at`.
            let released = l.released_at.is_some_and(|r| r <= at);
            ExplainLease {
                lease_id: l.lease_id,
                agent: l.agent.clone(),
                epoch: l.epoch,
                seq: l.seq,
                tokens: l.tokens,
                issued_at: l.issued_at,
                expires_at: l.expires_at,
                expired: l.expires_at <= at,
                spent: l.unspent.filter(|_| released).map(|u| l.tokens - u),
                returned: l.returned.filter(|_| released),
                released_at: l.released_at.filter(|_| released),
            }
        })
        .collect();

    let position = Position {
        live_lease_tokens,
        fallback: &fallback,
        demand_per_sec: region_account.demand_per_sec,
        leases_in_window: rows.len(),
        pool: &pool_view,
        empty_grant_seq: empty_grant.map(|l| l.seq),
    };
    let (verdict, reason) = verdict(&position);
    Ok(Json(Explanation {
        tenant,
        resource,
        region,
        at,
        policy: policy.to_wire(),
        window_start: window.start_at(),
        window_end: window.end_at(),
        pool: pool_view,
        region_account,
        leases,
        live_lease_tokens,
        fallback,
        refusals,
        verdict: verdict.to_string(),
        reason,
        as_of,
        current,
        notes,
    }))
}

/// The window's totals as stored at `now`.
fn current_totals(
    pool: Option<&PoolRow>,
    policy: &policies::PolicyRow,
    region: &str,
    now: DateTime<Utc>,
) -> ExplainCurrent {
    let pool_view = match pool {
        Some(p) => ExplainPool {
            exists: true,
            limit: p.limit_tokens,
            granted: p.granted,
            returned: p.returned,
            available: crate::share::available(p.limit_tokens, p.granted, p.returned, p.fallback_owed),
        },
        None => ExplainPool {
            exists: false,
            limit: policy.limit_tokens,
            granted: 0,
            returned: 0,
            available: policy.limit_tokens,
        },
    };
    let region_account = ExplainRegion {
        region: region.to_string(),
        granted: pool.and_then(|p| p.r_granted).unwrap_or(0),
        returned: pool.and_then(|p| p.r_returned).unwrap_or(0),
        consumed: pool.and_then(|p| p.r_consumed).unwrap_or(0),
        demand_per_sec: pool.and_then(|p| p.r_demand).unwrap_or(0.0),
        last_want: pool.and_then(|p| p.r_last_want).unwrap_or(0),
        demand_at: pool.and_then(|p| p.r_demand_at),
    };
    let allowance = pool.map(|p| p.fallback_per_region).unwrap_or_else(|| policy.fallback_allowance());
    let admitted = pool.and_then(|p| p.r_fallback).unwrap_or(0);
    let fallback = fallback_view(allowance, admitted);
    ExplainCurrent { as_of: now, pool: pool_view, region_account, fallback }
}

fn fallback_view(allowance: i64, admitted: i64) -> ExplainFallback {
    ExplainFallback { allowance, admitted, left: (allowance - admitted).max(0), in_fallback: admitted > 0 }
}

/// The parts of an explanation as of `at`, with the instant of each.
struct Rebuilt {
    pool: ExplainPool,
    region_account: ExplainRegion,
    fallback: ExplainFallback,
    as_of: ExplainInstants,
    notes: Vec<String>,
}

/// Rebuilds the pool, the region and its fallback position as of `at` from
/// the leases and the reported events, falling back to the stored totals
/// (and saying so) where retention removed that history. A pure function of
/// what was read, so the choice of each part's instant is in one place.
fn rebuild(
    current: &ExplainCurrent,
    pool_at: Option<&PoolAtRow>,
    reports: &ReportsAtRow,
    owed_at: i64,
    policy: &policies::PolicyRow,
    region: &str,
    at: DateTime<Utc>,
) -> Rebuilt {
    let mut notes = Vec::new();
    let mut as_of =
        ExplainInstants { policy: at, pool: at, region_account: at, leases: at, fallback: at, refusals: at };
    // The limit and the allowance in force at `at` (a policy change applies
    // to the open window at once, I9).
    let limit = policy.limit_tokens;
    let allowance = policy.fallback_allowance();
    let (pool, lease_history_whole, region_lease_history_whole) = match pool_at {
        None => (ExplainPool { exists: false, limit, granted: 0, returned: 0, available: limit }, true, true),
        Some(p) => {
            let whole = p.lease_granted == p.stored_granted && p.lease_returned == p.stored_returned;
            let r_whole = p.r_lease_granted == current.region_account.granted
                && p.r_lease_returned == current.region_account.returned;
            let (granted, returned) =
                if whole { (p.granted, p.returned) } else { (p.stored_granted, p.stored_returned) };
            let exists = if whole { p.created_at <= at } else { true };
            let pool = if exists {
                ExplainPool {
                    exists,
                    limit,
                    granted,
                    returned,
                    available: crate::share::available(limit, granted, returned, owed_at),
                }
            } else {
                ExplainPool { exists, limit, granted: 0, returned: 0, available: limit }
            };
            (pool, whole, r_whole)
        }
    };
    let pool = if lease_history_whole {
        pool
    } else {
        as_of.pool = current.as_of;
        notes.push(
            "retention removed leases of this window, so the pool cannot be rebuilt as of `at`: \
             `pool` is the total as stored now"
                .to_string(),
        );
        ExplainPool { limit: current.pool.limit, available: current.pool.available, ..pool }
    };
    let reports_whole = reports.all_consumed == current.region_account.consumed
        && reports.all_fallback_admitted == current.fallback.admitted;
    let mut region_account = match pool_at {
        Some(p) if region_lease_history_whole => ExplainRegion {
            region: region.to_string(),
            granted: p.r_granted,
            returned: p.r_returned,
            consumed: reports.consumed,
            demand_per_sec: p.r_demand.unwrap_or(0.0),
            last_want: p.r_last_want.unwrap_or(0),
            demand_at: p.r_demand_at,
        },
        Some(_) => current.region_account.clone(),
        None => ExplainRegion {
            region: region.to_string(),
            granted: 0,
            returned: 0,
            consumed: reports.consumed,
            demand_per_sec: 0.0,
            last_want: 0,
            demand_at: None,
        },
    };
    let mut fallback = fallback_view(allowance, reports.fallback_admitted);
    if !region_lease_history_whole || !reports_whole {
        as_of.region_account = current.as_of;
        as_of.fallback = current.as_of;
        region_account = current.region_account.clone();
        fallback = fallback_view(allowance, current.fallback.admitted);
        notes.push(
            "retention removed leases or reports of this region in this window, so its account cannot \
             be rebuilt as of `at`: `region_account` and `fallback.admitted` are the totals as stored now"
                .to_string(),
        );
    } else if reports.consumed != current.region_account.consumed
        || reports.fallback_admitted != current.fallback.admitted
    {
        notes.push(
            "consumption and fallback admits are those reported by `at`; agents report after they \
             admit, so `current` (as stored now) also counts reports received since"
                .to_string(),
        );
    }
    Rebuilt { pool, region_account, fallback, as_of, notes }
}

/// What [`verdict`] reads of the region's position at `at`.
#[derive(Debug, Clone, Copy)]
pub struct Position<'a> {
    /// Tokens of the region's leases live at `at`.
    pub live_lease_tokens: i64,
    pub fallback: &'a ExplainFallback,
    pub demand_per_sec: f64,
    /// Leases of the region in the window up to `at` (empty grants too).
    pub leases_in_window: usize,
    pub pool: &'a ExplainPool,
    /// The sequence number of the region's last grant that got 0 tokens.
    pub empty_grant_seq: Option<i64>,
}

/// The explain verdict and its reason: the first of these that holds —
/// live leases (`leased`), fallback admits reported in the window
/// (`fallback`), nothing asked for (`no demand`), an empty pool or an empty
/// grant (`exhausted`), else `idle` (the agent renews on its next demand).
pub fn verdict(p: &Position) -> (&'static str, String) {
    let f = p.fallback;
    if p.live_lease_tokens > 0 {
        ("leased", format!("the region held {} tokens in live leases at that instant", p.live_lease_tokens))
    } else if f.in_fallback {
        (
            "fallback",
            format!(
                "no live lease; the region admitted {} of its {} fallback allowance ({} left) in this window",
                f.admitted, f.allowance, f.left
            ),
        )
    } else if p.demand_per_sec == 0.0 && p.leases_in_window == 0 {
        ("no demand", "the region asked for nothing in this window".to_string())
    } else if p.pool.available == 0 || p.empty_grant_seq.is_some() {
        let asked =
            p.empty_grant_seq.map(|seq| format!(", its grant seq {seq} got 0 tokens")).unwrap_or_default();
        (
            "exhausted",
            format!(
                "the pool had {} of {} tokens available{asked}; requests are answered 429 quota_exhausted",
                p.pool.available, p.pool.limit
            ),
        )
    } else {
        ("idle", "the region holds no live lease; its agent renews on its next demand".to_string())
    }
}

#[cfg(test)]
mod verdict_tests {
    use super::*;

    fn pool(available: i64) -> ExplainPool {
        ExplainPool { exists: true, limit: 100, granted: 100 - available, returned: 0, available }
    }

    fn fallback(admitted: i64) -> ExplainFallback {
        ExplainFallback { allowance: 10, admitted, left: 10 - admitted, in_fallback: admitted > 0 }
    }

    /// Live tokens, fallback admitted, demand, leases in the window,
    /// available, empty grant's seq, and the verdict wanted.
    type Case = (i64, i64, f64, usize, i64, Option<i64>, &'static str);

    #[test]
    fn the_verdict_is_the_first_case_that_holds() {
        let cases: &[Case] = &[
            (40, 0, 4.0, 1, 60, None, "leased"),
            // Live leases win over fallback reported earlier in the window and an empty pool.
            (40, 3, 4.0, 2, 0, Some(2), "leased"),
            (0, 3, 4.0, 1, 60, None, "fallback"),
            // Fallback wins over an exhausted pool: the region was cut off.
            (0, 3, 4.0, 1, 0, Some(1), "fallback"),
            (0, 0, 0.0, 0, 100, None, "no demand"),
            // No demand measured but a lease in the window: not "no demand".
            (0, 0, 0.0, 1, 100, None, "idle"),
            (0, 0, 4.0, 1, 0, None, "exhausted"),
            (0, 0, 4.0, 2, 30, Some(2), "exhausted"),
            // An empty pool with no demand and no lease is still "no demand".
            (0, 0, 0.0, 0, 0, None, "no demand"),
            (0, 0, 4.0, 1, 30, None, "idle"),
        ];
        for &(live, admitted, demand, leases, available, empty, want) in cases {
            let (f, p) = (fallback(admitted), pool(available));
            let position = Position {
                live_lease_tokens: live,
                fallback: &f,
                demand_per_sec: demand,
                leases_in_window: leases,
                pool: &p,
                empty_grant_seq: empty,
            };
            assert_eq!(verdict(&position).0, want, "{position:?}");
        }
    }

    #[test]
    fn reasons_carry_the_numbers_an_operator_checks() {
        let (f, p) = (fallback(3), pool(0));
        let position = Position {
            live_lease_tokens: 0,
            fallback: &f,
            demand_per_sec: 1.0,
            leases_in_window: 1,
            pool: &p,
            empty_grant_seq: None,
        };
        assert_eq!(
            verdict(&position).1,
            "no live lease; the region admitted 3 of its 10 fallback allowance (7 left) in this window"
        );
        let f = fallback(0);
        let position = Position { fallback: &f, empty_grant_seq: Some(7), ..position };
        assert_eq!(
            verdict(&position).1,
            "the pool had 0 of 100 tokens available, its grant seq 7 got 0 tokens; requests are answered 429 quota_exhausted"
        );
    }
}
