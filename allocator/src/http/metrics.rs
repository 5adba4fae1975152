//! Request metrics: a count and a latency histogram per route and status,
//! and the API listener's connection counts. The families of the rest of
//! the allocator are described by the crate's root, which builds the one
//! registry.

use axum::extract::{MatchedPath, Request, State};
use axum::middleware::Next;
use axum::response::Response;
use quota_shared::listen::ListenerMetrics;
use quota_shared::prom::Registry;
use std::sync::Arc;
use std::time::Instant;

/// Declares the request and listener families in `r`.
pub fn describe(r: &Registry) {
    r.describe("allocator_http_requests_total", "counter", "HTTP requests by route and status");
    r.describe("allocator_http_request_seconds", "histogram", "HTTP request latency by route");
    ListenerMetrics::describe(r, LISTENER_OPEN, LISTENER_CLOSED, &["http"]);
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

/// Middleware recording every request in the registry it is given.
pub async fn track(State(metrics): State<Arc<Registry>>, req: Request, next: Next) -> Response {
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| "unmatched".to_string());
    let started = Instant::now();
    let resp = next.run(req).await;
    let status = resp.status().as_u16().to_string();
    metrics.inc("allocator_http_requests_total", &[("route", &route), ("status", &status)]);
    metrics.observe("allocator_http_request_seconds", &[("route", &route)], started.elapsed().as_secs_f64());
    resp
}
