//! `GET /v1/windows/{tenant}/{resource}`: per UTC window, what was granted,
//! returned, consumed and admitted from fallback, the overshoot bound of I6
//! and whether the window held it, in total and per region.

use crate::error::{Error, Result};
use crate::http::extract::{check_id, ApiPath, ApiQuery};
use crate::ledger::parse_time;
use crate::policies;
use crate::share;
use crate::state::AppState;
use axum::extract::State;
use axum::Json;
use chrono::{DateTime, Duration, Utc};
use quota_shared::bound::{self, BoundInputs};
use quota_shared::window::Window;
use quota_shared::wire::ErrorBody;
use serde::{Deserialize, Serialize};
use sqlx::PgConnection;
use std::collections::BTreeMap;
use utoipa::{IntoParams, ToSchema};

/// Most windows one call returns; `next_from` continues.
pub const MAX_WINDOWS: i64 = 100;

/// Query of `GET /v1/windows/...`.
#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct WindowsQuery {
    /// RFC 3339; windows starting at or after it (default: 10 windows ago).
    pub from: Option<String>,
    /// RFC 3339; windows starting before it (default: after the next window).
    pub to: Option<String>,
    /// Most windows to return, 1..=100 (default 100).
    pub limit: Option<i64>,
}

/// One region's part of a window.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, ToSchema)]
pub struct RegionAccount {
    pub granted: i64,
    pub returned: i64,
    pub consumed: i64,
    pub fallback_admitted: i64,
    /// Requests a shadow-mode policy would have refused (admitted anyway).
    pub shadow_refused: i64,
    pub admitted: i64,
    pub fallback_allowance: i64,
    pub stranded: i64,
    pub demand_per_sec: f64,
}

/// One window's accounting. `bound = limit + Σ fallback allowances` of the
/// regions seen in the window; `stranded = granted − consumed − returned`,
/// final (and non-zero) only once the window has closed.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
pub struct WindowAccount {
    pub window_start: DateTime<Utc>,
    pub window_end: DateTime<Utc>,
    pub window_secs: i64,
    /// Whether the window has ended (stranded is final only then).
    pub closed: bool,
    pub limit: i64,
    pub granted: i64,
    pub returned: i64,
    pub consumed: i64,
    pub fallback_admitted: i64,
    /// Of the fallback admits reported while the window was open, what its
    /// pool covered (later grants shared only the rest); `overshoot` is at
    /// most `fallback_admitted − fallback_repaid`.
    pub fallback_repaid: i64,
    /// Requests the policy would have refused while in shadow mode
    /// (`enforce: false`): admitted anyway, and not part of `admitted`
    /// unless a lease or the fallback allowance paid for them.
    pub shadow_refused: i64,
    pub admitted: i64,
    pub overshoot: i64,
    pub bound: i64,
    pub bound_held: bool,
    pub stranded: i64,
    pub regions: BTreeMap<String, RegionAccount>,
}

/// `GET /v1/windows/...` answer.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct WindowsPage {
    pub tenant: String,
    pub resource: String,
    pub windows: Vec<WindowAccount>,
    /// Pass as `from` to read the following windows, when there are more.
    pub next_from: Option<DateTime<Utc>>,
    /// The newest commit these numbers reflect (allocator clock): read just
    /// before the one statement that reads the windows, so every grant,
    /// release and report committed before it is counted.
    pub as_of: DateTime<Utc>,
}

struct Row {
    window_start: i64,
    window_secs: i64,
    limit_tokens: i64,
    fallback_per_region: i64,
    granted: i64,
    returned: i64,
    fallback_owed: i64,
    region: Option<String>,
    r_granted: Option<i64>,
    r_returned: Option<i64>,
    r_consumed: Option<i64>,
    r_fallback: Option<i64>,
    r_demand: Option<f64>,
    r_shadow_refused: Option<i64>,
}

