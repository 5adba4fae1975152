//! Envoy's rate limit service on the agent (`--grpc-listen`): gRPC
//! `envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit`, what
//! Envoy's `envoy.filters.http.ratelimit` filter (and Istio, Envoy Gateway,
//! Contour) calls, and `grpc.health.v1.Health`. Message types come from
//! the `envoy-types` crate (prost code generated from Envoy's own protos).
//!
//! Mapping (docs/envoy.md): `domain` is the tenant; in each
//! descriptor the entry whose key is `--rls-resource-key` (default
//! `resource`) names the quota and the entry whose key is
//! `--rls-key-entry` (default `user`) names the per-key principal; other
//! entries are ignored. The cost is the descriptor's `hits_addend` if set,
//! else the request's (0 meaning 1). A descriptor without a resource
//! entry, or naming a quota with no policy, is not limited (`OK`, no state
//! created). All descriptors of a request are decided in one run of the
//! spend script (the same decision as `POST /v1/acquire` with
//! `resources`): all admitted or none. Descriptors naming the same quota
//! add their costs.
//!
//! Envoy lets a request through on any gRPC error unless
//! `failure_mode_deny` is set, so what the agent can decide to refuse is a
//! refusal, never an error: a request its quota's policy can never admit
//! as sent (no principal for a per-key limit, a cost above the per-key
//! burst or the limit, see [`PolicyRefusal`]) answers `OVER_LIMIT` with
//! the reason in an `x-quota-refused` header and in
//! `agent_rls_policy_refusals_total`, and charges nothing. Errors are kept
//! for what cannot be decided: the cases HTTP answers 503 are
//! `UNAVAILABLE`, a malformed request (a bad domain or entry value, an
//! entry key the agent reads given twice, undecodable bytes)
//! `INVALID_ARGUMENT`, whose message names the problem and echoes at most
//! [`ECHO_MAX`] bytes of any value.

use crate::app::AppState;
use crate::config::RlsMapping as Mapping;
use crate::error::{Error, PolicyRefusal};
use crate::quotas::PolicyInfo;
use crate::request::{self, Acquire, Decided, ResourceCost};
use crate::shed::{DEFAULT_PRIORITY, MAX_PRIORITY};
use crate::spend;
use crate::store::Store;
use envoy_types::pb::envoy::config::core::v3::HeaderValue;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{
    Code, DescriptorStatus, RateLimit,
};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::{
    RateLimitService, RateLimitServiceServer,
};
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::Duration as PbDuration;
use quota_shared::window::Window;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

/// Most descriptors one request may carry.
pub const MAX_DESCRIPTORS: usize = 64;
/// How often the health service looks at Redis.
const HEALTH_EVERY: Duration = Duration::from_secs(1);
/// The service name the health service reports besides the server's ("").
pub const SERVICE_NAME: &str = "envoy.service.ratelimit.v3.RateLimitService";

/// Most bytes of a request's value an error message repeats.
pub const ECHO_MAX: usize = 128;
/// Most bytes of an error message (Envoy and gRPC clients carry it in a
/// header: a 1 MB echo made standard clients fail on the header instead).
pub const MESSAGE_MAX: usize = 1024;
/// The header of a policy refusal's reason ([`PolicyRefusal::label`]), of
/// a shed request ([`SHED_REASON`]) or of a stale policy's ([`STALE_REASON`]).
pub const REFUSED_HEADER: &str = "x-quota-refused";
/// [`REFUSED_HEADER`]'s value for a request shed by priority.
pub const SHED_REASON: &str = "shed";
/// [`REFUSED_HEADER`]'s value for a request refused because its quota's
/// policy is stale and says to fail closed (see [`crate::stale`]).
pub const STALE_REASON: &str = "policy_stale";
/// The descriptor entry that gives the request's priority (0 to 4, see
/// [`crate::shed`]); when descriptors give several, the most important
/// (lowest) counts.
pub const PRIORITY_ENTRY: &str = "priority";

/// `v` quoted, cut to [`ECHO_MAX`] bytes (on a character boundary).
pub fn echo(v: &str) -> String {
    if v.len() <= ECHO_MAX {
        return format!("{v:?}");
    }
    let mut end = ECHO_MAX;
    while !v.is_char_boundary(end) {
        end -= 1;
    }
    format!("{:?}... ({} bytes)", &v[..end], v.len())
}

/// `m` cut to [`MESSAGE_MAX`] bytes (on a character boundary).
fn bounded(mut m: String) -> String {
    if m.len() > MESSAGE_MAX {
        let mut end = MESSAGE_MAX;
        while !m.is_char_boundary(end) {
            end -= 1;
        }
        m.truncate(end);
    }
    m
}

