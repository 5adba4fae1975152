//! `POST /v1/reports`: what a region admitted, from leases (`consumed`) and
//! from its fallback allowance (`fallback_admitted`), per quota and window.
//! Applied exactly once per `report_id` (I7); epoch-fenced (I4).
//!
//! All or nothing: when one item is bad the report is refused with the
//! item's index (`item`) and field in the answer, and nothing of it is
//! applied, so the sender can tell which item to fix or drop instead of
//! losing the whole report to a bare 422. An item of a window in the future
//! (on the database's clock, I8) is `invalid_field`; one of a window that
//! started beyond the retention horizon is `report_expired`: its report
//! record may already be deleted (see [`crate::retention`]), and refusing it
//! is what keeps a replay of a deleted report from applying twice.

use crate::agents;
use crate::error::{Error, Result};
use crate::http::auth::AgentScope;
use crate::http::extract::{check_count, check_id, ApiJson};
use crate::ledger::{self, Kind, NewEvent};
use crate::policies;
use crate::state::AppState;
use axum::extract::State;
use axum::Json;
use chrono::{DateTime, Utc};
use quota_shared::wire::{ErrorBody, ReportItem, ReportRequest, ReportResponse};
use sqlx::PgConnection;

/// Most items one report may carry.
pub const MAX_ITEMS: usize = 500;

/// Longest `report_id` accepted.
pub const MAX_REPORT_ID_LEN: usize = 128;

/// How far ahead of the database's clock an item's window may start: an
/// agent's view of the window boundary is derived from earlier answers and
/// its monotonic clock, so it can open the next window a little early.
pub const FUTURE_TOLERANCE_SECS: i64 = 5;

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
        validate_item(i, item).map_err(|e| e.in_item(i))?;
    }
    Ok(())
}

fn validate_item(i: usize, item: &ReportItem) -> Result<()> {
    check_id(&format!("items[{i}].tenant"), &item.tenant)?;
    check_id(&format!("items[{i}].resource"), &item.resource)?;
    check_count(&format!("items[{i}].consumed"), item.consumed, 0)?;
    check_count(&format!("items[{i}].fallback_admitted"), item.fallback_admitted, 0)?;
    check_count(&format!("items[{i}].shadow_refused"), item.shadow_refused, 0)?;
    if item.window_start.timestamp_subsec_nanos() != 0 {
        return Err(Error::invalid(format!("items[{i}].window_start"), "must be a whole second"));
    }
    Ok(())
}

/// Whether item `i`'s window is plausible at `now` (the database's clock):
/// not in the future, not beyond the report horizon.
pub fn check_item_time(
    i: usize,
    item: &ReportItem,
    now: DateTime<Utc>,
    horizon: Option<chrono::Duration>,
) -> Result<()> {
    let latest = now + chrono::Duration::seconds(FUTURE_TOLERANCE_SECS);
    if item.window_start > latest {
        return Err(Error::invalid(
            format!("items[{i}].window_start"),
            format!(
                "{} is in the future (now {now} on the allocator's clock)",
                item.window_start.to_rfc3339()
            ),
        )
        .in_item(i));
    }
    if let Some(h) = horizon {
        if item.window_start < now - h {
            return Err(Error::ReportExpired(format!(
                "items[{i}].window_start: {} is beyond the retention horizon of {} h: \
                 reports of that window can no longer be applied exactly once",
                item.window_start.to_rfc3339(),
                h.num_hours()
            ))
            .in_item(i));
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
        (status = 422, description = "invalid_field (the message and `field` name the field, `item` the report item; nothing applied) or report_expired (an item's window started beyond the retention horizon)", body = ErrorBody),
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
    let outcome = match scope.check(&req.region) {
        // Across a PostgreSQL failover the report is applied again on a
        // fresh connection: safe, since it is idempotent by its id (I7).
        Ok(()) => crate::tx::retry_failover("report", || apply(&state, &req)).await,
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
            agents::record_refusal(&state, &e, event).await?;
            Err(e)
        }
    }
}

#[tracing::instrument(name = "report", skip_all, fields(
    report_id = %req.report_id, region = %req.region, agent = %req.agent, epoch = req.epoch,
    items = req.items.len(),
))]
async fn apply(state: &AppState, req: &ReportRequest) -> Result<i64> {
    let body = serde_json::to_value(req).map_err(|e| Error::Internal(Box::new(e)))?;
    let mut tx = crate::tx::begin(&state.db).await?;
    agents::fence(&mut tx, &req.region, &req.agent, req.epoch).await?;
    let now = state.db_clock.now(&mut tx).await?;
    // Before the idempotency lookup, so the answer for an old report does
    // not depend on whether retention has deleted its record yet.
    for (i, item) in req.items.iter().enumerate() {
        check_item_time(i, item, now, state.report_horizon)?;
    }
    let newest_window_start =
        req.items.iter().map(|i| i.window_start.timestamp()).max().unwrap_or_else(|| now.timestamp());
    // A concurrent duplicate waits on the primary key and then finds the row.
    let inserted = sqlx::query_file_scalar!(
        "src/sql/report_insert.sql",
        req.report_id,
        req.region,
        req.agent,
        req.epoch,
        body,
        req.items.len() as i64,
        now,
        newest_window_start
    )
    .fetch_optional(&mut *tx)
    .await?;
    if inserted.is_none() {
        let stored = sqlx::query_file!("src/sql/report_get.sql", req.report_id).fetch_one(&mut *tx).await?;
        let (stored, accepted) = (stored.body, stored.accepted);
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
    let mut items: Vec<_> = req.items.iter().enumerate().collect();
    items.sort_by(|(_, a), (_, b)| {
        (&a.tenant, &a.resource, a.window_start).cmp(&(&b.tenant, &b.resource, b.window_start))
    });
    // Any error below rolls the whole transaction back: nothing is applied.
    for (i, item) in items {
        apply_item(&mut tx, req, i, item, now).await.map_err(|e| e.in_item(i))?;
    }
    tx.commit().await?;
    Ok(req.items.len() as i64)
}

/// Applies item `i` inside the report's transaction.
#[tracing::instrument(level = "debug", skip_all, fields(
    item = i, tenant = %item.tenant, resource = %item.resource, window_start = %item.window_start,
))]
async fn apply_item(
    tx: &mut PgConnection,
    req: &ReportRequest,
    i: usize,
    item: &ReportItem,
    now: DateTime<Utc>,
) -> Result<()> {
    {
        let policy = policies::require(&mut *tx, &item.tenant, &item.resource).await?;
        let start = item.window_start.timestamp();
        let window_secs =
            pool_window_secs(&mut *tx, &item.tenant, &item.resource, start, policy.window_secs).await?;
        if start.rem_euclid(window_secs) != 0 {
            return Err(Error::invalid(
                format!("items[{i}].window_start"),
                format!("{} is not the start of a {window_secs} s window", item.window_start),
            ));
        }
        sqlx::query_file!(
            "src/sql/pool_ensure.sql",
            item.tenant,
            item.resource,
            start,
            window_secs,
            policy.limit_tokens,
            policy.fallback_allowance(),
            now
        )
        .execute(&mut *tx)
        .await?;
        // Fallback admits reported while the window is open are repaid from
        // its pool: later grants share only what is left, so the window
        // overshoots its limit only by what the pool had already granted
        // while the region was cut off. A closed window's pool grants
        // nothing more, so there its fallback is only accounted. Before the
        // region row: grants lock the pool row first, so must reports.
        let open = start + window_secs > now.timestamp();
        if open && item.fallback_admitted > 0 {
            sqlx::query_file!(
                "src/sql/pool_fallback_owed.sql",
                item.tenant,
                item.resource,
                start,
                window_secs,
                item.fallback_admitted
            )
            .execute(&mut *tx)
            .await?;
        }
        sqlx::query_file!(
            "src/sql/pool_region_report.sql",
            item.tenant,
            item.resource,
            start,
            window_secs,
            req.region,
            item.consumed,
            item.fallback_admitted,
            item.shadow_refused
        )
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
                "shadow_refused": item.shadow_refused,
            })),
            ..Default::default()
        };
        ledger::append(&mut *tx, now, Kind::Reported, event).await?;
    }
    Ok(())
}

