//! Liveness (`/healthz`, shallow), readiness (`/readyz`, the database answers)
//! and `/metrics` (Prometheus text).

use crate::{AppState, Result};
use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::{Json, Router};
use serde_json::{json, Value};

/// Routes of this module.
pub fn router() -> Router<AppState> {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
}

async fn healthz() -> Json<Value> {
    Json(json!({"status": "ok"}))
}

async fn readyz(State(state): State<AppState>) -> Result<Json<Value>> {
    sqlx::query(include_str!("sql/ping.sql")).execute(&state.db).await?;
    Ok(Json(json!({"status": "ready", "database": "ok"})))
}

async fn metrics(State(state): State<AppState>) -> impl IntoResponse {
    let pool = &state.db;
    state.metrics.set("allocator_db_connections", &[("state", "idle")], pool.num_idle() as f64);
    state.metrics.set("allocator_db_connections", &[("state", "open")], pool.size() as f64);
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], state.metrics.render())
}