/// A request as the agent reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Read {
    pub tenant: String,
    /// The quotas of the decision, each once, costs added.
    pub wants: Vec<(String, i64)>,
    /// For each descriptor, in order, the index of its quota in `wants`
    /// (`None`: not limited).
    pub of: Vec<Option<usize>>,
    /// The principal the descriptors name, if any.
    pub key: Option<String>,
    /// The request's priority (the lowest any descriptor gives, else the default).
    pub priority: u8,
    /// The first descriptor whose quota's added cost is above
    /// [`request::MAX_COST`]: no quota admits it, refused without a decision.
    pub too_costly: Option<usize>,
}

/// Reads a request into one decision's quotas (pure; the error is the
/// `INVALID_ARGUMENT` message).
pub fn read(req: &RateLimitRequest, m: &Mapping) -> Result<Read, String> {
    quota_shared::ids::validate_id(&req.domain).map_err(|e| format!("domain {} {e}", echo(&req.domain)))?;
    if req.descriptors.len() > MAX_DESCRIPTORS {
        return Err(format!("at most {MAX_DESCRIPTORS} descriptors, got {}", req.descriptors.len()));
    }
    let request_cost = i64::from(req.hits_addend.max(1));
    let mut read = Read {
        tenant: req.domain.clone(),
        wants: Vec::new(),
        of: Vec::new(),
        key: None,
        priority: DEFAULT_PRIORITY,
        too_costly: None,
    };
    let mut priority: Option<u8> = None;
    for (i, d) in req.descriptors.iter().enumerate() {
        let (resource, key, p) = entries(d, m).map_err(|e| format!("descriptor {i}: {e}"))?;
        if let Some(p) = p {
            priority = Some(priority.map_or(p, |q| q.min(p)));
        }
        if d.is_negative_hits {
            return Err(format!("descriptor {i}: negative hits (refunds) are not supported"));
        }
        let cost = match &d.hits_addend {
            Some(h) if h.value == 0 => {
                return Err(format!("descriptor {i}: hits_addend 0 (a check without a hit) is not supported"))
            }
            Some(h) => i64::try_from(h.value).unwrap_or(i64::MAX),
            None => request_cost,
        };
        if let Some(k) = key {
            match &read.key {
                Some(other) if *other != k => {
                    return Err(format!(
                        "descriptor {i}: names principal {}, another descriptor {}; one request has one principal",
                        echo(&k),
                        echo(other)
                    ))
                }
                _ => read.key = Some(k),
            }
        }
        let Some(resource) = resource else {
            read.of.push(None);
            continue;
        };
        let at = match read.wants.iter().position(|(r, _)| *r == resource) {
            Some(at) => {
                read.wants[at].1 = read.wants[at].1.saturating_add(cost);
                at
            }
            None => {
                read.wants.push((resource, cost));
                read.wants.len() - 1
            }
        };
        read.of.push(Some(at));
    }
    read.priority = priority.unwrap_or(DEFAULT_PRIORITY);
    if read.wants.len() > request::MAX_RESOURCES {
        return Err(format!(
            "at most {} distinct quotas per request, got {}",
            request::MAX_RESOURCES,
            read.wants.len()
        ));
    }
    if let Some(w) = read.wants.iter().position(|(_, c)| *c > request::MAX_COST) {
        read.too_costly = read.of.iter().position(|o| *o == Some(w));
    }
    Ok(read)
}

/// A descriptor's quota, principal and priority entries.
type Entries = (Option<String>, Option<String>, Option<u8>);

/// A descriptor's quota, principal and priority entries.
fn entries(d: &RateLimitDescriptor, m: &Mapping) -> Result<Entries, String> {
    let (mut resource, mut key, mut priority) = (None, None, None);
    for e in &d.entries {
        if e.key == PRIORITY_ENTRY && e.key != m.resource_key && e.key != m.key_entry {
            if priority.is_some() {
                return Err(format!(
                    "entry {PRIORITY_ENTRY} is given twice; the descriptor must name it once"
                ));
            }
            let p = e.value.parse::<u8>().ok().filter(|p| *p <= MAX_PRIORITY).ok_or_else(|| {
                format!("{PRIORITY_ENTRY} must be 0 to {MAX_PRIORITY}, got {}", echo(&e.value))
            })?;
            priority = Some(p);
            continue;
        }
        // Entries the agent reads must be unambiguous; others (Envoy's
        // `path`, `generic_key` ...) are not read and may repeat.
        let seen =
            if e.key == m.resource_key { resource.is_some() } else { e.key == m.key_entry && key.is_some() };
        if seen {
            return Err(format!("entry {} is given twice; the descriptor must name it once", echo(&e.key)));
        }
        if e.key == m.resource_key {
            quota_shared::ids::validate_id(&e.value)
                .map_err(|err| format!("{} {} {err}", e.key, echo(&e.value)))?;
            resource = Some(e.value.clone());
        } else if e.key == m.key_entry {
            if !request::visible_ascii(&e.value, request::MAX_KEY_LEN) {
                return Err(format!(
                    "{} must be 1 to {} visible ASCII characters",
                    e.key,
                    request::MAX_KEY_LEN
                ));
            }
            key = Some(e.value.clone());
        }
    }
    Ok((resource, key, priority))
}

