//! `PUT /v1/agents/{region}/{agent}/status`: what each agent says about
//! itself every few seconds (epoch, whether its breaker reaches the
//! allocator, outbox depth, dead letters, per quota its mode and the 429 and
//! 503 answers of the open window), kept as one row per agent for the fleet
//! pages of `/ui` (see [`crate::ui::fleet`]).
//!
//! Only the latest status is kept (an upsert); `last_seen` is the
//! database's clock (I8), so staleness never compares an agent's clock with
//! the allocator's. The call is fenced like every agent call (I4): a status
//! from a superseded epoch is `409 stale_epoch`. Old rows go with the
//! retention job (see [`crate::retention`]). Reports (`POST /v1/reports`)
//! carry admits only, so the 429/503 counts come from here; they are an
//! operator's view, never input to a decision.

use crate::agents;
use crate::error::{Error, Result};
use crate::http::auth::AgentScope;
use crate::http::extract::{check_count, check_id, ApiJson, ApiPath};
use crate::ledger::NewEvent;
use crate::state::AppState;
use axum::extract::State;
use axum::http::StatusCode;
use chrono::{DateTime, Utc};
use quota_shared::wire::{AgentQuotaStatus, AgentStatusReport, ErrorBody};
use sqlx::types::Json;
use sqlx::PgPool;
use std::collections::HashSet;

/// Most quotas one status may list (the agent sends the ones with refusals
/// or not leased first, and says how many it holds in `quotas_total`).
pub const MAX_QUOTAS: usize = 200;

/// The latest status of one agent, as stored.
#[derive(Debug, Clone)]
pub struct AgentStatusRow {
    pub region: String,
    pub agent: String,
    pub epoch: i64,
    pub allocator_reachable: bool,
    pub outbox_depth: i64,
    pub dead_letters: Option<i64>,
    pub quotas_total: i64,
    pub quotas: Json<Vec<AgentQuotaStatus>>,
    /// The database's clock when the status arrived.
    pub last_seen: DateTime<Utc>,
}

/// Checks a status body; the error names the field.
pub fn validate(req: &AgentStatusReport) -> Result<()> {
    check_count("epoch", req.epoch, 1)?;
    check_count("outbox_depth", req.outbox_depth, 0)?;
    if let Some(d) = req.dead_letters {
        check_count("dead_letters", d, 0)?;
    }
    check_count("quotas_total", req.quotas_total, 0)?;
    if req.quotas.len() > MAX_QUOTAS {
        return Err(Error::invalid(
            "quotas",
            format!("at most {MAX_QUOTAS} quotas per status, got {}", req.quotas.len()),
        ));
    }
    if (req.quotas.len() as i64) > req.quotas_total {
        return Err(Error::invalid("quotas_total", "must be at least the number of quotas listed"));
    }
    let mut seen = HashSet::new();
    for (i, q) in req.quotas.iter().enumerate() {
        check_id(&format!("quotas[{i}].tenant"), &q.tenant)?;
        check_id(&format!("quotas[{i}].resource"), &q.resource)?;
        check_count(&format!("quotas[{i}].quota_exhausted"), q.quota_exhausted, 0)?;
        check_count(&format!("quotas[{i}].unavailable"), q.unavailable, 0)?;
        check_count(&format!("quotas[{i}].per_key_limited"), q.per_key_limited, 0)?;
        check_count(&format!("quotas[{i}].admitted"), q.admitted, 0)?;
        if let Some(v) = q.policy_version {
            check_count(&format!("quotas[{i}].policy_version"), v, 1)?;
        }
        if q.window_start.timestamp_subsec_nanos() != 0 {
            return Err(Error::invalid(format!("quotas[{i}].window_start"), "must be a whole second"));
        }
        if !seen.insert((q.tenant.as_str(), q.resource.as_str())) {
            return Err(Error::invalid(
                format!("quotas[{i}]"),
                format!("{}/{} is listed twice", q.tenant, q.resource),
            ));
        }
    }
    Ok(())
}

