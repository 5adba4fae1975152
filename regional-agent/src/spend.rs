//! `POST /v1/acquire`: one admission decision per request, made by a run
//! of `lua/spend.lua` (shared with the concurrent requests on the same
//! quota, see [`crate::batch`]) that checks the quota's incarnation, each
//! lease's expiry and epoch fence and the balance, and debits atomically
//! (I5). The request path never calls the allocator: when no token is left
//! it wakes the renewer and waits (bounded) for it, and it answers from the
//! region's fallback counter only while the allocator is unreachable.

use crate::app::AppState;
use crate::batch;
use crate::error::{Error, Result};
use crate::keys::Keys;
use crate::quotas::{self, PolicyInfo, Quota};
use crate::renew;
use crate::scripts::{self, Admit, Ask, Caller, Common, On, Outcome, Spend};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::StatusCode;
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
use tracing::field::Empty;

/// Routes of this module.
pub fn router() -> Router<AppState> {
    Router::new().route("/v1/acquire", post(acquire))
}

/// Largest `cost` accepted before the policy is known.
pub const MAX_COST: i64 = 1_000_000_000;
/// Longest `request_id` accepted.
pub const MAX_REQUEST_ID_LEN: usize = 128;
/// Longest `key` (the principal of a per-key limit) accepted.
pub const MAX_KEY_LEN: usize = 128;
/// How long past its window's end a request id is remembered.
pub const REQUEST_ID_MARGIN_MS: i64 = 10_000;
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
    /// The principal (user, API key) whose per-key bucket the request
    /// spends: 1 to 128 visible ASCII characters. Required when the
    /// quota's policy has `per_key` (422 otherwise); ignored when it has none.
    #[serde(default)]
    #[schema(min_length = 1, max_length = 128, pattern = "^[!-~]{1,128}$")]
    pub key: Option<String>,
}

/// Whether `s` is 1 to `max` visible ASCII characters (no space, no control).
fn visible_ascii(s: &str, max: usize) -> bool {
    !s.is_empty() && s.len() <= max && s.chars().all(|c| c.is_ascii_graphic())
}

