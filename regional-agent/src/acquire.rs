//! `POST /v1/acquire` over HTTP: the body (one quota, or several of one
//! tenant in `resources`), its validation (a 4xx naming the field), and the
//! answer built from [`crate::spend`]'s decision (JSON, `RateLimit`
//! headers, metrics). Envoy's rate limit service ([`crate::rls`]) asks the
//! same decision over gRPC.

use crate::app::AppState;
use crate::error::{Error, ErrorAnswer, PolicyRefusal, Result};
use crate::quotas::PolicyInfo;
use crate::request::{
    check_key, visible_ascii, Acquire, Paid, ResourceCost, MAX_COST, MAX_REQUEST_ID_LEN, MAX_RESOURCES,
};
use crate::shed::{DEFAULT_PRIORITY, MAX_PRIORITY};
use crate::spend::decide;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use chrono::{DateTime, TimeZone, Utc};
use serde::{Deserialize, Serialize};
use std::time::Instant;
use tracing::field::Empty;

/// Routes of this module.
pub fn router() -> Router<AppState> {
    Router::new().route("/v1/acquire", post(acquire))
}

/// `POST /v1/acquire` body: one quota (`resource`, `cost`) or several of
/// the tenant's (`resources`), decided together: every limit allows and
/// is debited, or none is.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AcquireRequest {
    pub tenant: String,
    /// The quota (exactly one of `resource` and `resources`).
    #[serde(default)]
    pub resource: Option<String>,
    /// Tokens on `resource` (default 1; not with `resources`).
    #[serde(default)]
    pub cost: Option<i64>,
    /// Several quotas of the tenant, each with its cost (default 1), 1 to
    /// 8, each named once.
    #[serde(default)]
    #[schema(min_items = 1, max_items = 8)]
    pub resources: Option<Vec<ResourceCost>>,
    #[serde(default)]
    pub request_id: Option<String>,
    /// The principal (user, API key) whose per-key bucket the request
    /// spends: 1 to 128 visible ASCII characters. Required when a named
    /// quota's policy has `per_key` (422 otherwise); ignored by the others.
    #[serde(default)]
    #[schema(min_length = 1, max_length = 128, pattern = "^[!-~]{1,128}$")]
    pub key: Option<String>,
    /// 0 (most important: health checks, payment capture) to 4 (shed
    /// first), default 2. When this agent is overloaded it answers `503
    /// shed` to priority 4 first, then 3, then 2; 0 and 1 are never shed.
    #[serde(default)]
    #[schema(minimum = 0, maximum = 4, default = 2)]
    pub priority: Option<i64>,
}

const FIELDS: [&str; 8] =
    ["tenant", "resource", "cost", "resources", "request_id", "key", "priority", "body"];

fn parse(body: std::result::Result<Bytes, BytesRejection>) -> Result<Acquire> {
    let bytes = body?;
    // The path of the value that failed (`key` for `"key": 7`,
    // `resources[0].cost` for a bad cost in the list); `.` for the body
    // itself (a missing or unknown field, named in the message).
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
                let top = path.split(['[', '.']).next().unwrap_or("");
                let field = match quoted {
                    Some(f) if !path.starts_with("resources") => f.to_string(),
                    _ => FIELDS.into_iter().find(|f| *f == top).unwrap_or("body").to_string(),
                };
                Error::invalid(field, if path == "." { msg } else { format!("{path}: {msg}") })
            }
            _ => Error::MalformedJson(e.to_string()),
        }
    })?;
    quota_shared::ids::validate_id(&req.tenant)
        .map_err(|e| Error::invalid("tenant", format!("{:?} {e}", req.tenant)))?;
    let (wants, multi) = match (req.resource, req.resources) {
        (Some(resource), None) => (vec![ResourceCost { resource, cost: req.cost.unwrap_or(1) }], false),
        (None, Some(list)) => {
            if req.cost.is_some() {
                return Err(Error::invalid("cost", "with `resources`, each entry carries its own cost"));
            }
            if list.is_empty() || list.len() > MAX_RESOURCES {
                return Err(Error::invalid(
                    "resources",
                    format!("must name 1 to {MAX_RESOURCES} quotas, got {}", list.len()),
                ));
            }
            (list, true)
        }
        (Some(_), Some(_)) => {
            return Err(Error::invalid("resources", "name either `resource` or `resources`, not both"))
        }
        (None, None) => {
            return Err(Error::invalid("resource", "missing field `resource` (or `resources`)"));
        }
    };
    let field = |single| if multi { "resources" } else { single };
    for (i, w) in wants.iter().enumerate() {
        quota_shared::ids::validate_id(&w.resource)
            .map_err(|e| Error::invalid(field("resource"), format!("{:?} {e}", w.resource)))?;
        if !(1..=MAX_COST).contains(&w.cost) {
            return Err(Error::invalid(
                field("cost"),
                format!("cost must be between 1 and {MAX_COST}, got {}", w.cost),
            ));
        }
        if wants[..i].iter().any(|o| o.resource == w.resource) {
            return Err(Error::invalid("resources", format!("{:?} is named twice", w.resource)));
        }
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
        check_key(k)?;
    }
    let priority = match req.priority {
        None => DEFAULT_PRIORITY,
        Some(p) => u8::try_from(p)
            .ok()
            .filter(|p| *p <= MAX_PRIORITY)
            .ok_or_else(|| Error::invalid("priority", format!("must be 0 to {MAX_PRIORITY}, got {p}")))?,
    };
    Ok(Acquire { tenant: req.tenant, wants, multi, request_id: req.request_id, key: req.key, priority })
}

