//! `POST /v1/reports`: what a region admitted, from leases (`consumed`) and
//! from its fallback allowance (`fallback_admitted`), per quota and window.
//! Applied exactly once per `report_id` (I7); epoch-fenced (I4).

use crate::agents;
use crate::http::auth::AgentScope;
use crate::http::extract::{check_count, check_id, ApiJson};
use crate::ledger::{self, Kind, NewEvent};
use crate::policies;
use crate::{AppState, Error, Result};
use axum::extract::State;
use axum::routing::post;
use axum::{Json, Router};
use chrono::{DateTime, Utc};
use quota_shared::wire::{ErrorBody, ReportRequest, ReportResponse};
use sqlx::PgConnection;

/// Most items one report may carry.
pub const MAX_ITEMS: usize = 500;

/// Longest `report_id` accepted.
pub const MAX_REPORT_ID_LEN: usize = 128;

/// Routes of this module.
pub fn router() -> Router<AppState> {
    Router::new().route("/v1/reports", post(report))
}

fn validate(req: &ReportRequest) -> Result<()> {
    check_id("region", &req.region)?;
    check_id("agent", &req.agent)?;
    check_count("epoch", req.epoch, 1)?;
    if req.report_id.is_empty()
        || req.report_id.len() > MAX_REPORT_ID_LEN
        || req.report_id.chars().any(|c| c.is_control())
    {
        return Err(Error::invalid(
            "report_id",
            format!("must be 1 to {MAX_REPORT_ID_LEN} printable characters"),
        ));
    }
    if req.items.len() > MAX_ITEMS {
        return Err(Error::invalid(
            "items",
            format!("at most {MAX_ITEMS} items per report, got {}", req.items.len()),
        ));
    }
    for (i, item) in req.items.iter().enumerate() {
        check_id(&format!("items[{i}].tenant"), &item.tenant)?;
        check_id(&format!("items[{i}].resource"), &item.resource)?;
        check_count(&format!("items[{i}].consumed"), item.consumed, 0)?;
        check_count(&format!("items[{i}].fallback_admitted"), item.fallback_admitted, 0)?;
        if item.window_start.timestamp_subsec_nanos() != 0 {
            return Err(Error::invalid(format!("items[{i}].window_start"), "must be a whole second"));
        }
    }
    Ok(())
}

/// `POST /v1/reports`: consumption and fallback admits, exactly once (I7).
#[utoipa::path(
    post,
    path = "/v1/reports",
    request_body = ReportRequest,
    responses(
        (status = 200, description = "Items applied (the first count on a replay)", body = ReportResponse),
        (status = 401, description = "Missing or wrong agent token", body = ErrorBody),
        (status = 403, description = "wrong_region: the credential acts only for another region", body = ErrorBody),
        (status = 404, description = "Unknown quota or agent", body = ErrorBody),
        (status = 409, description = "stale_epoch or idempotency_mismatch", body = ErrorBody),
        (status = 422, description = "Invalid value; the message names the field", body = ErrorBody),
    ),
    security(("agent_token" = [])),
    tag = "agents"
)]
pub(crate) async fn report(
    State(state): State<AppState>,
    scope: AgentScope,
    ApiJson(req): ApiJson<ReportRequest>,
) -> Result<Json<ReportResponse>> {
    validate(&req)?;
    let now = state.clock.now_utc();
    let outcome = match scope.check(&req.region) {
        Ok(()) => apply(&state, &req, now).await,
        Err(e) => Err(e),
    };
    match outcome {
        Ok(accepted) => Ok(Json(ReportResponse { accepted })),
        Err(e) => {
            let event = NewEvent {
                region: Some(req.region.clone()),
                agent: Some(req.agent.clone()),
                epoch: Some(req.epoch),
                detail: Some(serde_json::json!({"report_id": req.report_id})),
                ..Default::default()
            };
            agents::record_refusal(&state.db, now, &e, event).await?;
            Err(e)
        }
    }
}