/// `GET /v1/windows/{tenant}/{resource}`.
#[utoipa::path(
    get,
    path = "/v1/windows/{tenant}/{resource}",
    params(("tenant" = String, Path), ("resource" = String, Path), WindowsQuery),
    responses(
        (status = 200, description = "Per-window accounting, oldest first", body = WindowsPage),
        (status = 401, description = "Missing or wrong admin token", body = ErrorBody),
        (status = 404, description = "Unknown quota", body = ErrorBody),
        (status = 422, description = "Invalid parameter; the message names the field", body = ErrorBody),
    ),
    security(("admin_token" = [])),
    tag = "operator"
)]
pub(crate) async fn list(
    State(state): State<AppState>,
    ApiPath((tenant, resource)): ApiPath<(String, String)>,
    ApiQuery(q): ApiQuery<WindowsQuery>,
) -> Result<Json<WindowsPage>> {
    check_id("tenant", &tenant)?;
    check_id("resource", &resource)?;
    let mut conn = state.db.acquire().await?;
    // Which windows are closed, and the default range, on the one clock (I8).
    let now = state.db_clock.now(&mut conn).await?;
    let policy = policies::require(&mut conn, &tenant, &resource).await?;
    let w = Duration::seconds(policy.window_secs);
    let from = q.from.as_deref().map(|s| parse_time("from", s)).transpose()?.unwrap_or(now - w * 10);
    let to = q.to.as_deref().map(|s| parse_time("to", s)).transpose()?.unwrap_or(now + w * 2);
    if to < from {
        return Err(Error::invalid("to", "must not be before from"));
    }
    let limit = q.limit.unwrap_or(MAX_WINDOWS);
    if !(1..=MAX_WINDOWS).contains(&limit) {
        return Err(Error::invalid("limit", format!("must be between 1 and {MAX_WINDOWS}, got {limit}")));
    }
    let (windows, next_from) = accounts(&mut conn, &tenant, &resource, from, to, limit, now).await?;
    Ok(Json(WindowsPage { tenant, resource, windows, next_from, as_of: now }))
}

/// The accounting of the first `limit` windows starting in `[from, to)`,
/// and the start of the next one when there are more.
#[tracing::instrument(level = "debug", skip_all, fields(tenant = %tenant, resource = %resource, %from, %to, limit = limit))]
pub async fn accounts(
    conn: &mut PgConnection,
    tenant: &str,
    resource: &str,
    from: DateTime<Utc>,
    to: DateTime<Utc>,
    limit: i64,
    now: DateTime<Utc>,
) -> Result<(Vec<WindowAccount>, Option<DateTime<Utc>>)> {
    // One extra window tells whether there is a next page.
    let rows = sqlx::query_file_as!(
        Row,
        "src/sql/windows_list.sql",
        tenant,
        resource,
        from.timestamp(),
        to.timestamp(),
        limit + 1
    )
    .fetch_all(&mut *conn)
    .await?;
    let mut windows: Vec<WindowAccount> = Vec::new();
    for r in rows {
        let key = (r.window_start, r.window_secs);
        if windows.last().is_none_or(|w| (w.window_start.timestamp(), w.window_secs) != key) {
            let window = Window { start: r.window_start, secs: r.window_secs };
            windows.push(WindowAccount {
                window_start: window.start_at(),
                window_end: window.end_at(),
                window_secs: r.window_secs,
                closed: window.end_at() <= now,
                limit: r.limit_tokens,
                granted: r.granted,
                returned: r.returned,
                consumed: 0,
                fallback_admitted: 0,
                fallback_repaid: share::fallback_repaid(
                    r.limit_tokens,
                    r.granted,
                    r.returned,
                    r.fallback_owed,
                ),
                shadow_refused: 0,
                admitted: 0,
                overshoot: 0,
                bound: 0,
                bound_held: true,
                stranded: 0,
                regions: BTreeMap::new(),
            });
        }
        let w = windows.last_mut().expect("pushed above");
        if let Some(region) = r.region {
            w.regions.insert(
                region,
                RegionAccount {
                    granted: r.r_granted.unwrap_or(0),
                    returned: r.r_returned.unwrap_or(0),
                    consumed: r.r_consumed.unwrap_or(0),
                    fallback_admitted: r.r_fallback.unwrap_or(0),
                    shadow_refused: r.r_shadow_refused.unwrap_or(0),
                    fallback_allowance: r.fallback_per_region,
                    demand_per_sec: r.r_demand.unwrap_or(0.0),
                    ..Default::default()
                },
            );
        }
    }
    let next_from = if windows.len() as i64 > limit { windows.pop().map(|w| w.window_start) } else { None };
    for w in &mut windows {
        finish(w);
    }
    Ok((windows, next_from))
}

/// Derives the totals, the bound and stranded tokens from the region rows.
fn finish(w: &mut WindowAccount) {
    let mut allowances = 0;
    for r in w.regions.values_mut() {
        r.admitted = r.consumed + r.fallback_admitted;
        r.stranded = if w.closed { bound::stranded(r.granted, r.consumed, r.returned) } else { 0 };
        w.consumed += r.consumed;
        w.fallback_admitted += r.fallback_admitted;
        w.shadow_refused += r.shadow_refused;
        allowances += r.fallback_allowance;
    }
    w.admitted = w.consumed + w.fallback_admitted;
    let v = bound::verdict(
        BoundInputs { limit: w.limit, fallback_allowances: allowances, local_store_fallback: 0 },
        w.admitted,
    );
    w.overshoot = v.overshoot;
    w.bound = v.bound;
    w.bound_held = v.held;
    w.stranded = if w.closed { bound::stranded(w.granted, w.consumed, w.returned) } else { 0 };
}