/// `PUT /v1/agents/{region}/{agent}/status`: replaces the agent's status.
#[utoipa::path(
    put,
    path = "/v1/agents/{region}/{agent}/status",
    params(("region" = String, Path), ("agent" = String, Path)),
    request_body = AgentStatusReport,
    responses(
        (status = 204, description = "Stored as the agent's latest status"),
        (status = 401, description = "Missing or wrong agent token", body = ErrorBody),
        (status = 403, description = "wrong_region: the credential acts only for another region", body = ErrorBody),
        (status = 404, description = "unknown_agent: the agent never registered", body = ErrorBody),
        (status = 409, description = "stale_epoch: the agent registered again since (it should register)", body = ErrorBody),
        (status = 422, description = "invalid_field: the message and `field` name the field (more than 200 quotas, a duplicate quota, a negative count, an epoch never issued)", body = ErrorBody),
    ),
    security(("agent_token" = [])),
    tag = "agents"
)]
pub(crate) async fn put_status(
    State(state): State<AppState>,
    scope: AgentScope,
    ApiPath((region, agent)): ApiPath<(String, String)>,
    ApiJson(req): ApiJson<AgentStatusReport>,
) -> Result<StatusCode> {
    check_id("region", &region)?;
    check_id("agent", &agent)?;
    validate(&req)?;
    let outcome = match scope.check(&region) {
        Ok(()) => store(&state, &region, &agent, &req).await,
        Err(e) => Err(e),
    };
    if let Err(e) = outcome {
        let event = NewEvent {
            region: Some(region),
            agent: Some(agent),
            epoch: Some(req.epoch),
            detail: Some(serde_json::json!({"call": "status"})),
            ..Default::default()
        };
        agents::record_refusal(&state, &e, event).await?;
        return Err(e);
    }
    Ok(StatusCode::NO_CONTENT)
}

async fn store(state: &AppState, region: &str, agent: &str, req: &AgentStatusReport) -> Result<()> {
    let mut tx = crate::tx::begin(&state.db).await?;
    agents::fence(&mut tx, region, agent, req.epoch).await?;
    let now = state.db_clock.now(&mut tx).await?;
    sqlx::query_file!(
        "src/sql/agent_status_upsert.sql",
        region,
        agent,
        req.epoch,
        req.allocator_reachable,
        req.outbox_depth,
        req.dead_letters,
        req.quotas_total,
        Json(&req.quotas) as _,
        now,
    )
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(())
}

/// The first `limit` statuses by region and agent.
pub async fn latest(db: &PgPool, limit: i64) -> Result<Vec<AgentStatusRow>> {
    Ok(sqlx::query_file_as!(AgentStatusRow, "src/sql/agent_status_list.sql", limit).fetch_all(db).await?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use quota_shared::wire::QuotaMode;

    fn quota(tenant: &str) -> AgentQuotaStatus {
        AgentQuotaStatus {
            tenant: tenant.into(),
            resource: "read".into(),
            mode: QuotaMode::Leased,
            window_start: DateTime::from_timestamp(1_800_000_000, 0).unwrap(),
            quota_exhausted: 0,
            unavailable: 0,
            per_key_limited: 0,
            admitted: 0,
            policy_version: None,
        }
    }

    fn report(quotas: Vec<AgentQuotaStatus>) -> AgentStatusReport {
        AgentStatusReport {
            epoch: 1,
            allocator_reachable: true,
            outbox_depth: 0,
            dead_letters: Some(0),
            quotas_total: quotas.len() as i64,
            quotas,
        }
    }

    fn field(r: Result<()>) -> String {
        match r {
            Err(Error::InvalidField { field, .. }) => field,
            other => panic!("expected invalid_field, got {other:?}"),
        }
    }

    #[test]
    fn status_bodies_are_bounded_and_name_the_bad_field() {
        assert!(validate(&report(vec![quota("a"), quota("b")])).is_ok());
        assert_eq!(field(validate(&report(vec![quota("a"), quota("a")]))), "quotas[1]");
        let many = (0..=MAX_QUOTAS).map(|i| quota(&format!("t{i}"))).collect();
        assert_eq!(field(validate(&report(many))), "quotas");
        let mut r = report(vec![quota("a")]);
        r.quotas[0].unavailable = -1;
        assert_eq!(field(validate(&r)), "quotas[0].unavailable");
        let mut r = report(vec![quota("a")]);
        r.quotas_total = 0;
        assert_eq!(field(validate(&r)), "quotas_total");
        let mut r = report(vec![]);
        r.outbox_depth = -3;
        assert_eq!(field(validate(&r)), "outbox_depth");
    }
}