/// The policy as Envoy's `RateLimit`: `limit` per unit when the window is
/// one (1 s, 60 s, 3600 s, 86400 s), else `UNKNOWN` with the exact window
/// in `name` (`"<limit> per <W>s"`).
pub fn current_limit(tenant: &str, resource: &str, p: PolicyInfo) -> RateLimit {
    let unit = match p.window_secs {
        1 => Unit::Second,
        60 => Unit::Minute,
        3600 => Unit::Hour,
        86_400 => Unit::Day,
        _ => Unit::Unknown,
    };
    let name = match unit {
        Unit::Unknown => format!("{tenant}/{resource}: {} per {}s", p.limit, p.window_secs),
        _ => format!("{tenant}/{resource}"),
    };
    RateLimit { name, requests_per_unit: u32::try_from(p.limit).unwrap_or(u32::MAX), unit: unit as i32 }
}

fn pb_duration(ms: i64) -> PbDuration {
    let ms = ms.max(0);
    PbDuration { seconds: ms / 1000, nanos: ((ms % 1000) * 1_000_000) as i32 }
}

fn clamp_u32(v: i64) -> u32 {
    u32::try_from(v.max(0)).unwrap_or(u32::MAX)
}

/// The gRPC status of a refusal that is not an over-limit.
fn status_of(e: &Error) -> Status {
    match e.status_code().as_u16() {
        503 => Status::unavailable(bounded(e.to_string())),
        _ => Status::invalid_argument(bounded(e.to_string())),
    }
}

/// What one run of the decision gives the answer: the quotas it decided
/// (indices into `Read::wants`, in order), their policies, and its result
/// (`None`: nothing was limited; a refusal names the position, among the
/// decided quotas, of the one that refused).
struct Outcome<'a> {
    decided: &'a [usize],
    policies: &'a [PolicyInfo],
    result: Option<Result<&'a Decided, (&'a Error, usize)>>,
    now: chrono::DateTime<chrono::Utc>,
}

/// A request refused before any quota was spent: `OVER_LIMIT` overall and
/// on the descriptors `over` names, the others `OK`, the reason in
/// [`REFUSED_HEADER`].
fn refusal(read: &Read, over: impl Fn(usize) -> bool, reason: &str) -> RateLimitResponse {
    let statuses = (0..read.of.len())
        .map(|i| DescriptorStatus {
            code: if over(i) { Code::OverLimit } else { Code::Ok } as i32,
            ..Default::default()
        })
        .collect();
    RateLimitResponse {
        overall_code: Code::OverLimit as i32,
        statuses,
        response_headers_to_add: vec![HeaderValue {
            key: REFUSED_HEADER.into(),
            value: reason.into(),
            ..Default::default()
        }],
        ..Default::default()
    }
}

/// Refused by the descriptor that made the request unadmittable: that
/// descriptor `OVER_LIMIT`, the others `OK`.
fn refused(read: &Read, descriptor: usize, reason: PolicyRefusal) -> RateLimitResponse {
    refusal(read, |i| i == descriptor, reason.label())
}

/// Shed by priority (see [`crate::shed`]): every descriptor `OVER_LIMIT`,
/// nothing charged, the reason [`SHED_REASON`].
fn shed(read: &Read) -> RateLimitResponse {
    refusal(read, |_| true, SHED_REASON)
}

/// The service (one per agent, sharing its state).
pub struct Rls {
    app: AppState,
    mapping: Mapping,
}

