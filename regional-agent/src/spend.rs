//! `POST /v1/acquire`: one admission decision per request, made by a run
//! of `lua/spend.lua` (shared with the concurrent requests on the same
//! quota, see [`crate::batch`]) that checks the quota's incarnation, each
//! lease's expiry and epoch fence and the balance, and debits atomically
//! (I5). The request path never calls the allocator: when no token is left
//! it wakes the renewer and waits (bounded) for it, and it answers from the
//! region's fallback counter only while the allocator is unreachable.

use crate::batch::{self, Ask, Common, Spend};
use crate::error::{Error, Result};
use crate::keys::Keys;
use crate::quotas::{self, PolicyInfo, Quota};
use crate::AppState;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use chrono::{TimeZone, Utc};
use quota_shared::window::Window;
use quota_shared::wire::FailMode;
use serde::Deserialize;
use serde_json::json;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Routes of this module.
pub fn router() -> Router<AppState> {
    Router::new().route("/v1/acquire", post(acquire))
}

/// Largest `cost` accepted before the policy is known.
pub const MAX_COST: i64 = 1_000_000_000;
/// Longest `request_id` accepted.
pub const MAX_REQUEST_ID_LEN: usize = 128;
/// TTL of the region's counters and lease books: long enough to outlive a
/// long partition before the counts are reported.
pub const COUNTER_TTL_MS: i64 = 7 * 24 * 3600 * 1000;
/// Longest a request waits for a next-window lease about to open.
const MAX_OPEN_WAIT_MS: i64 = 250;

fn one() -> i64 {
    1
}

/// `POST /v1/acquire` body.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AcquireRequest {
    pub tenant: String,
    pub resource: String,
    #[serde(default = "one")]
    pub cost: i64,
    #[serde(default)]
    pub request_id: Option<String>,
}

/// An admit.
#[derive(Debug, Clone, PartialEq)]
pub struct Admit {
    pub source: String,
    pub window_start: i64,
    pub remaining: i64,
}

fn parse(body: std::result::Result<Bytes, BytesRejection>) -> Result<AcquireRequest> {
    let bytes = body.map_err(|r| {
        if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
            Error::PayloadTooLarge
        } else {
            Error::MalformedJson(r.body_text())
        }
    })?;
    let req: AcquireRequest = serde_json::from_slice(&bytes).map_err(|e| match e.classify() {
        serde_json::error::Category::Data => {
            let msg = e.to_string();
            let field = ["tenant", "resource", "cost", "request_id"]
                .into_iter()
                .find(|f| msg.contains(&format!("`{f}`")))
                .unwrap_or("body");
            Error::invalid(field, msg)
        }
        _ => Error::MalformedJson(e.to_string()),
    })?;
    for (field, v) in [("tenant", &req.tenant), ("resource", &req.resource)] {
        quota_shared::ids::validate_id(v).map_err(|e| Error::invalid(field, format!("{v:?} {e}")))?;
    }
    if !(1..=MAX_COST).contains(&req.cost) {
        return Err(Error::invalid("cost", format!("must be between 1 and {MAX_COST}, got {}", req.cost)));
    }
    if let Some(r) = &req.request_id {
        if r.is_empty() || r.len() > MAX_REQUEST_ID_LEN || !r.chars().all(|c| c.is_ascii_graphic()) {
            return Err(Error::invalid(
                "request_id",
                format!("must be 1 to {MAX_REQUEST_ID_LEN} visible ASCII characters"),
            ));
        }
    }
    Ok(req)
}