/// `POST /v1/acquire`: one admission decision.
#[utoipa::path(
    post,
    path = "/v1/acquire",
    request_body = AcquireRequest,
    responses(
        (status = 200, description = "Admitted: the top-level fields are those of the quota with the fewest tokens left; with `resources`, also `results` in the request's order; carries RateLimit-Policy and RateLimit for the most restrictive limit", body = Admitted),
        (status = 400, description = "Malformed JSON", body = ErrorAnswer),
        (status = 404, description = "unknown_quota: the allocator has no policy for it", body = ErrorAnswer),
        (status = 413, description = "payload_too_large: the body is over 64 KiB", body = ErrorAnswer),
        (status = 422, description = "Invalid value; the message names the field (also: key missing for a quota with a per-key limit, cost above its burst, both or neither of resource and resources, a quota named twice)", body = ErrorAnswer),
        (status = 409, description = "request_id_mismatch: the request_id was first used with other resources or costs (tenant-wide, until its window ends)", body = ErrorAnswer),
        (status = 429, description = "quota_exhausted (limit: the resource; only when the allocator said the pool is empty) or per_key_limited (limit: per_key; the key's bucket holds less than the cost, Retry-After from its refill); nothing was debited on any quota; with Retry-After, RateLimit-Policy and RateLimit", body = ErrorAnswer),
        (status = 503, description = "allocator_unreachable (strict mode), store_unavailable, shed (this agent is overloaded and sheds the request's priority, 2 to 4, before any work: nothing was charged), or policy_stale (the quota's policy is older than --max-policy-age-secs while the allocator is unreachable, and its on_stale is fail_mode with fail_mode strict), with Retry-After", body = ErrorAnswer),
    ),
    tag = "agent"
)]
#[tracing::instrument(skip_all, fields(tenant = Empty, resource = Empty, cost = Empty, outcome = Empty))]
pub(crate) async fn acquire(
    State(app): State<AppState>,
    body: std::result::Result<Bytes, BytesRejection>,
) -> Response {
    let started = Instant::now();
    let mut policies = Vec::new();
    let span = tracing::Span::current();
    let req = match parse(body) {
        Ok(r) => r,
        Err(e) => {
            span.record("outcome", e.code());
            app.metrics.inc("agent_acquire_total", &[("outcome", e.code())]);
            app.metrics.observe("agent_acquire_seconds", &[], started.elapsed().as_secs_f64());
            let mut resp = e.into_response();
            // Every answer carries the headers; no policy is known here.
            let now = app.clock.now_utc();
            crate::headers::rate_limit_headers(resp.headers_mut(), "unknown", None, Some(0), None, now);
            return resp;
        }
    };
    span.record("tenant", req.tenant.as_str());
    span.record("resource", req.wants.iter().map(|w| w.resource.as_str()).collect::<Vec<_>>().join(","));
    span.record("cost", req.wants.iter().map(|w| w.cost).sum::<i64>());
    if !req.multi && app.permits.is_concurrency(&req.tenant, &req.wants[0].resource) {
        return permit(&app, &req, started).await;
    }
    // Boxed: the decision's future is deep (scripts, batches, waits), and
    // the handler's layout would exceed the compiler's query depth.
    let result = Box::pin(decide(&app.decider, &req, &mut policies)).await;
    if let Err((Error::PolicyRefuses { reason: PolicyRefusal::ConcurrencyQuota, .. }, _)) = &result {
        // The first acquire of a concurrency quota this replica sees: the
        // grant answer named its kind.
        if !req.multi && app.permits.is_concurrency(&req.tenant, &req.wants[0].resource) {
            return permit(&app, &req, started).await;
        }
    }
    let now = app.clock.now_utc();
    let name = |i: usize| format!("{}/{}", req.tenant, req.wants[i].resource);
    // The quota the headers describe, its balance and its key's.
    let (outcome, shown, mut resp) = match result {
        Ok(d) => {
            let results: Vec<AdmittedPart> = d
                .parts
                .iter()
                .enumerate()
                .map(|(i, p)| AdmittedPart::of(&req.wants[i].resource, p, policies.get(i).copied()))
                .collect();
            // The top level: the quota with the fewest tokens left (the
            // one a client backs off for first).
            let top = (0..d.parts.len())
                .min_by_key(|&i| (d.parts[i].shadow.is_some(), d.parts[i].admit.remaining))
                .unwrap_or(0);
            let body = Admitted::new(&results, top, req.multi);
            let sources: Vec<&str> = d.parts.iter().map(|p| p.outcome()).collect();
            let outcome = if sources.contains(&"shadow_refused") {
                "shadow_refused"
            } else if sources.contains(&"fallback") {
                "fallback"
            } else {
                "lease"
            };
            if outcome == "fallback" {
                app.metrics.inc("agent_fallback_admits_total", &[]);
            }
            for (i, p) in d.parts.iter().enumerate() {
                count(&app, &name(i), policies.get(i).copied(), p.outcome());
            }
            let tightest = d.tightest(name, &policies, now);
            let (remaining, key_remaining) = d.parts[tightest].shown();
            (outcome, (tightest, remaining, key_remaining), (StatusCode::OK, Json(body)).into_response())
        }
        Err((e, at)) => {
            let shown = match at {
                Some(i) => {
                    let (remaining, key_remaining) = crate::request::refusal_shown(&e);
                    (i, remaining, key_remaining)
                }
                None => (0, Some(0), None),
            };
            let code = e.code();
            for i in 0..req.wants.len() {
                if at.is_none_or(|a| a == i) {
                    count(&app, &name(i), policies.get(i).copied(), code);
                }
            }
            (code, shown, e.into_response())
        }
    };
    span.record("outcome", outcome);
    let (i, remaining, key_remaining) = shown;
    tracing::debug!(remaining, "acquire answered");
    let policy = policies.get(i).copied();
    crate::headers::rate_limit_headers(resp.headers_mut(), &name(i), policy, remaining, key_remaining, now);
    app.metrics.inc("agent_acquire_total", &[("outcome", outcome)]);
    app.metrics.observe("agent_acquire_seconds", &[], started.elapsed().as_secs_f64());
    resp
}