impl Rls {
    /// Decides `read`; quotas with no policy are left out of the decision
    /// (not limited) and the others decided again.
    async fn decide(&self, read: &Read) -> Result<RateLimitResponse, Status> {
        if let Some(i) = read.too_costly {
            return Ok(self.policy_refusal(read, i, PolicyRefusal::CostAboveLimit));
        }
        let now = self.app.clock.now_utc();
        let mut limited: Vec<bool> = vec![true; read.wants.len()];
        loop {
            let idx: Vec<usize> = (0..read.wants.len()).filter(|&i| limited[i]).collect();
            let outcome = |policies, result| Outcome { decided: &idx, policies, result, now };
            let req = Acquire {
                tenant: read.tenant.clone(),
                wants: idx
                    .iter()
                    .map(|&i| ResourceCost { resource: read.wants[i].0.clone(), cost: read.wants[i].1 })
                    .collect(),
                multi: true,
                request_id: None,
                key: read.key.clone(),
                priority: read.priority,
            };
            if req.wants.is_empty() {
                return Ok(self.answer(read, &outcome(&[], None)));
            }
            let mut policies = Vec::new();
            match spend::decide(&self.app.decider, &req, &mut policies).await {
                Ok(d) => return Ok(self.answer(read, &outcome(&policies, Some(Ok(&d))))),
                Err((Error::UnknownQuota(_), Some(at))) => limited[idx[at]] = false,
                Err((
                    e @ (Error::Exhausted { .. } | Error::KeyLimited { .. } | Error::Reserved { .. }),
                    Some(at),
                )) => return Ok(self.answer(read, &outcome(&policies, Some(Err((&e, at)))))),
                Err((Error::PolicyRefuses { reason, .. }, Some(at))) => {
                    // The first descriptor of the quota that refused.
                    let d = read.of.iter().position(|o| *o == Some(idx[at])).unwrap_or(0);
                    return Ok(self.policy_refusal(read, d, reason));
                }
                // A shed is a refusal, not an error: Envoy lets a request
                // through on an error when failure_mode_deny is off.
                Err((Error::Shed { .. }, _)) => return Ok(shed(read)),
                // A stale policy that says to fail closed refuses (its
                // quota's descriptors), for the same reason.
                Err((Error::PolicyStale { .. }, Some(at))) => {
                    return Ok(refusal(read, |d| read.of[d] == Some(idx[at]), STALE_REASON))
                }
                Err((e, _)) => return Err(status_of(&e)),
            }
        }
    }

    /// [`refused`], counted by reason.
    fn policy_refusal(&self, read: &Read, descriptor: usize, reason: PolicyRefusal) -> RateLimitResponse {
        self.app.metrics.inc("agent_rls_policy_refusals_total", &[("reason", reason.label())]);
        refused(read, descriptor, reason)
    }

    /// The answer: one status per descriptor, in order.
    fn answer(&self, read: &Read, o: &Outcome) -> RateLimitResponse {
        // The position of each quota among those decided.
        let mut pos = vec![None; read.wants.len()];
        for (p, &w) in o.decided.iter().enumerate() {
            pos[w] = Some(p);
        }
        let over = matches!(o.result, Some(Err(_)));
        // Counted like HTTP's answers: each quota admitted, or the one that refused.
        for (p, &w) in o.decided.iter().enumerate() {
            let outcome = match o.result {
                Some(Ok(d)) => d.parts.get(p).map(|part| part.outcome()),
                Some(Err((e, at))) if at == p => Some(e.code()),
                _ => None,
            };
            if let Some(outcome) = outcome {
                let name = format!("{}/{}", read.tenant, read.wants[w].0);
                crate::acquire::count(&self.app, &name, o.policies.get(p).copied(), outcome);
            }
        }
        let statuses = read
            .of
            .iter()
            .map(|w| {
                let Some((w, p)) = w.and_then(|w| pos[w].map(|p| (w, p))) else {
                    return DescriptorStatus { code: Code::Ok as i32, ..Default::default() };
                };
                let Some(policy) = o.policies.get(p).copied() else {
                    return DescriptorStatus { code: Code::Ok as i32, ..Default::default() };
                };
                let reset = Window::containing(o.now, policy.window_secs).ms_until_end(o.now);
                let mut s = DescriptorStatus {
                    code: Code::Ok as i32,
                    current_limit: Some(current_limit(&read.tenant, &read.wants[w].0, policy)),
                    duration_until_reset: Some(pb_duration(reset)),
                    ..Default::default()
                };
                match o.result {
                    Some(Ok(d)) => {
                        if let Some(part) = d.parts.get(p) {
                            s.limit_remaining = clamp_u32(part.quota_left());
                        }
                    }
                    Some(Err((e, refused))) if refused == p => {
                        s.code = Code::OverLimit as i32;
                        if let Error::KeyLimited { remaining, retry_after_ms, .. } = e {
                            s.limit_remaining = clamp_u32(*remaining);
                            s.duration_until_reset = Some(pb_duration(*retry_after_ms));
                        }
                    }
                    _ => {}
                }
                s
            })
            .collect();
        let mut resp = RateLimitResponse {
            overall_code: if over { Code::OverLimit as i32 } else { Code::Ok as i32 },
            statuses,
            ..Default::default()
        };
        if self.mapping.headers {
            resp.response_headers_to_add = headers(read, o);
        }
        resp
    }
}