/// `POST /v1/acquire`: one admission decision.
#[utoipa::path(
    post,
    path = "/v1/acquire",
    request_body = AcquireRequest,
    responses(
        (status = 200, description = "Admitted: {allowed: true, source: lease|fallback, window_start, remaining}; carries RateLimit-Policy and RateLimit"),
        (status = 400, description = "Malformed JSON", body = quota_shared::wire::ErrorBody),
        (status = 404, description = "unknown_quota: the allocator has no policy for it", body = quota_shared::wire::ErrorBody),
        (status = 413, description = "payload_too_large: the body is over 64 KiB", body = quota_shared::wire::ErrorBody),
        (status = 422, description = "Invalid value; the message names the field", body = quota_shared::wire::ErrorBody),
        (status = 429, description = "quota_exhausted with retry_after_s and Retry-After"),
        (status = 503, description = "allocator_unreachable (strict mode) or store_unavailable, with Retry-After"),
    ),
    tag = "agent"
)]
pub(crate) async fn acquire(
    State(app): State<AppState>,
    body: std::result::Result<Bytes, BytesRejection>,
) -> Response {
    let started = Instant::now();
    let mut policy = None;
    let mut name = String::from("unknown");
    let result = match parse(body) {
        Ok(req) => {
            name = format!("{}/{}", req.tenant, req.resource);
            decide(&app, &req, &mut policy).await
        }
        Err(e) => Err(e),
    };
    let now = app.clock.now_utc();
    let (outcome, remaining, mut resp) = match result {
        Ok(a) => {
            let body = json!({
                "allowed": true,
                "source": a.source,
                "window_start": Utc.timestamp_opt(a.window_start, 0).single().unwrap_or_default(),
                "remaining": a.remaining,
            });
            let outcome = if a.source == "fallback" { "fallback" } else { "lease" };
            if outcome == "fallback" {
                app.metrics.inc("agent_fallback_admits_total", &[]);
            }
            (outcome, a.remaining, (StatusCode::OK, Json(body)).into_response())
        }
        Err(e) => (e.code(), 0, e.into_response()),
    };
    rate_limit_headers(resp.headers_mut(), &name, policy, remaining, now);
    app.metrics.inc("agent_acquire_total", &[("outcome", outcome)]);
    crate::gauges::count_refusal(&app.metrics, &name, policy.is_some(), outcome);
    app.metrics.observe("agent_acquire_seconds", &[], started.elapsed().as_secs_f64());
    resp
}

/// `RateLimit-Policy` and `RateLimit` in the IETF httpapi draft's
/// structured-field form: `"<tenant>/<resource>";q=<limit>;w=<window>` and
/// `"<tenant>/<resource>";r=<remaining>;t=<seconds to the window end>`.
/// Before the policy is known both say 0.
pub fn rate_limit_headers(
    h: &mut HeaderMap,
    name: &str,
    policy: Option<PolicyInfo>,
    remaining: i64,
    now: chrono::DateTime<Utc>,
) {
    let (q, w, t) = match policy {
        Some(p) => {
            let win = Window::containing(now, p.window_secs);
            (p.limit, p.window_secs, (win.ms_until_end(now) + 999) / 1000)
        }
        None => (0, 0, 0),
    };
    if let Ok(v) = HeaderValue::from_str(&format!("\"{name}\";q={q};w={w}")) {
        h.insert("ratelimit-policy", v);
    }
    if let Ok(v) = HeaderValue::from_str(&format!("\"{name}\";r={};t={t}", remaining.max(0))) {
        h.insert("ratelimit", v);
    }
}

/// Waits until the renewer reports, at most `d`.
async fn wait_renewal(q: &Quota, d: Duration) {
    let n = q.renewed.notified();
    tokio::pin!(n);
    n.as_mut().enable();
    quotas::set_waiting(q);
    q.wake.notify_one();
    let _ = tokio::time::timeout(d, n).await;
}

