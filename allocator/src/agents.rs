//! Agent registration and epochs (I4). Each registration of `(region, agent)`
//! gets an epoch strictly greater than every earlier one; the counter lives in
//! PostgreSQL, so it survives allocator restarts and concurrent registrations
//! serialise on the row.

use crate::error::{Error, Result};
use crate::http::auth::AgentScope;
use crate::http::extract::{check_id, ApiJson};
use crate::ledger::{self, Kind, NewEvent};
use crate::state::AppState;
use axum::extract::State;
use axum::Json;
use quota_shared::wire::{ErrorBody, RegisterRequest, RegisterResponse};
use sqlx::PgConnection;

/// `POST /v1/agents/register`: a new epoch for `(region, agent)`.
#[utoipa::path(
    post,
    path = "/v1/agents/register",
    request_body = RegisterRequest,
    responses(
        (status = 200, description = "The new epoch", body = RegisterResponse),
        (status = 401, description = "Missing or wrong agent token", body = ErrorBody),
        (status = 403, description = "wrong_region: the credential acts only for another region", body = ErrorBody),
        (status = 422, description = "Invalid identifier", body = ErrorBody),
    ),
    security(("agent_token" = [])),
    tag = "agents"
)]
#[tracing::instrument(name = "register", skip_all, fields(region = %req.region, agent = %req.agent))]
pub(crate) async fn register(
    State(state): State<AppState>,
    scope: AgentScope,
    ApiJson(req): ApiJson<RegisterRequest>,
) -> Result<Json<RegisterResponse>> {
    check_id("region", &req.region)?;
    check_id("agent", &req.agent)?;
    if let Err(e) = scope.check(&req.region) {
        let event = NewEvent { region: Some(req.region), agent: Some(req.agent), ..Default::default() };
        record_refusal(&state, &e, event).await?;
        return Err(e);
    }
    let mut tx = crate::tx::begin(&state.db).await?;
    // After any deletion of this region's gone agents has committed, so the
    // epoch floor read below is current (see retention).
    sqlx::query_file!("src/sql/agent_region_lock.sql", req.region).execute(&mut *tx).await?;
    let now = state.db_clock.now(&mut tx).await?;
    let epoch = sqlx::query_file_scalar!("src/sql/agent_register.sql", req.region, req.agent, now)
        .fetch_one(&mut *tx)
        .await?;
    ledger::append(
        &mut tx,
        now,
        Kind::Registered,
        NewEvent {
            region: Some(req.region.clone()),
            agent: Some(req.agent.clone()),
            epoch: Some(epoch),
            ..Default::default()
        },
    )
    .await?;
    tx.commit().await?;
    tracing::info!(region = %req.region, agent = %req.agent, epoch, "agent registered");
    Ok(Json(RegisterResponse { region: req.region, agent: req.agent, epoch }))
}

/// Checks `epoch` against the current epoch of `(region, agent)` and holds a
/// share lock on the agent row until the transaction ends, so a concurrent
/// registration cannot slip between the check and the change (I4).
///
/// A lower epoch is `409 stale_epoch` (also an epoch of a deleted agent
/// row, see [`crate::retention`]); an epoch never issued is a 422.
#[tracing::instrument(level = "debug", skip_all, fields(region = %region, agent = %agent, epoch = epoch))]
pub async fn fence(conn: &mut PgConnection, region: &str, agent: &str, epoch: i64) -> Result<()> {
    let current = sqlx::query_file_scalar!("src/sql/agent_epoch_lock.sql", region, agent)
        .fetch_optional(&mut *conn)
        .await?;
    let current = match current {
        Some(c) => Some(c),
        // An agent whose row the retention job deleted (gone for longer than
        // the horizon) still holds an epoch at or below its region's floor:
        // that incarnation is over, and answering stale_epoch (not 404)
        // tells the agent to register again, which gives it a higher epoch.
        None => sqlx::query_file_scalar!("src/sql/agent_epoch_floor.sql", region)
            .fetch_optional(&mut *conn)
            .await?
            .filter(|floor| epoch <= *floor)
            .map(|floor| floor + 1),
    };
    match current {
        None => Err(Error::UnknownAgent(format!("{region}/{agent}"))),
        Some(c) if epoch < c => {
            Err(Error::StaleEpoch { who: format!("{region}/{agent}"), got: epoch, current: c })
        }
        Some(c) if epoch > c => Err(Error::invalid(
            "epoch",
            format!("epoch {epoch} was never issued to {region}/{agent} (current {c})"),
        )),
        Some(_) => Ok(()),
    }
}

/// Records a refusal of a fenced or region-bound request in the ledger (in
/// its own transaction, stamped on the database's clock) when the error is
/// one the ledger tracks.
#[tracing::instrument(level = "debug", skip_all, fields(reason = err.code()))]
pub async fn record_refusal(state: &AppState, err: &Error, event: NewEvent) -> Result<()> {
    if matches!(err, Error::StaleEpoch { .. } | Error::IdempotencyMismatch(_) | Error::WrongRegion { .. }) {
        // The region the credential was bound to, next to the one asked for.
        let detail = match err {
            Error::WrongRegion { allowed, .. } if event.detail.is_none() => {
                Some(serde_json::json!({"credential_regions": allowed}))
            }
            _ => event.detail.clone(),
        };
        let at = state.db_clock.now_on(&state.db).await?;
        ledger::append_refusal(
            &state.db,
            at,
            NewEvent { reason: Some(err.code().to_string()), detail, ..event },
        )
        .await?;
    }
    Ok(())
}