/// `RateLimit`, `RateLimit-Policy` (and on a refusal `Retry-After`) as the
/// HTTP answer would carry them.
fn headers(read: &Read, o: &Outcome) -> Vec<HeaderValue> {
    let name = |i: usize| {
        let resource = o.decided.get(i).map_or("unknown", |&w| read.wants[w].0.as_str());
        format!("{}/{resource}", read.tenant)
    };
    let mut h = axum::http::HeaderMap::new();
    let mut retry = None;
    match o.result {
        Some(Ok(d)) => {
            let tightest = d.tightest(name, o.policies, o.now);
            let (r, k) = d.parts[tightest].shown();
            crate::headers::rate_limit_headers(
                &mut h,
                &name(tightest),
                o.policies.get(tightest).copied(),
                r,
                k,
                o.now,
            );
        }
        Some(Err((e, at))) => {
            let (r, k) = request::refusal_shown(e);
            crate::headers::rate_limit_headers(&mut h, &name(at), o.policies.get(at).copied(), r, k, o.now);
            retry = e.retry_after_s();
        }
        None => return Vec::new(),
    }
    let mut out: Vec<HeaderValue> = h
        .iter()
        .filter_map(|(k, v)| {
            Some(HeaderValue {
                key: k.as_str().to_string(),
                value: v.to_str().ok()?.to_string(),
                ..Default::default()
            })
        })
        .collect();
    if let Some(s) = retry {
        out.push(HeaderValue { key: "retry-after".into(), value: s.to_string(), ..Default::default() });
    }
    out
}

/// Declares the RLS metric families.
pub fn describe(m: &quota_shared::prom::Registry) {
    m.describe(
        "agent_rls_decisions_total",
        "counter",
        "ShouldRateLimit answers by code (ok, over_limit, unavailable, invalid_argument)",
    );
    m.describe("agent_rls_seconds", "histogram", "ShouldRateLimit latency inside the agent");
    m.describe(
        "agent_rls_policy_refusals_total",
        "counter",
        "ShouldRateLimit requests answered OVER_LIMIT because their quota's policy can never admit them as sent, by reason (principal_missing, cost_above_burst, cost_above_limit)",
    );
}

#[tonic::async_trait]
impl RateLimitService for Rls {
    async fn should_rate_limit(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        let started = std::time::Instant::now();
        let result = match read(request.get_ref(), &self.mapping) {
            Ok(r) => self.decide(&r).await,
            Err(msg) => Err(Status::invalid_argument(bounded(msg))),
        };
        let code = match &result {
            Ok(r) if r.overall_code == Code::OverLimit as i32 => "over_limit",
            Ok(_) => "ok",
            Err(s) if s.code() == tonic::Code::Unavailable => "unavailable",
            Err(_) => "invalid_argument",
        };
        self.app.metrics.inc("agent_rls_decisions_total", &[("code", code)]);
        self.app.metrics.observe("agent_rls_seconds", &[], started.elapsed().as_secs_f64());
        result.map(Response::new)
    }
}

/// The start of the message tonic's prost codec gives a request it cannot
/// decode (invalid UTF-8 in a string field, a truncated message).
const DECODE_FAILED: &str = "failed to decode Protobuf message";

/// Rewrites the `INTERNAL` status tonic answers for a request it cannot
/// decode into `INVALID_ARGUMENT`: the caller sent bytes that are not a
/// request, nothing inside the agent failed (gRPC's status code guide says
/// INTERNAL for a parse error, which makes clients and alerts blame the
/// server). The agent's own code never answers INTERNAL.
pub fn undecodable_is_invalid_argument<B>(mut resp: axum::http::Response<B>) -> axum::http::Response<B> {
    let h = resp.headers();
    let internal = h.get("grpc-status").is_some_and(|v| v == "13");
    let undecodable = h.get("grpc-message").and_then(|v| v.to_str().ok()).is_some_and(|m| {
        // grpc-message is percent-encoded; the start is plain ASCII either way.
        m.replace("%20", " ").starts_with(DECODE_FAILED)
    });
    if internal && undecodable {
        let code = axum::http::HeaderValue::from(tonic::Code::InvalidArgument as i32);
        resp.headers_mut().insert("grpc-status", code);
    }
    resp
}