fn parse(body: std::result::Result<Bytes, BytesRejection>) -> Result<AcquireRequest> {
    let bytes = body.map_err(|r| {
        if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
            Error::PayloadTooLarge
        } else {
            Error::MalformedJson(r.body_text())
        }
    })?;
    // The path of the value that failed (`key` for `"key": 7`); `.` for
    // the body itself (a missing or unknown field, named in the message).
    let de = &mut serde_json::Deserializer::from_slice(&bytes);
    let req: AcquireRequest = serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let e = e.into_inner();
        match e.classify() {
            serde_json::error::Category::Data => {
                let msg = e.to_string();
                // "unknown field `colour`, expected one of `tenant`, ...":
                // the unknown one; "missing field `resource`": the missing one.
                let quoted = msg
                    .split('`')
                    .nth(1)
                    .filter(|_| msg.starts_with("unknown field") || msg.starts_with("missing field"));
                let field = match quoted {
                    Some(f) => f.to_string(),
                    None => ["tenant", "resource", "cost", "request_id", "key"]
                        .into_iter()
                        .find(|f| *f == path)
                        .unwrap_or("body")
                        .to_string(),
                };
                Error::invalid(field, msg)
            }
            _ => Error::MalformedJson(e.to_string()),
        }
    })?;
    for (field, v) in [("tenant", &req.tenant), ("resource", &req.resource)] {
        quota_shared::ids::validate_id(v).map_err(|e| Error::invalid(field, format!("{v:?} {e}")))?;
    }
    if !(1..=MAX_COST).contains(&req.cost) {
        return Err(Error::invalid("cost", format!("must be between 1 and {MAX_COST}, got {}", req.cost)));
    }
    if let Some(r) = &req.request_id {
        if !visible_ascii(r, MAX_REQUEST_ID_LEN) {
            return Err(Error::invalid(
                "request_id",
                format!("must be 1 to {MAX_REQUEST_ID_LEN} visible ASCII characters"),
            ));
        }
    }
    if let Some(k) = &req.key {
        if !visible_ascii(k, MAX_KEY_LEN) {
            return Err(Error::invalid(
                "key",
                format!("must be 1 to {MAX_KEY_LEN} visible ASCII characters"),
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
        (status = 200, description = "Admitted: {allowed: true, source: lease|fallback, window_start, remaining, key_remaining (with a per-key limit: whole tokens left in the key's bucket), shadow_refused (a policy in shadow mode: true where an enforced one would answer 429; then source is shadow and limit names what would have refused)}; carries RateLimit-Policy and RateLimit for the most restrictive limit"),
        (status = 400, description = "Malformed JSON", body = quota_shared::wire::ErrorBody),
        (status = 404, description = "unknown_quota: the allocator has no policy for it", body = quota_shared::wire::ErrorBody),
        (status = 413, description = "payload_too_large: the body is over 64 KiB", body = quota_shared::wire::ErrorBody),
        (status = 422, description = "Invalid value; the message names the field (also: key missing for a quota with a per-key limit, cost above its burst)", body = quota_shared::wire::ErrorBody),
        (status = 409, description = "request_id_mismatch: the request_id was first used with another resource or cost (tenant-wide, until its window ends)", body = quota_shared::wire::ErrorBody),
        (status = 429, description = "quota_exhausted (limit: the resource; only when the allocator said the pool is empty) or per_key_limited (limit: per_key; the key's bucket holds less than the cost, Retry-After from its refill), with allowed: false, retry_after_s, Retry-After, RateLimit-Policy and RateLimit"),
        (status = 503, description = "allocator_unreachable (strict mode) or store_unavailable, with Retry-After"),
    ),
    tag = "agent"
)]
#[tracing::instrument(skip_all, fields(tenant = Empty, resource = Empty, cost = Empty, outcome = Empty))]
pub(crate) async fn acquire(
    State(app): State<AppState>,
    body: std::result::Result<Bytes, BytesRejection>,
) -> Response {
    let started = Instant::now();
    let mut policy = None;
    let mut name = String::from("unknown");
    let mut req_resource = String::new();
    let span = tracing::Span::current();
    let result = match parse(body) {
        Ok(req) => {
            span.record("tenant", req.tenant.as_str());
            span.record("resource", req.resource.as_str());
            span.record("cost", req.cost);
            name = format!("{}/{}", req.tenant, req.resource);
            req_resource.clone_from(&req.resource);
            decide(&app, &req, &mut policy).await
        }
        Err(e) => Err(e),
    };
    let now = app.clock.now_utc();
    let key_remaining = match &result {
        Ok(d) => d.admit.key_remaining,
        Err(Error::KeyLimited { remaining, .. }) => Some(*remaining),
        Err(_) => None,
    };
    let (outcome, remaining, mut resp) = match result {
        Ok(Decided { admit: a, shadow }) => {
            let mut body = json!({
                "allowed": true,
                "source": a.source,
                "window_start": Utc.timestamp_opt(a.window_start, 0).single().unwrap_or_default(),
                "remaining": a.remaining,
            });
            if let Some(k) = a.key_remaining {
                body["key_remaining"] = json!(k);
            }
            if policy.is_some_and(|p| !p.enforce) {
                body["shadow_refused"] = json!(shadow.is_some());
            }
            let outcome = match (&shadow, a.source.as_str()) {
                (Some(_), _) => "shadow_refused",
                (None, "fallback") => "fallback",
                (None, _) => "lease",
            };
            if outcome == "fallback" {
                app.metrics.inc("agent_fallback_admits_total", &[]);
            }
            // As for a refusal: a key's says nothing of the quota's balance.
            let remaining = match &shadow {
                Some(Shadow::PerKey) => None,
                _ => Some(a.remaining),
            };
            if let Some(s) = &shadow {
                body["limit"] = json!(s.limit(&req_resource));
            }
            (outcome, remaining, (StatusCode::OK, Json(body)).into_response())
        }
        // A key's refusal says nothing of the quota's balance: the
        // headers then describe the key's bucket.
        Err(e @ Error::KeyLimited { .. }) => (e.code(), None, e.into_response()),
        Err(e) => (e.code(), Some(0), e.into_response()),
    };
    span.record("outcome", outcome);
    tracing::debug!(remaining, "acquire answered");
    crate::headers::rate_limit_headers(resp.headers_mut(), &name, policy, remaining, key_remaining, now);
    app.metrics.inc("agent_acquire_total", &[("outcome", outcome)]);
    crate::gauges::count_refusal(&app.metrics, &name, policy.is_some(), outcome);
    app.fleet_status.count(&name, policy, outcome, app.allocator_now());
    app.metrics.observe("agent_acquire_seconds", &[], started.elapsed().as_secs_f64());
    resp
}

/// Waits until the renewer reports, at most `d`.
async fn wait_renewal(q: &Quota, cost: i64, d: Duration) {
    let n = q.renewed.notified();
    tokio::pin!(n);
    n.as_mut().enable();
    quotas::set_waiting(q, cost);
    q.wake.notify_one();
    let _ = tokio::time::timeout(d, n).await;
}

/// The limit a shadow-mode policy would have refused with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shadow {
    /// The key's bucket was short (`429 per_key_limited` if enforced).
    PerKey,
    /// The quota's pool was empty (`429 quota_exhausted` if enforced).
    Quota,
}