/// The window length of the pool a report item belongs to: the pool that
/// already exists at that start (it may predate a change of `window_secs`),
/// otherwise the policy's current length.
#[tracing::instrument(level = "debug", skip_all, fields(tenant = %tenant, resource = %resource, start = start))]
async fn pool_window_secs(
    conn: &mut PgConnection,
    tenant: &str,
    resource: &str,
    start: i64,
    current: i64,
) -> Result<i64> {
    let existing =
        sqlx::query_file_scalar!("src/sql/pool_window_secs_at.sql", tenant, resource, start, current)
            .fetch_optional(conn)
            .await?;
    Ok(existing.unwrap_or(current))
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::StatusCode;
    use chrono::Duration;

    fn item(window_start: &str) -> ReportItem {
        ReportItem {
            tenant: "atlas".into(),
            resource: "read".into(),
            window_start: window_start.parse().unwrap(),
            consumed: 1,
            fallback_admitted: 0,
            shadow_refused: 0,
        }
    }

    #[test]
    fn item_windows_are_checked_against_the_database_clock_and_the_horizon() {
        let now: DateTime<Utc> = "2026-12-03T10:00:30Z".parse().unwrap();
        let week = Some(Duration::hours(168));
        let code =
            |ws: &str, h| check_item_time(3, &item(ws), now, h).err().map(|e| (e.code(), e.status_code()));
        // The current window, and the next one within the tolerance.
        assert_eq!(code("2026-12-03T10:00:00Z", week), None);
        assert_eq!(code("2026-12-03T10:00:35Z", week), None);
        // Further ahead: in the future.
        assert_eq!(
            code("2026-12-03T10:00:36Z", week),
            Some(("invalid_field", StatusCode::UNPROCESSABLE_ENTITY))
        );
        // Exactly at the horizon still applies; one second beyond does not.
        assert_eq!(code("2026-11-26T10:00:30Z", week), None);
        assert_eq!(
            code("2026-11-26T10:00:29Z", week),
            Some(("report_expired", StatusCode::UNPROCESSABLE_ENTITY))
        );
        // Retention disabled: any age applies.
        assert_eq!(code("2000-01-01T00:00:00Z", None), None);
        // The error names the item.
        match check_item_time(3, &item("2030-01-01T00:00:00Z"), now, week) {
            Err(Error::InItem { item: 3, source }) => {
                assert!(source.to_string().contains("items[3].window_start"))
            }
            other => panic!("{other:?}"),
        }
    }
}