/// An acquire of one concurrency quota (see [`crate::permits`]): a permit,
/// or why not, with the policy version that decided when it is known.
async fn permit(app: &AppState, req: &Acquire, started: Instant) -> Response {
    let r = Box::pin(crate::permit_routes::decide(app, req)).await;
    let (outcome, version, mut resp) = match r {
        Ok(t) => (
            "permit",
            Some(t.policy.version),
            Json(Admitted::permit(&t, app.clock.now_utc())).into_response(),
        ),
        Err(e) => {
            let version = app
                .permits
                .get(&req.tenant, &req.wants[0].resource)
                .and_then(|q| q.policy())
                .map(|p| p.version);
            (e.code(), version, e.into_response())
        }
    };
    if let Some(v) = version {
        resp.headers_mut().insert(crate::headers::POLICY_VERSION_HEADER, axum::http::HeaderValue::from(v));
    }
    tracing::Span::current().record("outcome", outcome);
    app.metrics.inc("agent_acquire_total", &[("outcome", outcome)]);
    app.metrics.observe("agent_acquire_seconds", &[], started.elapsed().as_secs_f64());
    resp
}

/// One quota's counts of an answer (refusal gauges, the fleet status and
/// with it a staged rollout's counts per version), over HTTP or RLS.
pub fn count(app: &AppState, name: &str, policy: Option<PolicyInfo>, outcome: &str) {
    crate::gauges::count_decision(&app.metrics, name, policy, outcome);
    app.fleet_status.count(name, policy, outcome, app.allocator_now());
}

/// One quota's part of a `200` (`results[i]`, in the request's order).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct AdmittedPart {
    pub resource: String,
    /// `lease`, `fallback` (the region's fallback allowance, the allocator
    /// being unreachable) or `shadow` (a shadow-mode policy's refusal,
    /// admitted anyway).
    pub source: String,
    pub window_start: DateTime<Utc>,
    /// The region's lease balance of the quota after this admit.
    pub remaining: i64,
    /// With a per-key limit: whole tokens left in the key's bucket.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_remaining: Option<i64>,
    /// A policy in shadow mode: whether an enforced one would answer 429.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shadow_refused: Option<bool>,
    /// After a shadow refusal: what would have refused (the resource, or
    /// `per_key`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<String>,
    /// The version of the quota's policy that decided.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy_version: Option<i64>,
}

