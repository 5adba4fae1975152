//! Liveness (`/healthz`, shallow), readiness (`/readyz`, the database answers)
//! and `/metrics` (Prometheus text).

use crate::error::Result;
use crate::state::AppState;
use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use axum::Json;
use serde_json::{json, Value};

/// `GET /healthz`: shallow liveness.
#[utoipa::path(get, path = "/healthz", responses((status = 200, description = "The process serves")), tag = "health")]
pub(crate) async fn healthz() -> Json<Value> {
    Json(json!({"status": "ok"}))
}

/// `GET /readyz`: the database answers.
#[utoipa::path(
    get,
    path = "/readyz",
    responses(
        (status = 200, description = "The database answers"),
        (status = 503, description = "Database unavailable", body = quota_shared::wire::ErrorBody),
    ),
    tag = "health"
)]
pub(crate) async fn readyz(State(state): State<AppState>) -> Result<Json<Value>> {
    sqlx::query_file!("src/sql/ping.sql").fetch_one(&state.db).await?;
    Ok(Json(json!({"status": "ready", "database": "ok"})))
}

/// `GET /metrics`: Prometheus text.
#[utoipa::path(
    get,
    path = "/metrics",
    responses((status = 200, description = "Prometheus text format", content_type = "text/plain")),
    tag = "health"
)]
pub(crate) async fn metrics(State(state): State<AppState>) -> impl IntoResponse {
    let pool = &state.db;
    state.metrics.set("allocator_db_connections", &[("state", "idle")], pool.num_idle() as f64);
    state.metrics.set("allocator_db_connections", &[("state", "open")], pool.size() as f64);
    if let Err(e) = crate::window_metrics::refresh(&state).await {
        // The families keep their last values; the scrape still answers.
        tracing::warn!(error = %e, "per-window metrics not refreshed");
    }
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], state.metrics.render())
}
