//! Request metrics: a count and a latency histogram per route and status.

use crate::AppState;
use axum::extract::{MatchedPath, Request, State};
use axum::middleware::Next;
use axum::response::Response;
use quota_shared::listen::ListenerMetrics;
use quota_shared::prom::Registry;
use std::sync::Arc;
use std::time::Instant;

/// A registry with the allocator's families described.
pub fn registry() -> Registry {
    let r = Registry::default();
    r.describe("allocator_http_requests_total", "counter", "HTTP requests by route and status");
    r.describe("allocator_http_request_seconds", "histogram", "HTTP request latency by route");
    r.describe("allocator_grants_total", "counter", "Grant requests by outcome");
    r.describe("allocator_granted_tokens_total", "counter", "Tokens put into leases");
    r.describe("allocator_released_tokens_total", "counter", "Unspent tokens returned to open pools");
    r.describe(
        "allocator_grant_seconds",
        "histogram",
        "Grant handling latency, including retries of a raced key",
    );
    r.describe("allocator_db_connections", "gauge", "PostgreSQL pool connections by state (open, idle)");
    crate::window_metrics::describe(&r);
    ListenerMetrics::describe(&r, LISTENER_OPEN, LISTENER_CLOSED, &["http"]);
    r
}

/// Gauge of open connections on the API listener.
pub const LISTENER_OPEN: &str = "allocator_listener_connections";
/// Counter of connections the listener refused or closed, by reason.
pub const LISTENER_CLOSED: &str = "allocator_listener_closed_total";

/// Where the API listener (plain or TLS) counts its connections.
pub fn listener(registry: &Arc<Registry>) -> ListenerMetrics {
    ListenerMetrics {
        registry: registry.clone(),
        open: LISTENER_OPEN,
        closed: LISTENER_CLOSED,
        listener: "http",
    }
}

/// Middleware recording every request.
pub async fn track(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| "unmatched".to_string());
    let started = Instant::now();
    let resp = next.run(req).await;
    let status = resp.status().as_u16().to_string();
    state.metrics.inc("allocator_http_requests_total", &[("route", &route), ("status", &status)]);
    state.metrics.observe(
        "allocator_http_request_seconds",
        &[("route", &route)],
        started.elapsed().as_secs_f64(),
    );
    resp
}