/// Serves RLS and the health service on `listener` until `stop` is
/// cancelled (then in-flight calls finish; the caller bounds the wait).
///
/// The connections are served by `--grpc-threads` threads, each a
/// single-threaded runtime owning the connections dealt to it: an HTTP/2
/// call hops from the connection's task to a task of its own and back,
/// and on a shared multi-threaded runtime each hop could wake the other
/// worker (docs/envoy.md "Threads": 39-44 against 63-67 µs of agent CPU
/// per decision at 16 streams). A spend run an RLS call starts runs on its
/// thread too (so it batches the calls that came meanwhile), over the
/// thread's own Redis connection ([`Store::own_thread`]; without it one
/// stream ran at 0.77 of HTTP, each run's answer read by another thread):
/// each thread lives until `exit` (after the agent's final drain).
/// Background tasks go to the app's runtime ([`crate::app::App::spawn`]).
pub async fn serve(
    app: AppState,
    mapping: Mapping,
    listener: TcpListener,
    stop: CancellationToken,
    exit: CancellationToken,
) {
    let (reporter, health) = tonic_health::server::health_reporter();
    let rls = RateLimitServiceServer::new(Rls { app: app.clone(), mapping });
    app.spawn({
        let app = app.clone();
        async move {
            loop {
                let ready = app.guard.refusal().is_none() && app.store.ping().await;
                let status = if ready {
                    tonic_health::ServingStatus::Serving
                } else {
                    tonic_health::ServingStatus::NotServing
                };
                reporter.set_service_status("", status).await;
                reporter.set_service_status(SERVICE_NAME, status).await;
                tokio::select! {
                    _ = app.cancel.cancelled() => return,
                    _ = tokio::time::sleep(HEALTH_EVERY) => {}
                }
            }
        }
    });
    // The connection bound, the preface (header) and idle timeouts are in
    // the accepted streams (`crate::grpc_conn`, TCP_NODELAY set there); the
    // streams per connection are advertised to the client (it queues
    // instead of being reset) and enforced by h2 itself (a stream beyond
    // them is refused), so no per-request semaphore is needed on top.
    let streams = app.settings.grpc_max_streams;
    let incoming = crate::grpc_conn::incoming(
        listener,
        app.settings.grpc_limits,
        app.listener_metrics("grpc"),
        app.settings.grpc_threads,
    );
    let mut stopped = Vec::new();
    for (i, incoming) in incoming.into_iter().enumerate() {
        let (health, rls, stop, exit) = (health.clone(), rls.clone(), stop.clone(), exit.clone());
        let app = app.clone();
        let (done, served) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::Builder::new().name(format!("agent-grpc-{i}")).spawn(move || {
            let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                Ok(rt) => rt,
                Err(e) => return tracing::error!(error = %e, "a gRPC thread could not start its runtime"),
            };
            rt.block_on(async move {
                // A connection of the thread's own (its reads on this
                // thread too), else the shared one.
                match Store::for_settings(&app.settings).await {
                    Ok(own) => own.own_thread(&app.store),
                    Err(e) => tracing::warn!(error = %e, "a gRPC thread uses the shared Redis connection"),
                }
                let served = tonic::transport::Server::builder()
                    .layer(tower::util::MapResponseLayer::new(
                        undecodable_is_invalid_argument::<tonic::body::Body>,
                    ))
                    .timeout(Duration::from_secs(10))
                    .max_concurrent_streams(streams)
                    .add_service(health)
                    .add_service(rls)
                    .serve_with_incoming_shutdown(incoming, stop.cancelled_owned())
                    .await;
                if let Err(e) = served {
                    tracing::error!(error = %e, "a gRPC server stopped");
                }
                let _ = done.send(());
                exit.cancelled().await;
            });
        });
        match thread {
            Ok(_) => stopped.push(served),
            Err(e) => tracing::error!(error = %e, "a gRPC thread could not start"),
        }
    }
    for s in stopped {
        let _ = s.await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
    use envoy_types::pb::google::protobuf::UInt64Value;

    fn mapping() -> Mapping {
        Mapping { resource_key: "resource".into(), key_entry: "user".into(), headers: false }
    }

    fn desc(entries: &[(&str, &str)], hits: Option<u64>) -> RateLimitDescriptor {
        RateLimitDescriptor {
            entries: entries
                .iter()
                .map(|(k, v)| Entry { key: k.to_string(), value: v.to_string() })
                .collect(),
            hits_addend: hits.map(|value| UInt64Value { value }),
            ..Default::default()
        }
    }

    fn req(domain: &str, hits: u32, d: Vec<RateLimitDescriptor>) -> RateLimitRequest {
        RateLimitRequest { domain: domain.into(), descriptors: d, hits_addend: hits }
    }

    #[test]
    fn the_priority_entry_gives_the_most_important_priority_and_rejects_others() {
        let m = mapping();
        let of = |ds: Vec<RateLimitDescriptor>| read(&req("atlas", 0, ds), &m);
        assert_eq!(of(vec![desc(&[("resource", "read")], None)]).unwrap().priority, DEFAULT_PRIORITY);
        let two = vec![
            desc(&[("resource", "read"), ("priority", "4")], None),
            desc(&[("priority", "1"), ("generic_key", "x")], None),
        ];
        let r = of(two).unwrap();
        assert_eq!((r.priority, r.wants.len(), r.of.clone()), (1, 1, vec![Some(0), None]));
        for bad in ["5", "-1", "high", ""] {
            let e = of(vec![desc(&[("resource", "read"), ("priority", bad)], None)]).unwrap_err();
            assert!(e.contains("priority must be 0 to 4"), "{bad:?}: {e}");
        }
        let twice = of(vec![desc(&[("resource", "read"), ("priority", "1"), ("priority", "2")], None)]);
        assert!(twice.unwrap_err().contains("given twice"));
    }

    #[test]
    fn a_shed_request_is_over_limit_on_every_descriptor_with_the_reason() {
        let r = read(
            &req("atlas", 0, vec![desc(&[("resource", "a")], None), desc(&[("x", "y")], None)]),
            &mapping(),
        )
        .unwrap();
        let a = shed(&r);
        assert_eq!(a.overall_code, Code::OverLimit as i32);
        assert!(a.statuses.iter().all(|s| s.code == Code::OverLimit as i32) && a.statuses.len() == 2);
        assert_eq!(
            (a.response_headers_to_add[0].key.as_str(), a.response_headers_to_add[0].value.as_str()),
            (REFUSED_HEADER, SHED_REASON)
        );
    }

    #[test]
    fn descriptors_map_to_one_decision() {
        let r = read(
            &req(
                "atlas",
                0,
                vec![
                    desc(&[("resource", "read"), ("user", "u1"), ("path", "/x")], None),
                    desc(&[("generic_key", "x")], None),
                    desc(&[("resource", "write"), ("user", "u1")], Some(3)),
                    desc(&[("resource", "read")], Some(2)),
                ],
            ),
            &mapping(),
        )
        .unwrap();
        assert_eq!(r.tenant, "atlas");
        // read: 1 (the request's 0 means 1) + 2; write: 3.
        assert_eq!(r.wants, vec![("read".to_string(), 3), ("write".to_string(), 3)]);
        assert_eq!(r.of, vec![Some(0), None, Some(1), Some(0)]);
        assert_eq!(r.key.as_deref(), Some("u1"));
        // The request's hits_addend is the default cost.
        let r = read(&req("atlas", 5, vec![desc(&[("resource", "read")], None)]), &mapping()).unwrap();
        assert_eq!(r.wants, vec![("read".to_string(), 5)]);
    }

    #[test]
    fn what_cannot_be_decided_is_refused_by_name() {
        let cases = [
            (req("bad domain", 0, vec![]), "domain"),
            (req("atlas", 0, vec![desc(&[("resource", "a b")], None)]), "descriptor 0"),
            (req("atlas", 0, vec![desc(&[("resource", "r")], Some(0))]), "hits_addend 0"),
            (
                req(
                    "atlas",
                    0,
                    vec![desc(&[("resource", "r"), ("user", "a")], None), desc(&[("user", "b")], None)],
                ),
                "one principal",
            ),
            (req("atlas", 0, vec![desc(&[("resource", "r"), ("user", "")], None)]), "visible ASCII"),
            (
                req("atlas", 0, vec![desc(&[("resource", "r"), ("resource", "s")], None)]),
                "\"resource\" is given twice",
            ),
            (
                req("atlas", 0, vec![desc(&[("resource", "r"), ("user", "a"), ("user", "a")], None)]),
                "\"user\" is given twice",
            ),
        ];
        for (r, want) in cases {
            let e = read(&r, &mapping()).unwrap_err();
            assert!(e.contains(want), "{e} should name {want}");
        }
        let mut neg = desc(&[("resource", "r")], None);
        neg.is_negative_hits = true;
        assert!(read(&req("atlas", 0, vec![neg]), &mapping()).unwrap_err().contains("negative"));
        let many: Vec<_> = (0..9).map(|i| desc(&[("resource", &format!("r{i}"))], None)).collect();
        assert!(read(&req("atlas", 0, many), &mapping()).unwrap_err().contains("distinct quotas"));
    }

    #[test]
    fn entries_the_agent_does_not_read_may_repeat() {
        let r = read(
            &req("atlas", 0, vec![desc(&[("path", "/a"), ("path", "/b"), ("resource", "r")], None)]),
            &mapping(),
        );
        assert_eq!(r.unwrap().wants, vec![("r".to_string(), 1)]);
    }

    #[test]
    fn a_cost_no_quota_admits_is_marked_for_a_refusal_not_an_error() {
        let big = request::MAX_COST as u64;
        let r = read(
            &req(
                "atlas",
                0,
                vec![desc(&[("generic_key", "x")], None), desc(&[("resource", "r")], Some(big + 1))],
            ),
            &mapping(),
        )
        .unwrap();
        assert_eq!(r.too_costly, Some(1));
        // Costs of one quota add up past the bound too.
        let r = read(
            &req(
                "atlas",
                0,
                vec![desc(&[("resource", "r")], Some(big)), desc(&[("resource", "r")], Some(1))],
            ),
            &mapping(),
        )
        .unwrap();
        assert_eq!(r.too_costly, Some(0));
        let r = read(&req("atlas", 0, vec![desc(&[("resource", "r")], Some(big))]), &mapping()).unwrap();
        assert_eq!(r.too_costly, None);
        let answer = refused(&r, 0, PolicyRefusal::CostAboveLimit);
        assert_eq!(answer.overall_code, Code::OverLimit as i32);
        assert_eq!(answer.response_headers_to_add[0].key, REFUSED_HEADER);
        assert_eq!(answer.response_headers_to_add[0].value, "cost_above_limit");
    }

    #[test]
    fn messages_repeat_at_most_echo_max_bytes_of_a_value() {
        assert_eq!(echo("read"), "\"read\"");
        let long = "é".repeat(200); // 400 bytes, 2 per character
        let e = echo(&long);
        assert!(e.len() < ECHO_MAX + 30 && e.ends_with("... (400 bytes)"), "{e}");
        let err = read(&req(&"x".repeat(1 << 20), 0, vec![]), &mapping()).unwrap_err();
        assert!(err.len() < 300, "{} bytes", err.len());
        assert_eq!(bounded("y".repeat(5000)).len(), MESSAGE_MAX);
    }

    #[test]
    fn only_an_undecodable_request_s_internal_becomes_invalid_argument() {
        let resp = |status: &str, msg: &str| {
            axum::http::Response::builder()
                .header("grpc-status", status)
                .header("grpc-message", msg)
                .body(())
                .unwrap()
        };
        let status = |r: axum::http::Response<()>| r.headers()["grpc-status"].to_str().unwrap().to_string();
        let bad = "failed to decode Protobuf message: RateLimitRequest.domain: invalid string value";
        assert_eq!(status(undecodable_is_invalid_argument(resp("13", bad))), "3");
        assert_eq!(status(undecodable_is_invalid_argument(resp("13", &bad.replace(' ', "%20")))), "3");
        assert_eq!(status(undecodable_is_invalid_argument(resp("13", "something else"))), "13");
        assert_eq!(status(undecodable_is_invalid_argument(resp("14", bad))), "14");
    }

    #[test]
    fn a_window_of_one_unit_is_that_unit_and_any_other_is_named_exactly() {
        let p = |window_secs| PolicyInfo {
            limit: 100,
            window_secs,
            fail_mode: quota_shared::wire::FailMode::Bounded,
            fallback_allowance: 0,
            version: 1,
            per_key: None,
            enforce: true,
            on_stale: Default::default(),
            held: [0; 5],
        };
        for (w, unit) in [(1, Unit::Second), (60, Unit::Minute), (3600, Unit::Hour), (86_400, Unit::Day)] {
            let l = current_limit("a", "r", p(w));
            assert_eq!((l.unit, l.requests_per_unit, l.name.as_str()), (unit as i32, 100, "a/r"));
        }
        let l = current_limit("a", "r", p(10));
        assert_eq!((l.unit, l.name.as_str()), (Unit::Unknown as i32, "a/r: 100 per 10s"));
    }
}