impl Shadow {
    /// The `limit` an enforced policy's 429 would name.
    pub fn limit(self, resource: &str) -> &str {
        match self {
            Shadow::PerKey => "per_key",
            Shadow::Quota => resource,
        }
    }

    /// The refusal a shadow-mode policy turns into an admit, if `e` is one:
    /// only the 429s (a 503 is no decision, and a shadow policy cannot
    /// decide either).
    pub fn of(e: &Error) -> Option<Shadow> {
        match e {
            Error::KeyLimited { .. } => Some(Shadow::PerKey),
            Error::Exhausted { .. } => Some(Shadow::Quota),
            _ => None,
        }
    }
}

/// An admit, and whether it is one only because the policy is in shadow
/// mode (then nothing was debited: the decision was a refusal).
#[derive(Debug, Clone, PartialEq)]
pub struct Decided {
    pub admit: Admit,
    pub shadow: Option<Shadow>,
}

/// Makes the decision for a valid request.
async fn decide(
    app: &AppState,
    req: &AcquireRequest,
    policy_out: &mut Option<PolicyInfo>,
) -> Result<Decided> {
    // Nothing is decided on a Redis that may evict the agent's keys (see `guard`).
    app.guard.admit()?;
    if app.unknown.contains(&req.tenant, &req.resource) {
        return Err(Error::UnknownQuota(format!("{}/{}", req.tenant, req.resource)));
    }
    let q = renew::quota(app, &req.tenant, &req.resource).ok_or(Error::TooManyQuotas)?;
    *q.last_used.lock().unwrap() = Instant::now();
    if q.unknown() {
        return Err(Error::UnknownQuota(format!("{}/{}", req.tenant, req.resource)));
    }
    let mut policy = q.policy();
    if policy.is_none() {
        policy = q.load_policy(&app.store).await;
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
            wait_renewal(&q, 1, deadline.saturating_duration_since(Instant::now())).await;
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
    if let Some(b) = p.per_key {
        if req.key.is_none() {
            return Err(Error::invalid(
                "key",
                "the quota has a per-key limit: name the principal (user, API key) the request spends for",
            ));
        }
        if req.cost > b.burst {
            return Err(Error::invalid(
                "cost",
                format!("{} is above the per-key burst {}", req.cost, b.burst),
            ));
        }
    }
    let claimed = match &req.request_id {
        Some(rid) => match claim_request_id(app, req, rid, p).await {
            Ok(c) => c,
            Err(ClaimError::Mismatch(m)) => return Err(Error::RequestIdMismatch(m)),
            Err(ClaimError::Store(e)) => {
                tracing::warn!(tenant = %req.tenant, resource = %req.resource, error = %e, "request id claim failed");
                return local_fallback(app, req, p).map(|admit| Decided { admit, shadow: None });
            }
        },
        None => false,
    };
    let decided = spend_with_waits(app, &q, p, req).await;
    if claimed && decided.is_err() {
        // Only admits are remembered: a refused request may be retried
        // with the same id and another cost (a shadow admit is a refusal).
        let key = app.keys.request_id_claim(&req.tenant, req.request_id.as_deref().unwrap_or_default());
        let _: std::result::Result<i64, _> = app.store.cmd(redis::cmd("DEL").arg(key)).await;
    }
    match decided {
        Ok(admit) => Ok(Decided { admit, shadow: None }),
        Err(e) => match Shadow::of(&e).filter(|_| !p.enforce) {
            Some(s) => Ok(shadow_admit(app, &q, p, s, &e).await),
            None => Err(e),
        },
    }
}

/// Shadow mode: the refusal `e` an enforced policy would answer becomes an
/// admit that debits nothing, counted for the window's report.
async fn shadow_admit(app: &AppState, q: &Quota, p: PolicyInfo, s: Shadow, e: &Error) -> Decided {
    let ws = Window::containing(app.allocator_now(), p.window_secs).start;
    if let Err(err) = scripts::shadow(&app.store, &q.prefix, ws).await {
        tracing::warn!(tenant = %q.tenant, resource = %q.resource, error = %err, "shadow refusal not counted");
        app.metrics.inc("agent_shadow_uncounted_total", &[]);
    }
    let limit = match s {
        Shadow::PerKey => "per_key",
        Shadow::Quota => "quota",
    };
    app.metrics.inc("agent_shadow_refusals_total", &[("limit", limit)]);
    let key_remaining = match e {
        Error::KeyLimited { remaining, .. } => Some(*remaining),
        _ => None,
    };
    Decided {
        admit: Admit { source: "shadow".into(), window_start: ws, remaining: 0, key_remaining },
        shadow: Some(s),
    }
}

/// Most spend runs one request makes (a bound on the loop, whatever the
/// clocks do; the time budget normally ends it first).
const MAX_TRIES: usize = 64;

/// What one spend run that found no token saw.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Seen {
    /// ms until a next-window lease opens, or -1.
    pub wait_ms: i64,
    /// > 0: the allocator said the pool is empty, retry after this many ms.
    pub exhausted_ms: i64,
    /// Whether the allocator counts as reachable.
    pub reachable: bool,
    pub fail_mode: FailMode,
    /// Whether this run was allowed to admit from the fallback allowance.
    pub fallback_tried: bool,
}

