//! `/healthz` (shallow), `/readyz` (Redis reachable), `/metrics`
//! (Prometheus text), `/openapi.json` (this API's OpenAPI document) and
//! `/v1/status` (per quota: lease tokens left, their
//! remaining life, demand, mode, allocator reachability, epoch).

use crate::app::{AllocatorClock, AppState};
use crate::client::AllocatorClient;
use crate::guard::Guard;
use crate::identity::Identity;
use crate::keys::Keys;
use crate::quotas::{Quotas, Unknown};
use crate::store::Store;
use axum::extract::{FromRef, State};
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::{Json, Router};
use quota_shared::openapi::IdentifierPatterns;
use quota_shared::prom::Registry;
use serde_json::json;
use std::sync::Arc;

/// What `/readyz` reads: the eviction-policy verdict and the store.
#[derive(Clone)]
pub struct Readiness {
    pub guard: Arc<Guard>,
    pub store: Store,
}

impl FromRef<AppState> for Readiness {
    fn from_ref(app: &AppState) -> Self {
        Readiness { guard: app.guard.clone(), store: app.store.clone() }
    }
}

/// What `/v1/status` and `/metrics` read: who the agent is, its quotas,
/// the allocator's and the store's state, and the region's dead letters.
#[derive(Clone)]
pub struct StatusView {
    pub region: String,
    pub agent: String,
    pub keys: Keys,
    pub store: Store,
    pub alloc: Arc<AllocatorClient>,
    pub alloc_clock: Arc<AllocatorClock>,
    pub quotas: Arc<Quotas>,
    pub unknown: Arc<Unknown>,
    pub ident: Arc<Identity>,
    pub metrics: Arc<Registry>,
    pub shed: Arc<crate::shed::Shedder>,
    /// `--max-policy-age-secs` (`None`: never stale).
    pub max_policy_age: Option<std::time::Duration>,
    /// Concurrency quotas and their permits.
    pub permits: Arc<crate::permits::Permits>,
}

impl FromRef<AppState> for StatusView {
    fn from_ref(app: &AppState) -> Self {
        StatusView {
            region: app.settings.region.clone(),
            agent: app.settings.agent.clone(),
            keys: app.keys.clone(),
            store: app.store.clone(),
            alloc: app.alloc.clone(),
            alloc_clock: app.alloc_clock.clone(),
            quotas: app.quotas.clone(),
            unknown: app.unknown.clone(),
            ident: app.ident.clone(),
            metrics: app.metrics.clone(),
            shed: app.decider.shed.clone(),
            max_policy_age: app.settings.max_policy_age,
            permits: app.permits.clone(),
        }
    }
}

impl StatusView {
    /// The region's dead letters: their count and the newest `n`.
    async fn dead_letters(
        &self,
        n: isize,
    ) -> Result<(i64, Vec<serde_json::Value>), crate::store::StoreError> {
        crate::outbox::dead_letters(&self.store, &self.keys, &self.region, n).await
    }
}

/// Routes of this module.
pub fn router() -> Router<AppState> {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/v1/status", get(status))
        .route("/openapi.json", get(openapi_json))
}

/// The agent's API description, generated from the handlers' annotations.
#[derive(utoipa::OpenApi)]
#[openapi(
    info(
        title = "quota regional agent",
        description = "Admission decisions from leases spent in the region's Redis (DESIGN §5)."
    ),
    paths(
        crate::acquire::acquire,
        crate::permit_routes::release,
        crate::permit_routes::renew,
        status,
        healthz,
        readyz,
        metrics,
        openapi_json
    ),
    modifiers(&IdentifierPatterns)
)]
pub struct ApiDoc;

/// `GET /openapi.json`: this document.
#[utoipa::path(
    get,
    path = "/openapi.json",
    responses((status = 200, description = "The agent's OpenAPI 3 document", content_type = "application/json")),
    tag = "agent"
)]
pub(crate) async fn openapi_json() -> Json<utoipa::openapi::OpenApi> {
    Json(<ApiDoc as utoipa::OpenApi>::openapi())
}

/// `GET /healthz`: shallow liveness.
#[utoipa::path(get, path = "/healthz", responses((status = 200, description = "The process serves")), tag = "agent")]
pub(crate) async fn healthz() -> Json<serde_json::Value> {
    Json(json!({"status": "ok"}))
}

