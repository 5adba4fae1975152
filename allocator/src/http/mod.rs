//! The HTTP surface: one router per resource module, merged here, with the
//! body limit, auth per route class, request metrics and request spans.
//!
//! Route classes (DESIGN §5 Security): agent routes take the agent token;
//! policy reads and writes, operator reads (windows, ledger, leases,
//! explain) and the `/ui` dashboard take the admin token, presented only in
//! the `Authorization` header (a token in a query string would end up in
//! access logs and browser history), and are open only when no admin token
//! is configured, which `serve` allows on loopback only; `/healthz`,
//! `/readyz`, `/metrics` and `/openapi.json` are public.

pub mod agent_tokens;
pub mod auth;
pub mod extract;
pub mod metrics;
pub mod secret;
pub mod trace;

use crate::{
    agents, explain, fleet, grants, health, leases, ledger, openapi, policies, reports, ui, windows,
    AppState, Error,
};
use axum::extract::{DefaultBodyLimit, Request};
use axum::middleware::from_fn_with_state;
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
        .merge(agents::router())
        .merge(fleet::router())
        .merge(grants::router())
        .merge(leases::agent_router())
        .merge(reports::router())
        .route_layer(from_fn_with_state(state.clone(), auth::require_agent));
    let admin_routes = Router::new()
        .merge(policies::router())
        .merge(leases::admin_router())
        .merge(windows::router())
        .merge(ledger::router())
        .merge(explain::router())
        .merge(ui::router())
        .route_layer(from_fn_with_state(state.clone(), auth::require_admin));
    Router::new()
        .merge(agent_routes)
        .merge(admin_routes)
        .merge(health::router())
        .merge(openapi::router())
        .fallback(|req: Request| async move { Error::NoRoute(req.uri().path().to_string()) })
        .layer(from_fn_with_state(state.clone(), metrics::track))
        .layer(trace::layer())
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(TimeoutLayer::with_status_code(axum::http::StatusCode::REQUEST_TIMEOUT, REQUEST_TIMEOUT))
        .with_state(state)
}
