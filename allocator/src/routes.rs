//! The route table: which path goes to which handler, in which route class,
//! and the layers every request passes through. It stands above the
//! handlers and the HTTP plumbing (`http`) and is the one place that names
//! them all together.
//!
//! Route classes (DESIGN §5 Security): agent routes take the agent token;
//! policy reads and writes, operator reads (windows, permits, ledger,
//! leases, explain) and the `/ui` dashboard take the admin token, presented only in
//! the `Authorization` header (a token in a query string would end up in
//! access logs and browser history), and are open only when no admin token
//! is configured, which `serve` allows on loopback only; `/healthz`,
//! `/readyz`, `/metrics` and `/openapi.json` are public.

use crate::error::Error;
use crate::http::{auth, metrics, trace};
use crate::state::AppState;
use crate::{
    agents, explain, fleet, grants, health, leases, ledger, openapi, permits, policies, reports, rollout, ui,
    windows,
};
use axum::extract::{DefaultBodyLimit, Request};
use axum::middleware::from_fn_with_state;
use axum::routing::{get, post, put};
use axum::Router;
use std::time::Duration;
use tower_http::timeout::TimeoutLayer;

/// Largest request body accepted (DESIGN §5: 413 beyond it).
pub const MAX_BODY_BYTES: usize = 64 * 1024;

/// Longest a request may take before it is answered 408; well above the
/// statement timeout so the database answers first.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// The allocator's whole router.
pub fn router(state: AppState) -> Router {
    let agent_routes = Router::new()
        .route("/v1/agents/register", post(agents::register))
        .route("/v1/agents/{region}/{agent}/status", put(fleet::put_status))
        .route("/v1/grants", post(grants::grant))
        .route("/v1/leases/{lease_id}/release", post(leases::release))
        .route("/v1/leases/release", post(leases::release_batch))
        .route("/v1/reports", post(reports::report))
        .route("/v1/permits/lease", post(permits::lease))
        .route_layer(from_fn_with_state(state.auth.clone(), auth::require_agent));
    let admin_routes = Router::new()
        .route("/v1/policies/{tenant}/{resource}", put(policies::put_policy).get(policies::get_policy))
        .route("/v1/policies/{tenant}/{resource}/versions", get(policies::list_versions))
        .route("/v1/policies/{tenant}/{resource}/rollout/promote", post(rollout::promote))
        .route("/v1/policies/{tenant}/{resource}/rollout/halt", post(rollout::halt))
        .route("/v1/leases/{lease_id}", get(leases::get_lease))
        .route("/v1/windows/{tenant}/{resource}", get(windows::list))
        .route("/v1/permits/{tenant}/{resource}", get(permits::view))
        .route("/v1/ledger", get(ledger::list))
        .route("/v1/explain/{tenant}/{resource}", get(explain::explain))
        .route("/ui", get(ui::index))
        .route("/ui/quotas/{tenant}/{resource}", get(ui::quota))
        .route("/ui/regions", get(ui::fleet::regions))
        .route_layer(from_fn_with_state(state.auth.clone(), auth::require_admin));
    let public_routes = Router::new()
        .route("/healthz", get(health::healthz))
        .route("/readyz", get(health::readyz))
        .route("/metrics", get(health::metrics))
        .route("/openapi.json", get(openapi::openapi_json));
    Router::new()
        .merge(agent_routes)
        .merge(admin_routes)
        .merge(public_routes)
        .fallback(|req: Request| async move { Error::NoRoute(req.uri().path().to_string()) })
        .layer(from_fn_with_state(state.metrics.clone(), metrics::track))
        .layer(trace::layer())
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(TimeoutLayer::with_status_code(axum::http::StatusCode::REQUEST_TIMEOUT, REQUEST_TIMEOUT))
        .with_state(state)
}