/// Declares the agent's metric families.
pub fn describe(m: &Registry) {
    m.describe(
        "agent_acquire_total",
        "counter",
        "Acquire answers by outcome (lease, fallback, or the error code)",
    );
    m.describe(
        "agent_acquire_seconds",
        "histogram",
        "Acquire latency inside the agent (body read to response built)",
    );
    m.describe(
        "agent_acquire_store_seconds",
        "histogram",
        "Time an acquire waits on the spend script within the handler: queued behind the quota's runs in flight, then its own run's Redis round trip (the rest of agent_acquire_seconds is the agent's own work)",
    );
    m.describe(
        "agent_spend_runs_total",
        "counter",
        "Runs of the spend script; agent_acquire_total over this is the mean number of decisions per run",
    );
    m.describe("agent_lease_tokens", "gauge", "Tokens left in the region's spendable leases, per quota");
    m.describe("agent_allocator_reachable", "gauge", "1 while the allocator answers");
    m.describe("agent_fallback_admits_total", "counter", "Admits from the fallback allowance");
    m.describe(
        "agent_shadow_refusals_total",
        "counter",
        "Requests a shadow-mode policy (enforce: false) would have refused and admitted, by the limit that would have refused (per_key or quota)",
    );
    m.describe(
        "agent_negative_cache_refusals_total",
        "counter",
        "Refusals answered from this replica's memory without a spend script run (the pool held spent, or the key's bucket held short), by limit (quota or per_key)",
    );
    m.describe(
        "agent_shadow_uncounted_total",
        "counter",
        "Shadow refusals whose count could not be written to Redis (missing from the window's report)",
    );
    m.describe("agent_renewals_total", "counter", "Grant requests by result");
    m.describe("agent_outbox_depth", "gauge", "Outbox entries waiting for the allocator");
    m.describe("agent_quotas", "gauge", "Quotas this agent holds (idle ones leave after 5 minutes)");
    m.describe(
        "agent_unknown_quota_names",
        "gauge",
        "Quota names in the negative cache (the allocator answered 404; kept 5 s, at most 4096)",
    );
    m.describe(
        "agent_redis_rollbacks_total",
        "counter",
        "Quota states found rolled back (Redis restarted, restored from a snapshot, failed over or evicted) and stranded",
    );
    m.describe("agent_outbox_sent_total", "counter", "Outbox entries the allocator accepted");
    m.describe(
        "agent_outbox_dead_letters_total",
        "counter",
        "Outbox entries (or report items) the allocator refused for a reason that can never change, moved to the region's dead letters",
    );
    m.describe(
        "agent_outbox_dead_letters",
        "gauge",
        "Entries in the region's dead-letter list (at most 1000 kept)",
    );
    m.describe("agent_epoch", "gauge", "The agent's current epoch");
    m.describe(
        "agent_decisions_in_flight",
        "gauge",
        "Decisions (HTTP acquire and RLS) in flight in this agent, the count --shed-in-flight compares against",
    );
    m.counter_from_zero(
        "agent_shed_total",
        "Requests answered 503 shed (RLS: OVER_LIMIT with x-quota-refused: shed) because this agent was overloaded, by priority (2 to 4; 0 and 1 are never shed); nothing was charged",
        "priority",
        &["2", "3", "4"],
    );
    m.counter_from_zero(
        "agent_reserve_refusals_total",
        "Requests answered 429 quota_exhausted with limit reserve (what was left of the window is kept for more important priorities), by priority",
        "priority",
        &["1", "2", "3", "4"],
    );
}

/// `GET /readyz`: Redis answers and runs with `maxmemory-policy noeviction`.
#[utoipa::path(
    get,
    path = "/readyz",
    responses(
        (status = 200, description = "Redis answers and its maxmemory-policy is noeviction"),
        (status = 503, description = "store_unavailable: Redis does not answer, or its eviction policy is not noeviction (the message names it) or not read yet", body = quota_shared::wire::ErrorBody),
    ),
    tag = "agent"
)]
pub(crate) async fn readyz(State(app): State<Readiness>) -> impl IntoResponse {
    if let Some(reason) = app.guard.refusal() {
        (StatusCode::SERVICE_UNAVAILABLE, Json(json!({"error": "store_unavailable", "message": reason})))
    } else if app.store.ping().await {
        (StatusCode::OK, Json(json!({"status": "ready"})))
    } else {
        let why = app.store.last_error().unwrap_or_else(|| "no answer".into());
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"error": "store_unavailable", "message": format!("Redis does not answer: {why}")})),
        )
    }
}