/// What the request does next.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Step {
    /// A next-window lease opens this soon: sleep, then spend again.
    SleepOpen(Duration),
    /// Wake the renewer and wait for its round, at most this long.
    WaitRenewal(Duration),
    /// Spend again at once (reachability changed: the fallback may admit).
    Again,
    /// `429`: the allocator said the pool is empty.
    Exhausted(i64),
    /// `503`: the agent cannot decide (allocator unreachable and the fail
    /// mode or the allowance says no, or no lease came within the budget).
    Unavailable,
}

/// The acquire rule (README "Guarantees"): a request with no token waits
/// for the renewer within one time budget; it is answered 429 only when the
/// allocator said the pool is empty, never because a renewal is late (a
/// late renewal ends in 503 once the budget is spent); while the allocator
/// is unreachable the fail mode decides (bounded: the fallback allowance,
/// then 503; strict: 503).
pub fn step(seen: Seen, elapsed: Duration, budget: Duration) -> Step {
    let left = budget.saturating_sub(elapsed);
    if (0..=MAX_OPEN_WAIT_MS).contains(&seen.wait_ms) {
        return Step::SleepOpen(Duration::from_millis(seen.wait_ms as u64 + 2));
    }
    if seen.exhausted_ms > 0 && seen.reachable {
        return Step::Exhausted(seen.exhausted_ms);
    }
    if !seen.reachable {
        if seen.fail_mode == FailMode::Strict || seen.fallback_tried {
            return Step::Unavailable;
        }
        return Step::Again;
    }
    if left.is_zero() {
        return Step::Unavailable;
    }
    Step::WaitRenewal(left)
}