/// Makes the decision for a valid request.
async fn decide(app: &AppState, req: &AcquireRequest, policy_out: &mut Option<PolicyInfo>) -> Result<Admit> {
    // Nothing is decided on a Redis that may evict the agent's keys (see `guard`).
    app.guard.admit()?;
    if app.unknown.contains(&req.tenant, &req.resource) {
        return Err(Error::UnknownQuota(format!("{}/{}", req.tenant, req.resource)));
    }
    let q = app.quota(&req.tenant, &req.resource).ok_or(Error::TooManyQuotas)?;
    *q.last_used.lock().unwrap() = Instant::now();
    if q.unknown() {
        return Err(Error::UnknownQuota(format!("{}/{}", req.tenant, req.resource)));
    }
    let mut policy = q.policy();
    if policy.is_none() {
        policy = crate::renew::load_policy(app, &q).await;
    }
    if policy.is_none() {
        // The first acquire of a quota nobody in the region knows: wait for
        // one grant (this is the only time a request waits on the allocator
        // while it is reachable).
        let learn =
            app.settings.acquire_wait.max(app.settings.allocator_timeout + Duration::from_millis(300));
        let deadline = Instant::now() + learn;
        while q.policy().is_none()
            && !q.unknown()
            && !app.unknown.contains(&req.tenant, &req.resource)
            && Instant::now() < deadline
        {
            wait_renewal(&q, deadline.saturating_duration_since(Instant::now())).await;
            if !app.allocator_reachable() {
                break;
            }
        }
        policy = q.policy();
    }
    if q.unknown() || app.unknown.contains(&req.tenant, &req.resource) {
        return Err(Error::UnknownQuota(format!("{}/{}", req.tenant, req.resource)));
    }
    let Some(p) = policy else {
        return Err(Error::AllocatorUnreachable);
    };
    *policy_out = Some(p);
    if req.cost > p.limit {
        return Err(Error::invalid("cost", format!("{} is above the quota's limit {}", req.cost, p.limit)));
    }
    let mut waited = 0;
    // Whether an earlier try of this request already counted its demand.
    let mut counted = false;
    for _ in 0..8 {
        let reachable = app.allocator_reachable();
        let fallback = !reachable && p.fail_mode == FailMode::Bounded;
        let r = match spend_once(app, &q, p, req, fallback, !counted).await {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(tenant = %req.tenant, resource = %req.resource, error = %e, "spend failed");
                return local_fallback(app, req, p);
            }
        };
        match r {
            Spend::Admit(a) => return Ok(a),
            // The script has stranded what it could not trust and the
            // batch noted the loss (re-registering); decide again on the
            // fresh incarnation.
            Spend::Lost => {}
            Spend::None { wait_ms, exhausted_ms } => {
                counted = true;
                if (0..=MAX_OPEN_WAIT_MS).contains(&wait_ms) {
                    tokio::time::sleep(Duration::from_millis(wait_ms as u64 + 2)).await;
                    continue;
                }
                if exhausted_ms > 0 && reachable {
                    return Err(Error::Exhausted { retry_after_ms: exhausted_ms });
                }
                if !reachable {
                    if p.fail_mode == FailMode::Strict || fallback {
                        return Err(Error::AllocatorUnreachable);
                    }
                    continue;
                }
                // First a short wait for the renewal; then, if the answer is
                // still out, up to one allocator timeout: a renewal that
                // times out makes the allocator unreachable (fallback or 503),
                // and only a known-empty pool (or none left after both waits)
                // is a 429.
                waited += 1;
                match waited {
                    1 => wait_renewal(&q, app.settings.acquire_wait).await,
                    2 => wait_renewal(&q, app.settings.allocator_timeout + Duration::from_millis(100)).await,
                    _ => return Err(Error::Exhausted { retry_after_ms: 1000 }),
                }
            }
        }
    }
    Err(Error::Exhausted { retry_after_ms: 1000 })
}

fn local_fallback(app: &AppState, req: &AcquireRequest, p: PolicyInfo) -> Result<Admit> {
    let n = app.settings.local_fallback_per_agent;
    if n == 0 {
        return Err(Error::StoreUnavailable);
    }
    let ws = Window::containing(app.allocator_now(), p.window_secs).start;
    match app.local.try_admit(&req.tenant, &req.resource, ws, req.cost, n) {
        Some(remaining) => Ok(Admit { source: "fallback".into(), window_start: ws, remaining }),
        None => Err(Error::StoreUnavailable),
    }
}

async fn spend_once(
    app: &AppState,
    q: &Arc<Quota>,
    p: PolicyInfo,
    req: &AcquireRequest,
    fallback: bool,
    count_demand: bool,
) -> std::result::Result<Spend, crate::store::StoreError> {
    let common = Common {
        fallback,
        window_secs: p.window_secs,
        allowance: p.fallback_allowance,
        rid_ttl_ms: p.window_secs * 1000,
    };
    let rid = req.request_id.as_deref().map(Keys::request_id_suffix).unwrap_or_default();
    let ask = Ask { cost: req.cost, rid, count_demand };
    let sent = Instant::now();
    let r = batch::spend(app, q, common, ask).await;
    app.metrics.observe("agent_acquire_store_seconds", &[], sent.elapsed().as_secs_f64());
    r
}