/// `GET /metrics`: Prometheus text.
#[utoipa::path(
    get,
    path = "/metrics",
    responses((status = 200, description = "Prometheus text format", content_type = "text/plain")),
    tag = "agent"
)]
pub(crate) async fn metrics(State(app): State<StatusView>) -> impl IntoResponse {
    let reachable = app.alloc.breaker.reachable();
    app.metrics.set("agent_allocator_reachable", &[], if reachable { 1.0 } else { 0.0 });
    app.metrics.set("agent_quotas", &[], app.quotas.len() as f64);
    app.metrics.set("agent_decisions_in_flight", &[], app.shed.in_flight() as f64);
    app.metrics.set("agent_unknown_quota_names", &[], app.unknown.len() as f64);
    if let Ok((n, _)) = app.dead_letters(0).await {
        app.metrics.set("agent_outbox_dead_letters", &[], n as f64);
    }
    let who = crate::gauges::Identity { region: &app.region, agent: &app.agent };
    let offset = app.alloc_clock.offset();
    let ages = crate::gauges::Ages { max: app.max_policy_age, now_ms: crate::stale::now_ms() };
    crate::gauges::refresh(&app.metrics, who, &app.quotas, reachable, offset, ages);
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], app.metrics.render())
}

/// `GET /v1/status`: per quota lease tokens, expiry, demand, mode, reachability and epoch.
#[utoipa::path(
    get,
    path = "/v1/status",
    responses((status = 200, description = "{region, agent, epoch, allocator_reachable, allocator_error (why the allocator counts as unreachable, e.g. a TLS failure; null while it answers), redis_error (why the region's Redis cannot be used: refused, timed out, TLS handshake failed; null while it answers), dead_letters (entries in the region's dead-letter list; null when Redis cannot be read), recent_dead_letters (the newest 10: tenant, resource, agent, entry, status, error, message, at), shed (shedding by priority: in_flight, in_flight_line, store_latency_ms (the fresh average; null when none, or while --shed-store-latency-ms is off), store_latency_line_ms, load, shedding: the priorities shed at that load), max_policy_age_secs (null: policies never go stale), quotas: [{tenant, resource, lease_tokens, expires_in_ms, demand_per_sec, mode, policy {.., on_stale}, policy_age_secs (since a grant answer last confirmed the policy; null when never), policy_stale (older than the maximum age while the allocator is unreachable), ...}], permits: the concurrency quotas this agent knows (at most 100): [{tenant, resource, max_in_flight, permit_ttl_secs, policy_version, live (permits handed out in the region), cap (what the region's lease holds), lease_in_ms, blocked_in_ms (hand-outs stopped after a lost state; 0 when not), lost (the region's permit state is missing)}]}")),
    tag = "agent"
)]
pub(crate) async fn status(State(app): State<StatusView>) -> impl IntoResponse {
    let reachable = app.alloc.breaker.reachable();
    let now_ms = crate::stale::now_ms();
    let quotas: Vec<_> = app
        .quotas
        .all()
        .iter()
        .map(|q| {
            let v = *q.view.lock().unwrap();
            let p = q.policy();
            let age = v.at.map(|t| t.elapsed().as_millis() as i64).unwrap_or(0);
            let mode = crate::gauges::mode(reachable, p, &v);
            json!({
                "tenant": q.tenant,
                "resource": q.resource,
                "lease_tokens": v.available,
                "expires_in_ms": if v.life_ms >= 0 { (v.life_ms - age).max(0) } else { 0 },
                "pending_next_window": v.pending,
                "demand_per_sec": q.demand.lock().unwrap().rate,
                "mode": mode,
                "allocator_reachable": reachable,
                "epoch": app.ident.epoch(),
                "policy": p.map(|p| json!({
                    "limit": p.limit, "window_secs": p.window_secs, "fail_mode": p.fail_mode,
                    "fallback_allowance": p.fallback_allowance, "version": p.version,
                    "on_stale": p.on_stale,
                })),
                "policy_age_secs": q.confirmed.age_ms(now_ms).map(|ms| ms / 1000),
                "policy_stale": q.confirmed.stale(now_ms, app.max_policy_age, reachable),
            })
        })
        .collect();
    let (dead, recent) = match app.dead_letters(10).await {
        Ok((n, recent)) => {
            app.metrics.set("agent_outbox_dead_letters", &[], n as f64);
            (Some(n), recent)
        }
        Err(_) => (None, Vec::new()),
    };
    Json(json!({
        "region": app.region,
        "dead_letters": dead,
        "recent_dead_letters": recent,
        "agent": app.agent,
        "epoch": app.ident.epoch(),
        "allocator_reachable": reachable,
        "allocator_error": app.alloc.last_error(),
        "redis_error": app.store.last_error(),
        "shed": app.shed.status(),
        "max_policy_age_secs": app.max_policy_age.map(|d| d.as_secs()),
        "quotas": quotas,
        "permits": app.permits.status(crate::permits::STATUS_MAX).await,
    }))
}