/// Spends, waiting for renewals by [`step`]'s rule.
async fn spend_with_waits(
    app: &AppState,
    q: &Arc<Quota>,
    p: PolicyInfo,
    req: &AcquireRequest,
) -> Result<Admit> {
    // One wait for the renewal the request wakes, then up to one allocator
    // timeout for its answer: a renewal that times out makes the allocator
    // unreachable, which the fail mode then decides.
    let budget = app.settings.acquire_wait + app.settings.allocator_timeout + Duration::from_millis(100);
    let started = Instant::now();
    // Whether an earlier try of this request already counted its demand.
    let mut counted = false;
    for _ in 0..MAX_TRIES {
        let reachable = app.allocator_reachable();
        let fallback = !reachable && p.fail_mode == FailMode::Bounded;
        let r = match spend_once(app, q, p, req, fallback, !counted).await {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(tenant = %req.tenant, resource = %req.resource, error = %e, "spend failed");
                return local_fallback(app, req, p);
            }
        };
        let (wait_ms, exhausted_ms) = match r {
            Outcome::Ran { value: Spend::Admit(a), .. } => return Ok(a),
            // The script has stranded what it could not trust and the
            // run settled the loss (re-registering); decide again on the
            // fresh incarnation.
            Outcome::Lost(_) => continue,
            Outcome::Ran { value: Spend::None { wait_ms, exhausted_ms }, .. } => (wait_ms, exhausted_ms),
            // The key's own limit: no renewal or fallback changes it.
            Outcome::Ran { value: Spend::KeyLimited { retry_ms, remaining }, .. } => {
                return Err(Error::KeyLimited { retry_after_ms: retry_ms, remaining })
            }
        };
        counted = true;
        let seen =
            Seen { wait_ms, exhausted_ms, reachable, fail_mode: p.fail_mode, fallback_tried: fallback };
        match step(seen, started.elapsed(), budget) {
            Step::SleepOpen(d) => tokio::time::sleep(d).await,
            Step::WaitRenewal(d) => wait_renewal(q, req.cost, d).await,
            Step::Again => {}
            Step::Exhausted(ms) => {
                return Err(Error::Exhausted { resource: req.resource.clone(), retry_after_ms: ms })
            }
            Step::Unavailable => {
                if reachable {
                    tracing::debug!(tenant = %req.tenant, resource = %req.resource,
                        waited_ms = started.elapsed().as_millis() as u64, "no token after both waits");
                }
                return Err(Error::AllocatorUnreachable);
            }
        }
    }
    Err(Error::AllocatorUnreachable)
}

/// Why a request id could not be claimed.
enum ClaimError {
    Mismatch(String),
    Store(crate::store::StoreError),
}

/// Ties a request id to its request, tenant-wide: the first use records
/// the quota and cost (until the current window's end plus a margin); a
/// repeat with the same quota and cost proceeds (the spend script answers
/// it with the first decision), one with another quota or cost is refused.
/// Returns whether this request made the claim.
async fn claim_request_id(
    app: &AppState,
    req: &AcquireRequest,
    rid: &str,
    p: PolicyInfo,
) -> std::result::Result<bool, ClaimError> {
    let key = app.keys.request_id_claim(&req.tenant, rid);
    // The key joins the claim only when given, so a claim written before
    // per-key limits existed still matches its keyless repeat.
    let value = match &req.key {
        None => format!("{}:{}:{}", req.resource.len(), req.resource, req.cost),
        Some(k) => format!("{}:{}:{}:{}:{k}", req.resource.len(), req.resource, req.cost, k.len()),
    };
    let ttl = request_id_ttl_ms(app, p);
    let old: Option<String> = app
        .store
        .cmd(redis::cmd("SET").arg(&key).arg(&value).arg("NX").arg("GET").arg("PX").arg(ttl))
        .await
        .map_err(ClaimError::Store)?;
    match old {
        None => Ok(true),
        Some(o) if o == value => Ok(false),
        Some(o) => {
            let first = o.split_once(':').and_then(|(n, rest)| {
                let n: usize = n.parse().ok()?;
                let (res, after) = (rest.get(..n)?, rest.get(n + 1..)?);
                let (cost, key) = match after.split_once(':') {
                    Some((cost, key)) => (cost, key.split_once(':').map(|(_, k)| k)),
                    None => (after, None),
                };
                Some(match key {
                    Some(k) => format!("resource {res:?} with cost {cost} and key {k:?}"),
                    None => format!("resource {res:?} with cost {cost}"),
                })
            });
            let key = req.key.as_ref().map(|k| format!(" and key {k:?}")).unwrap_or_default();
            Err(ClaimError::Mismatch(format!(
                "request_id {rid:?} was first used for {}; this request names resource {:?} with cost {}{key}",
                first.unwrap_or_else(|| "another request".into()),
                req.resource,
                req.cost
            )))
        }
    }
}

/// How long a request id is remembered: until the end of the window it is
/// decided in, plus a margin for clocks and retries.
fn request_id_ttl_ms(app: &AppState, p: PolicyInfo) -> i64 {
    let now = app.clock.now_utc();
    Window::containing(now, p.window_secs).ms_until_end(now).max(0) + REQUEST_ID_MARGIN_MS
}