async fn apply(state: &AppState, req: &ReportRequest, now: DateTime<Utc>) -> Result<i64> {
    let body = serde_json::to_value(req).map_err(|e| Error::Internal(Box::new(e)))?;
    let mut tx = state.db.begin().await?;
    agents::fence(&mut tx, &req.region, &req.agent, req.epoch).await?;
    // A concurrent duplicate waits on the primary key and then finds the row.
    let inserted: Option<i64> = sqlx::query_scalar(include_str!("sql/report_insert.sql"))
        .bind(&req.report_id)
        .bind(&req.region)
        .bind(&req.agent)
        .bind(req.epoch)
        .bind(&body)
        .bind(req.items.len() as i64)
        .bind(now)
        .fetch_optional(&mut *tx)
        .await?;
    if inserted.is_none() {
        let (stored, accepted): (serde_json::Value, i64) = sqlx::query_as(include_str!("sql/report_get.sql"))
            .bind(&req.report_id)
            .fetch_one(&mut *tx)
            .await?;
        // The epoch and the agent may differ: a restarted agent, or another
        // replica of the region draining an orphaned outbox, resends the
        // report under its own identity. The counts must match.
        let strip = |mut v: serde_json::Value| {
            if let Some(o) = v.as_object_mut() {
                o.remove("epoch");
                o.remove("agent");
            }
            v
        };
        if strip(stored) != strip(body) {
            return Err(Error::IdempotencyMismatch(format!(
                "report {} was already applied with a different body",
                req.report_id
            )));
        }
        return Ok(accepted);
    }
    // A fixed order of row locks, so two reports never deadlock each other.
    let mut items: Vec<_> = req.items.iter().collect();
    items.sort_by(|a, b| {
        (&a.tenant, &a.resource, a.window_start).cmp(&(&b.tenant, &b.resource, b.window_start))
    });
    for item in items {
        let policy = policies::require(&mut tx, &item.tenant, &item.resource).await?;
        let start = item.window_start.timestamp();
        let window_secs =
            pool_window_secs(&mut tx, &item.tenant, &item.resource, start, policy.window_secs).await?;
        if start.rem_euclid(window_secs) != 0 {
            return Err(Error::invalid(
                "items.window_start",
                format!("{} is not the start of a {window_secs} s window", item.window_start),
            ));
        }
        sqlx::query(include_str!("sql/pool_ensure.sql"))
            .bind(&item.tenant)
            .bind(&item.resource)
            .bind(start)
            .bind(window_secs)
            .bind(policy.limit_tokens)
            .bind(policy.fallback_allowance())
            .bind(now)
            .execute(&mut *tx)
            .await?;
        sqlx::query(include_str!("sql/pool_region_report.sql"))
            .bind(&item.tenant)
            .bind(&item.resource)
            .bind(start)
            .bind(window_secs)
            .bind(&req.region)
            .bind(item.consumed)
            .bind(item.fallback_admitted)
            .execute(&mut *tx)
            .await?;
        let event = NewEvent {
            tenant: Some(item.tenant.clone()),
            resource: Some(item.resource.clone()),
            region: Some(req.region.clone()),
            agent: Some(req.agent.clone()),
            epoch: Some(req.epoch),
            tokens: Some(item.consumed + item.fallback_admitted),
            detail: Some(serde_json::json!({
                "report_id": req.report_id,
                "window_start": item.window_start,
                "consumed": item.consumed,
                "fallback_admitted": item.fallback_admitted,
            })),
            ..Default::default()
        };
        ledger::append(&mut tx, now, Kind::Reported, event).await?;
    }
    tx.commit().await?;
    Ok(req.items.len() as i64)
}

/// The window length of the pool a report item belongs to: the pool that
/// already exists at that start (it may predate a change of `window_secs`),
/// otherwise the policy's current length.
async fn pool_window_secs(
    conn: &mut PgConnection,
    tenant: &str,
    resource: &str,
    start: i64,
    current: i64,
) -> Result<i64> {
    let existing: Option<i64> = sqlx::query_scalar(include_str!("sql/pool_window_secs_at.sql"))
        .bind(tenant)
        .bind(resource)
        .bind(start)
        .bind(current)
        .fetch_optional(conn)
        .await?;
    Ok(existing.unwrap_or(current))
}