impl AdmittedPart {
    fn of(resource: &str, p: &Paid, policy: Option<PolicyInfo>) -> AdmittedPart {
        let a = &p.admit;
        AdmittedPart {
            resource: resource.to_string(),
            source: a.source.clone(),
            window_start: Utc.timestamp_opt(a.window_start, 0).single().unwrap_or_default(),
            remaining: a.remaining,
            key_remaining: a.key_remaining,
            shadow_refused: policy.is_some_and(|p| !p.enforce).then_some(p.shadow.is_some()),
            limit: p.shadow.map(|s| s.limit(resource).to_string()),
            policy_version: policy.map(|p| p.version),
        }
    }
}

/// `200` on `POST /v1/acquire`: admitted. The top-level fields are those
/// of the quota with the fewest tokens left; with `resources`, `results`
/// lists every quota.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Admitted {
    /// Always `true` (a refusal is a 429).
    pub allowed: bool,
    pub source: String,
    pub window_start: DateTime<Utc>,
    pub remaining: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_remaining: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shadow_refused: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<String>,
    /// The version of the top-level quota's policy that decided (also in
    /// the `Quota-Policy-Version` header, of the quota the `RateLimit`
    /// headers describe).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy_version: Option<i64>,
    /// With `resources`: one part per quota, in the request's order.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub results: Option<Vec<AdmittedPart>>,
    /// A concurrency quota's permit (`source: "permit"`): release it with
    /// `POST /v1/permits/{permit_id}/release`, extend it with `/renew`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub permit_id: Option<String>,
    /// The permit's life from now (its policy's `permit_ttl_secs`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub permit_expires_in_ms: Option<i64>,
}

impl Admitted {
    /// The answer whose top level is part `top` of `parts`.
    fn new(parts: &[AdmittedPart], top: usize, multi: bool) -> Admitted {
        let t = parts.get(top).cloned().unwrap_or_else(|| AdmittedPart {
            resource: String::new(),
            source: "lease".into(),
            window_start: DateTime::<Utc>::default(),
            remaining: 0,
            key_remaining: None,
            shadow_refused: None,
            limit: None,
            policy_version: None,
        });
        Admitted {
            allowed: true,
            source: t.source,
            window_start: t.window_start,
            remaining: t.remaining,
            key_remaining: t.key_remaining,
            shadow_refused: t.shadow_refused,
            limit: t.limit,
            policy_version: t.policy_version,
            results: multi.then(|| parts.to_vec()),
            permit_id: None,
            permit_expires_in_ms: None,
        }
    }

    /// The answer of a permit handed out at `now`: `remaining` is what the
    /// region's lease holds beyond the permits out, `window_start` the
    /// hand-out instant.
    pub(crate) fn permit(t: &crate::permits::lease::Taken, now: DateTime<Utc>) -> Admitted {
        Admitted {
            allowed: true,
            source: "permit".into(),
            window_start: now,
            remaining: t.left,
            key_remaining: None,
            shadow_refused: None,
            limit: None,
            policy_version: Some(t.policy.version),
            results: None,
            permit_id: Some(t.permit_id.clone()),
            permit_expires_in_ms: Some(t.expires_in_ms),
        }
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
    fn a_null_cost_is_1_in_both_forms() {
        for body in [
            r#"{"tenant": "a", "resource": "r", "cost": null}"#,
            r#"{"tenant": "a", "resources": [{"resource": "r", "cost": null}]}"#,
            r#"{"tenant": "a", "resources": [{"resource": "r"}]}"#,
        ] {
            let a = parse(Ok(Bytes::from(body.to_string()))).unwrap_or_else(|e| panic!("{body}: {e:?}"));
            assert_eq!(a.wants[0].cost, 1, "{body}");
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

    fn part(resource: &str, remaining: i64) -> AdmittedPart {
        AdmittedPart {
            resource: resource.into(),
            source: "lease".into(),
            window_start: Utc.timestamp_opt(3600, 0).unwrap(),
            remaining,
            key_remaining: None,
            shadow_refused: None,
            limit: None,
            policy_version: Some(remaining + 10),
        }
    }

    #[test]
    fn an_admit_shows_its_top_part_without_a_resource_and_lists_parts_only_for_resources() {
        let parts = [part("a", 5), part("b", 2)];
        let single = serde_json::to_value(Admitted::new(&parts[..1], 0, false)).unwrap();
        assert_eq!(
            single,
            serde_json::json!({"allowed": true, "source": "lease", "window_start": "1970-01-01T01:00:00Z", "remaining": 5, "policy_version": 15})
        );
        let multi = serde_json::to_value(Admitted::new(&parts, 1, true)).unwrap();
        assert_eq!(multi["remaining"], 2);
        // The top level's version is the top part's; each part keeps its own.
        assert_eq!(multi["policy_version"], 12);
        assert_eq!(multi["results"][0]["policy_version"], 15);
        assert!(multi.get("resource").is_none(), "{multi}");
        assert_eq!(multi["results"][0]["resource"], "a");
        assert_eq!(multi["results"][1]["resource"], "b");
    }
}