fn local_fallback(app: &AppState, req: &AcquireRequest, p: PolicyInfo) -> Result<Admit> {
    let n = app.settings.local_fallback_per_agent;
    if n == 0 {
        return Err(Error::StoreUnavailable);
    }
    let ws = Window::containing(app.allocator_now(), p.window_secs).start;
    match app.local.try_admit(&req.tenant, &req.resource, ws, req.cost, n) {
        Some(remaining) => {
            Ok(Admit { source: "fallback".into(), window_start: ws, remaining, key_remaining: None })
        }
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
) -> batch::Answer {
    let common = Common {
        fallback,
        window_secs: p.window_secs,
        allowance: p.fallback_allowance,
        rid_ttl_ms: request_id_ttl_ms(app, p),
        per_key: p.per_key,
    };
    let rid = req.request_id.as_deref().map(Keys::request_id_suffix).unwrap_or_default();
    let key = match (p.per_key, &req.key) {
        (Some(_), Some(k)) => Keys::per_key_suffix(k),
        _ => String::new(),
    };
    let ask = Ask { cost: req.cost, rid, count_demand, key };
    let sent = Instant::now();
    let run = {
        let (app, q) = (app.clone(), q.clone());
        move |common, asks: Vec<Ask>| {
            let (app, q) = (app.clone(), q.clone());
            async move { spend_run(&app, &q, common, &asks).await }
        }
    };
    let r = batch::spend(&q.spends, app.settings.redis_timeout, common, ask, run).await;
    app.metrics.observe("agent_acquire_store_seconds", &[], sent.elapsed().as_secs_f64());
    r
}

/// One run of the spend script for `asks` on the quota, settled (the
/// token adopted, a loss handled) before its answers go out.
async fn spend_run(app: &AppState, q: &Quota, common: Common, asks: &[Ask]) -> batch::RunAnswer {
    app.metrics.inc("agent_spend_runs_total", &[]);
    let token = q.token();
    let on = On { prefix: &q.prefix, token: &token };
    let by = Caller { agent: &app.settings.agent, epoch: app.ident.epoch() };
    let r = scripts::spend(&app.store, on, by, common, asks).await?;
    q.settle(&r, &app.ident, &app.metrics);
    Ok(r)
}

#[cfg(test)]
mod step_tests {
    use super::*;

    const B: Duration = Duration::from_millis(600);

    fn seen(
        wait_ms: i64,
        exhausted_ms: i64,
        reachable: bool,
        fail_mode: FailMode,
        fallback_tried: bool,
    ) -> Seen {
        Seen { wait_ms, exhausted_ms, reachable, fail_mode, fallback_tried }
    }

    #[test]
    fn a_next_window_lease_about_to_open_is_waited_for() {
        let s = seen(40, -1, true, FailMode::Bounded, false);
        assert_eq!(step(s, Duration::ZERO, B), Step::SleepOpen(Duration::from_millis(42)));
        // Beyond the longest open wait: the renewer is asked instead.
        let s = seen(MAX_OPEN_WAIT_MS + 1, -1, true, FailMode::Bounded, false);
        assert_eq!(step(s, Duration::ZERO, B), Step::WaitRenewal(B));
    }

    #[test]
    fn a_429_only_when_the_allocator_said_empty() {
        let s = seen(-1, 700, true, FailMode::Strict, false);
        assert_eq!(step(s, Duration::ZERO, B), Step::Exhausted(700));
        // A late renewal is never a 429: wait within the budget, then 503.
        let s = seen(-1, -1, true, FailMode::Strict, false);
        assert_eq!(step(s, Duration::from_millis(100), B), Step::WaitRenewal(Duration::from_millis(500)));
        assert_eq!(step(s, B, B), Step::Unavailable);
        assert_eq!(step(s, B * 3, B), Step::Unavailable);
    }

    #[test]
    fn unreachable_follows_the_fail_mode() {
        // Strict: 503 at once, even with an old "empty" mark.
        assert_eq!(step(seen(-1, -1, false, FailMode::Strict, false), Duration::ZERO, B), Step::Unavailable);
        assert_eq!(step(seen(-1, 500, false, FailMode::Strict, false), Duration::ZERO, B), Step::Unavailable);
        // Bounded: spend again with the fallback; once it was tried, 503.
        assert_eq!(step(seen(-1, -1, false, FailMode::Bounded, false), Duration::ZERO, B), Step::Again);
        assert_eq!(step(seen(-1, -1, false, FailMode::Bounded, true), Duration::ZERO, B), Step::Unavailable);
    }

    #[test]
    fn the_acquire_rule_table() {
        use FailMode::{Bounded, Strict};
        let ms = Duration::from_millis;
        // (case, seen, waited so far, next step), budget B = 600 ms.
        let cases = [
            ("lease opens now", seen(0, -1, true, Strict, false), ms(0), Step::SleepOpen(ms(2))),
            (
                "lease opens at the open-wait limit",
                seen(MAX_OPEN_WAIT_MS, -1, true, Strict, false),
                ms(0),
                Step::SleepOpen(ms(252)),
            ),
            (
                "an opening lease beats an empty mark",
                seen(10, 900, true, Bounded, false),
                ms(0),
                Step::SleepOpen(ms(12)),
            ),
            (
                "an opening lease is waited for even unreachable",
                seen(10, -1, false, Strict, false),
                ms(0),
                Step::SleepOpen(ms(12)),
            ),
            ("pool empty, reachable: 429", seen(-1, 900, true, Bounded, false), ms(0), Step::Exhausted(900)),
            (
                "pool empty after the budget: still 429",
                seen(-1, 900, true, Bounded, false),
                ms(700),
                Step::Exhausted(900),
            ),
            ("no mark (0 ms left): wait", seen(-1, 0, true, Bounded, false), ms(0), Step::WaitRenewal(B)),
            (
                "no token, budget left: wait the rest",
                seen(-1, -1, true, Bounded, false),
                ms(250),
                Step::WaitRenewal(ms(350)),
            ),
            ("no token, budget spent: 503", seen(-1, -1, true, Bounded, false), ms(600), Step::Unavailable),
            ("unreachable, strict: 503", seen(-1, -1, false, Strict, false), ms(0), Step::Unavailable),
            (
                "unreachable, bounded: try the fallback",
                seen(-1, 900, false, Bounded, false),
                ms(0),
                Step::Again,
            ),
            (
                "unreachable, fallback tried and spent: 503",
                seen(-1, -1, false, Bounded, true),
                ms(0),
                Step::Unavailable,
            ),
        ];
        for (case, s, waited, want) in cases {
            assert_eq!(step(s, waited, B), want, "{case}");
        }
    }

    #[test]
    fn the_budget_bounds_every_wait() {
        let s = seen(-1, -1, true, FailMode::Bounded, false);
        let mut waited = Duration::ZERO;
        let mut tries = 0;
        while let Step::WaitRenewal(d) = step(s, waited, B) {
            assert!(d <= B);
            waited += d.max(Duration::from_millis(50));
            tries += 1;
        }
        assert!(waited >= B && tries <= 2, "{waited:?} {tries}");
    }
}

#[cfg(test)]
mod parse_tests {
    use super::*;

    fn field_of(body: &str) -> String {
        match parse(Ok(Bytes::from(body.to_string()))) {
            Err(Error::InvalidField { field, .. }) => field,
            other => panic!("{body}: {other:?}"),
        }
    }

    #[test]
    fn a_bad_value_names_its_field() {
        let cases = [
            (r#"{"tenant": "a", "resource": "r", "key": 7}"#, "key"),
            (r#"{"tenant": "a", "resource": "r", "cost": "x"}"#, "cost"),
            (r#"{"tenant": 1, "resource": "r"}"#, "tenant"),
            (r#"{"tenant": "a", "resource": "r", "request_id": []}"#, "request_id"),
            (r#"{"tenant": "a"}"#, "resource"),
            (r#"{"tenant": "a", "resource": "r", "colour": 1}"#, "colour"),
            (r#"{"tenant": "a", "resource": "r", "key": "a b"}"#, "key"),
            (r#"[]"#, "body"),
        ];
        for (body, field) in cases {
            assert_eq!(field_of(body), field, "{body}");
        }
        assert!(matches!(parse(Ok(Bytes::from_static(b"{not json"))), Err(Error::MalformedJson(_))));
    }
}
