//! `GET /v1/explain/{tenant}/{resource}?region=&at=`: one answer to "why did
//! admission look like this for that region at that instant", assembled from
//! the policy history, the window's pool and region rows, the region's
//! leases and its recent refusals in the ledger.
//!
//! Counts of the pool and the region are the window's totals as stored now
//! (reports arrive after the fact, so they are the best knowledge of what
//! happened); leases are those issued up to `at`, and "live" is judged at
//! `at`.

use crate::http::extract::{check_id, ApiPath, ApiQuery};
use crate::leases::LeaseRow;
use crate::ledger::{self, parse_time, Event};
use crate::{policies, AppState, Error, Result};
use axum::extract::State;
use axum::routing::get;
use axum::{Json, Router};
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

/// Routes of this module.
pub fn router() -> Router<AppState> {
    Router::new().route("/v1/explain/{tenant}/{resource}", get(explain))
}

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
    /// `limit − (granted − returned)`, never below 0.
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
}

#[derive(sqlx::FromRow)]
struct PoolRow {
    limit_tokens: i64,
    fallback_per_region: i64,
    granted: i64,
    returned: i64,
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
pub(crate) async fn explain(
    State(state): State<AppState>,
    ApiPath((tenant, resource)): ApiPath<(String, String)>,
    ApiQuery(q): ApiQuery<ExplainQuery>,
) -> Result<Json<Explanation>> {
    check_id("tenant", &tenant)?;
    check_id("resource", &resource)?;
    let region = q.region.ok_or_else(|| Error::invalid("region", "is required"))?;
    check_id("region", &region)?;
    let at =
        q.at.as_deref().map(|s| parse_time("at", s)).transpose()?.unwrap_or_else(|| state.clock.now_utc());
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
    let pool: Option<PoolRow> = sqlx::query_as(include_str!("sql/explain_pool.sql"))
        .bind(&tenant)
        .bind(&resource)
        .bind(window.start)
        .bind(window.secs)
        .bind(&region)
        .fetch_optional(&state.db)
        .await?;
    let rows: Vec<LeaseRow> = sqlx::query_as(include_str!("sql/explain_leases.sql"))
        .bind(&tenant)
        .bind(&resource)
        .bind(window.start)
        .bind(window.secs)
        .bind(&region)
        .bind(at)
        .bind(MAX_LEASES)
        .fetch_all(&state.db)
        .await?;
    let refusals = ledger::refusals(&state.db, &tenant, &resource, &region, at, MAX_REFUSALS).await?;

    let pool_view = match &pool {
        Some(p) => ExplainPool {
            exists: true,
            limit: p.limit_tokens,
            granted: p.granted,
            returned: p.returned,
            available: (p.limit_tokens - (p.granted - p.returned)).max(0),
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
        region: region.clone(),
        granted: pool.as_ref().and_then(|p| p.r_granted).unwrap_or(0),
        returned: pool.as_ref().and_then(|p| p.r_returned).unwrap_or(0),
        consumed: pool.as_ref().and_then(|p| p.r_consumed).unwrap_or(0),
        demand_per_sec: pool.as_ref().and_then(|p| p.r_demand).unwrap_or(0.0),
        last_want: pool.as_ref().and_then(|p| p.r_last_want).unwrap_or(0),
        demand_at: pool.as_ref().and_then(|p| p.r_demand_at),
    };
    let allowance =
        pool.as_ref().map(|p| p.fallback_per_region).unwrap_or_else(|| policy.fallback_allowance());
    let fallback_admitted = pool.as_ref().and_then(|p| p.r_fallback).unwrap_or(0);
    let fallback = ExplainFallback {
        allowance,
        admitted: fallback_admitted,
        left: (allowance - fallback_admitted).max(0),
        in_fallback: fallback_admitted > 0,
    };
    let live = |l: &LeaseRow| l.tokens > 0 && l.expires_at > at && l.released_at.is_none_or(|r| r > at);
    let live_lease_tokens: i64 = rows.iter().filter(|l| live(l)).map(|l| l.tokens).sum();
    let empty_grant = rows.iter().rev().find(|l| l.tokens == 0);
    let leases: Vec<ExplainLease> = rows
        .iter()
        .map(|l| ExplainLease {
            lease_id: l.lease_id,
            agent: l.agent.clone(),
            epoch: l.epoch,
            seq: l.seq,
            tokens: l.tokens,
            issued_at: l.issued_at,
            expires_at: l.expires_at,
            expired: l.expires_at <= at,
            spent: l.unspent.map(|u| l.tokens - u),
            returned: l.returned,
            released_at: l.released_at,
        })
        .collect();

    let (verdict, reason) = if live_lease_tokens > 0 {
        ("leased", format!("the region held {live_lease_tokens} tokens in live leases at that instant"))
    } else if fallback.in_fallback {
        (
            "fallback",
            format!(
                "no live lease; the region admitted {} of its {} fallback allowance ({} left) in this window",
                fallback.admitted, fallback.allowance, fallback.left
            ),
        )
    } else if region_account.demand_per_sec == 0.0 && rows.is_empty() {
        ("no demand", "the region asked for nothing in this window".to_string())
    } else if pool_view.available == 0 || empty_grant.is_some() {
        let asked =
            empty_grant.map(|l| format!(", its grant seq {} got 0 tokens", l.seq)).unwrap_or_default();
        (
            "exhausted",
            format!(
                "the pool had {} of {} tokens available{asked}; requests are answered 429 quota_exhausted",
                pool_view.available, pool_view.limit
            ),
        )
    } else {
        ("idle", "the region holds no live lease; its agent renews on its next demand".to_string())
    };
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
    }))
}
