//! The permit routes of concurrency quotas (`POST
//! /v1/permits/{permit_id}/release` and `/renew`) and the decision of an
//! acquire on one; the permits themselves are `crate::permits`'s.

use crate::app::AppState;
use crate::error::{Error, ErrorAnswer, Result};
use crate::permits::lease::Taken;
use crate::request::{check_key, Acquire};
use crate::scripts::PermitReturn;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use serde::{Deserialize, Serialize};

/// Routes of this module.
pub fn router() -> Router<AppState> {
    Router::new()
        .route("/v1/permits/{permit_id}/release", post(release))
        .route("/v1/permits/{permit_id}/renew", post(renew))
}

/// `release` and `renew` body (optional): the holder a permit must have
/// been handed out to.
#[derive(Debug, Default, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PermitCall {
    /// The acquire's `key`: when both the acquire and this call name one
    /// and they differ, nothing changes (`409 not_holder`).
    #[serde(default)]
    pub key: Option<String>,
}

/// `200` of `release`.
#[derive(Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Released {
    pub permit_id: String,
    /// `false`: the permit was not live (released before, expired, or
    /// never handed out); nothing changed.
    pub released: bool,
}

/// `200` of `renew`.
#[derive(Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Renewed {
    pub permit_id: String,
    /// The permit's life from now: the policy's `permit_ttl_secs`, or less
    /// when this region cannot renew its lease at the allocator (a permit
    /// never outlives the region's lease).
    pub expires_in_ms: i64,
}

fn holder(body: std::result::Result<Bytes, BytesRejection>) -> Result<String> {
    let bytes = body?;
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(String::new());
    }
    let call: PermitCall = serde_json::from_slice(&bytes).map_err(|e| match e.classify() {
        serde_json::error::Category::Data => Error::invalid("body", e.to_string()),
        _ => Error::MalformedJson(e.to_string()),
    })?;
    match call.key {
        None => Ok(String::new()),
        Some(k) => check_key(&k).map(|()| k),
    }
}

/// `POST /v1/permits/{permit_id}/release`: gives a permit back.
#[utoipa::path(
    post,
    path = "/v1/permits/{permit_id}/release",
    params(("permit_id" = String, Path, description = "As the acquire answered it")),
    request_body(content = Option<PermitCall>, description = "Optional: the holder's key"),
    responses(
        (status = 200, description = "Released, or not live any more (`released: false`): idempotent", body = Released),
        (status = 400, description = "malformed_json", body = ErrorAnswer),
        (status = 413, description = "payload_too_large: the body is over 64 KiB", body = ErrorAnswer),
        (status = 409, description = "not_holder: handed out to another key; nothing changed", body = ErrorAnswer),
        (status = 422, description = "invalid_field: not a permit id, or a bad key", body = ErrorAnswer),
        (status = 503, description = "store_unavailable", body = ErrorAnswer),
    ),
    tag = "agent"
)]
pub(crate) async fn release(
    State(app): State<AppState>,
    Path(permit_id): Path<String>,
    body: std::result::Result<Bytes, BytesRejection>,
) -> Response {
    respond(
        async {
            let key = holder(body)?;
            match app.permits.give_back(&permit_id, &key, false).await? {
                PermitReturn::NotHolder => Err(Error::NotHolder(permit_id.clone())),
                r => Ok(Released { permit_id: permit_id.clone(), released: r == PermitReturn::Released }),
            }
        }
        .await,
    )
}

/// The one mapping of a permit route's result to its answer.
fn respond<T: Serialize>(r: Result<T>) -> Response {
    match r {
        Ok(b) => Json(b).into_response(),
        Err(e) => e.into_response(),
    }
}

/// `POST /v1/permits/{permit_id}/renew`: extends a permit (a heartbeat of
/// a long job).
#[utoipa::path(
    post,
    path = "/v1/permits/{permit_id}/renew",
    params(("permit_id" = String, Path, description = "As the acquire answered it")),
    request_body(content = Option<PermitCall>, description = "Optional: the holder's key"),
    responses(
        (status = 200, description = "Renewed", body = Renewed),
        (status = 400, description = "malformed_json", body = ErrorAnswer),
        (status = 413, description = "payload_too_large: the body is over 64 KiB", body = ErrorAnswer),
        (status = 404, description = "permit_not_found: released or expired (the job no longer holds a permit)", body = ErrorAnswer),
        (status = 409, description = "not_holder: handed out to another key; nothing changed", body = ErrorAnswer),
        (status = 422, description = "invalid_field: not a permit id, or a bad key", body = ErrorAnswer),
        (status = 503, description = "store_unavailable", body = ErrorAnswer),
    ),
    tag = "agent"
)]
pub(crate) async fn renew(
    State(app): State<AppState>,
    Path(permit_id): Path<String>,
    body: std::result::Result<Bytes, BytesRejection>,
) -> Response {
    respond(
        async {
            let key = holder(body)?;
            match app.permits.give_back(&permit_id, &key, true).await? {
                PermitReturn::Renewed { expires_in_ms } => {
                    Ok(Renewed { permit_id: permit_id.clone(), expires_in_ms })
                }
                PermitReturn::NotHolder => Err(Error::NotHolder(permit_id.clone())),
                _ => Err(Error::PermitNotFound(permit_id.clone())),
            }
        }
        .await,
    )
}

/// The decision of an acquire of one concurrency quota: a permit, or why
/// not (the acquire route answers it, see `crate::acquire`).
pub(crate) async fn decide(app: &AppState, req: &Acquire) -> Result<Taken> {
    let w = &req.wants[0];
    if w.cost != 1 {
        return Err(Error::PolicyRefuses {
            field: "cost".into(),
            reason: crate::error::PolicyRefusal::ConcurrencyQuota,
            message: format!(
                "{}/{} is a concurrency quota: an acquire takes one permit (cost 1), got {}",
                req.tenant, w.resource, w.cost
            ),
        });
    }
    let _in_flight = app.decider.shed.enter(req.priority).map_err(|s| {
        app.metrics.inc("agent_shed_total", &[("priority", crate::shed::label(s.priority))]);
        Error::Shed { priority: s.priority }
    })?;
    app.guard.admit()?;
    let q = app.permits.get(&req.tenant, &w.resource).ok_or(Error::TooManyQuotas)?;
    app.permits.take(&q, req.key.as_deref().unwrap_or(""), req.request_id.as_deref()).await
}
