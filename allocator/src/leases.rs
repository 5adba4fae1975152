//! Leases: the row type, `POST /v1/leases/{id}/release` (unspent tokens go
//! back to the pool only while the window is open; idempotent; epoch-fenced,
//! I4), its batch form `POST /v1/leases/release` (each item decided as the
//! single form would, answered item by item) and `GET /v1/leases/{id}` with
//! the lease's ledger events.

use crate::agents;
use crate::error::{Error, Result};
use crate::http::auth::AgentScope;
use crate::http::extract::{check_count, parse_json, ApiJson, ApiPath};
use crate::ledger::{self, Kind, NewEvent};
use crate::state::AppState;
use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use chrono::{DateTime, Utc};
use futures::StreamExt;
use quota_shared::window::Window;
use quota_shared::wire::{
    ErrorBody, FailMode, GrantResponse, LeaseView, PerKey, PoolSnapshot, ReleaseBatchRequest,
    ReleaseBatchResponse, ReleaseItemAnswer, ReleaseRequest, MAX_RELEASE_BATCH,
};
use serde::Serialize;
use utoipa::ToSchema;
use uuid::Uuid;

/// A lease row (the columns of `sql/lease_*.sql` and `sql/explain_leases.sql`).
#[derive(Debug, Clone)]
pub struct LeaseRow {
    pub lease_id: Uuid,
    pub tenant: String,
    pub resource: String,
    pub region: String,
    pub agent: String,
    pub epoch: i64,
    pub seq: i64,
    pub window_start: i64,
    pub window_secs: i64,
    pub want: i64,
    pub demand_per_sec: f64,
    pub window_sel: String,
    pub tokens: i64,
    pub issued_at: DateTime<Utc>,
    pub expires_at: DateTime<Utc>,
    pub policy_version: i64,
    pub fallback_allowance: i64,
    pub fail_mode: String,
    pub pool_limit: i64,
    pub pool_granted: i64,
    pub pool_available: i64,
    pub retry_after_ms: Option<i64>,
    pub unspent: Option<i64>,
    pub returned: Option<i64>,
    pub released_at: Option<DateTime<Utc>>,
    pub per_key_rate_milli: Option<i64>,
    pub per_key_burst: Option<i64>,
    pub enforce: bool,
}

impl LeaseRow {
    /// The lease's window.
    pub fn window(&self) -> Window {
        Window { start: self.window_start, secs: self.window_secs }
    }

    /// End of the lease's window.
    pub fn window_end(&self) -> DateTime<Utc> {
        self.window().end_at()
    }

    /// The grant answer. Everything is as first granted except
    /// `expires_in_ms`, which is recomputed from "now": an agent measures it
    /// from the instant it sent the (replayed) request, so repeating the
    /// original value would extend the lease past `expires_at` (I2).
    pub fn to_grant_response(&self, now: DateTime<Utc>) -> GrantResponse {
        GrantResponse {
            lease_id: self.lease_id,
            tenant: self.tenant.clone(),
            resource: self.resource.clone(),
            region: self.region.clone(),
            agent: self.agent.clone(),
            epoch: self.epoch,
            seq: self.seq,
            tokens: self.tokens,
            window_start: self.window().start_at(),
            window_end: self.window_end(),
            expires_at: self.expires_at,
            expires_in_ms: (self.expires_at - now).num_milliseconds().max(0),
            policy_version: self.policy_version,
            fallback_allowance: self.fallback_allowance,
            fail_mode: FailMode::parse(&self.fail_mode).unwrap_or(FailMode::Strict),
            pool: PoolSnapshot {
                limit: self.pool_limit,
                granted: self.pool_granted,
                available: self.pool_available,
            },
            per_key: PerKey::from_stored(self.per_key_rate_milli, self.per_key_burst),
            enforce: self.enforce,
            // Not a lease column: the grant answer reads it from the
            // lease's policy version (see `grants`).
            on_stale: Default::default(),
            reserve: Vec::new(),
            retry_after_ms: self.retry_after_ms,
        }
    }

    /// The ledger's view of the lease.
    pub fn to_view(&self) -> LeaseView {
        LeaseView {
            lease_id: self.lease_id,
            tenant: self.tenant.clone(),
            resource: self.resource.clone(),
            region: self.region.clone(),
            agent: self.agent.clone(),
            epoch: self.epoch,
            seq: self.seq,
            tokens: self.tokens,
            window_start: self.window().start_at(),
            window_end: self.window_end(),
            issued_at: self.issued_at,
            expires_at: self.expires_at,
            policy_version: self.policy_version,
            unspent: self.unspent,
            returned: self.returned,
            released_at: self.released_at,
        }
    }
}

fn parse_lease_id(s: &str) -> Result<Uuid> {
    Uuid::parse_str(s).map_err(|_| Error::invalid("lease_id", format!("{s:?} is not a UUID")))
}

/// `POST /v1/leases/{lease_id}/release`: unspent tokens back to an open pool.
#[utoipa::path(
    post,
    path = "/v1/leases/{lease_id}/release",
    params(("lease_id" = Uuid, Path)),
    request_body = ReleaseRequest,
    responses(
        (status = 200, description = "The lease with returned", body = LeaseView),
        (status = 401, description = "Missing or wrong agent token", body = ErrorBody),
        (status = 403, description = "wrong_region: the credential acts only for another region (the lease's)", body = ErrorBody),
        (status = 404, description = "Unknown lease", body = ErrorBody),
        (status = 409, description = "stale_epoch or idempotency_mismatch", body = ErrorBody),
        (status = 422, description = "Invalid value; the message names the field", body = ErrorBody),
    ),
    security(("agent_token" = [])),
    tag = "agents"
)]
pub(crate) async fn release(
    State(state): State<AppState>,
    scope: AgentScope,
    ApiPath(lease_id): ApiPath<String>,
    ApiJson(req): ApiJson<ReleaseRequest>,
) -> Result<Json<LeaseView>> {
    let lease_id = parse_lease_id(&lease_id)?;
    Ok(Json(release_one(&state, &scope, lease_id, &req).await?))
}

/// Releases decided at once in one batch: like a grant batch, a quarter of
/// the default pool, so single calls arriving meanwhile still find
/// connections.
const BATCH_PARALLEL: usize = 4;

/// `POST /v1/leases/release`: several releases in one request.
#[utoipa::path(
    post,
    path = "/v1/leases/release",
    request_body = ReleaseBatchRequest,
    responses(
        (status = 200, description = "One answer per item, in the items' order, each with the status and body `POST /v1/leases/{lease_id}/release` would have answered (an item's 422 names `items[i].<field>`)", body = ReleaseBatchResponse),
        (status = 401, description = "Missing or wrong agent token", body = ErrorBody),
        (status = 422, description = "Invalid body: no items, more than 64 (names `items`), or a malformed item", body = ErrorBody),
    ),
    security(("agent_token" = [])),
    tag = "agents"
)]
pub(crate) async fn release_batch(
    State(state): State<AppState>,
    scope: AgentScope,
    ApiJson(body): ApiJson<serde_json::Value>,
) -> Result<Json<ReleaseBatchResponse>> {
    let batch: ReleaseBatchRequest = parse_json(&body)?;
    if batch.items.is_empty() || batch.items.len() > MAX_RELEASE_BATCH {
        return Err(Error::invalid(
            "items",
            format!("a batch carries 1 to {MAX_RELEASE_BATCH} items, got {}", batch.items.len()),
        ));
    }
    state.metrics.inc("allocator_release_batches_total", &[]);
    state.metrics.inc_by("allocator_release_batch_items_total", &[], batch.items.len() as f64);
    let (state, scope) = (&state, &scope);
    let items = futures::stream::iter(batch.items.into_iter().enumerate())
        .map(|(i, item)| async move {
            let req = ReleaseRequest { epoch: item.epoch, unspent: item.unspent };
            match release_one(state, scope, item.lease_id, &req).await {
                Ok(view) => {
                    ReleaseItemAnswer { status: StatusCode::OK.as_u16(), lease: Some(view), error: None }
                }
                Err(e) => {
                    let e = e.of_batch_item(i);
                    ReleaseItemAnswer {
                        status: e.status_code().as_u16(),
                        lease: None,
                        error: Some(e.to_body()),
                    }
                }
            }
        })
        .buffered(BATCH_PARALLEL)
        .collect()
        .await;
    Ok(Json(ReleaseBatchResponse { items }))
}

/// One release, validated, decided and (when refused) recorded in the
/// ledger: the single form's whole work, shared by the batch.
async fn release_one(
    state: &AppState,
    scope: &AgentScope,
    lease_id: Uuid,
    req: &ReleaseRequest,
) -> Result<LeaseView> {
    check_count("epoch", req.epoch, 1)?;
    check_count("unspent", req.unspent, 0)?;
    match try_release(state, scope, lease_id, req).await {
        Ok(view) => Ok(view),
        Err((e, Some(row))) => {
            let event = NewEvent {
                tenant: Some(row.tenant),
                resource: Some(row.resource),
                region: Some(row.region),
                agent: Some(row.agent),
                epoch: Some(req.epoch),
                lease_id: Some(lease_id),
                tokens: Some(req.unspent),
                ..Default::default()
            };
            agents::record_refusal(state, &e, event).await?;
            Err(e)
        }
        Err((e, None)) => Err(e),
    }
}

/// The release transaction; on refusal also hands back the lease for the
/// ledger entry.
#[tracing::instrument(name = "release", skip_all, fields(
    lease_id = %lease_id, region = tracing::field::Empty, agent = tracing::field::Empty, epoch = req.epoch,
))]
async fn try_release(
    state: &AppState,
    scope: &AgentScope,
    lease_id: Uuid,
    req: &ReleaseRequest,
) -> Result<LeaseView, (Error, Option<LeaseRow>)> {
    let mut tx = crate::tx::begin(&state.db).await.map_err(|e| (e.into(), None))?;
    let row = sqlx::query_file_as!(LeaseRow, "src/sql/lease_lock.sql", lease_id)
        .fetch_optional(&mut *tx)
        .await
        .map_err(|e| (e.into(), None))?
        .ok_or_else(|| (Error::UnknownLease(lease_id.to_string()), None))?;
    let span = tracing::Span::current();
    span.record("region", row.region.as_str());
    span.record("agent", row.agent.as_str());
    let fail = |e: Error| (e, Some(row.clone()));
    // The path names only the lease; the region it acts for is the lease's.
    scope.check(&row.region).map_err(fail)?;
    // The sender's current epoch of the lease's agent: a restarted agent
    // releases its predecessor's leases under its new epoch.
    agents::fence(&mut tx, &row.region, &row.agent, req.epoch).await.map_err(fail)?;
    if let Some(unspent) = row.unspent {
        if unspent != req.unspent {
            return Err(fail(Error::IdempotencyMismatch(format!(
                "lease {lease_id} was already released with unspent {unspent}, not {}",
                req.unspent
            ))));
        }
        return Ok(row.to_view());
    }
    if req.unspent > row.tokens {
        return Err(fail(Error::invalid(
            "unspent",
            format!("{} is more than the lease's {} tokens", req.unspent, row.tokens),
        )));
    }
    // Whether the window is still open is decided on the one clock (I8).
    let now = state.db_clock.now(&mut tx).await.map_err(fail)?;
    let returned = if now < row.window_end() { req.unspent } else { 0 };
    let updated =
        sqlx::query_file_as!(LeaseRow, "src/sql/lease_release.sql", lease_id, req.unspent, returned, now)
            .fetch_one(&mut *tx)
            .await
            .map_err(|e| fail(e.into()))?;
    if returned > 0 {
        sqlx::query_file!(
            "src/sql/pool_add_returned.sql",
            row.tenant,
            row.resource,
            row.window_start,
            row.window_secs,
            row.region,
            returned
        )
        .execute(&mut *tx)
        .await
        .map_err(|e| fail(e.into()))?;
    }
    let event = NewEvent {
        tenant: Some(row.tenant.clone()),
        resource: Some(row.resource.clone()),
        region: Some(row.region.clone()),
        agent: Some(row.agent.clone()),
        epoch: Some(req.epoch),
        seq: Some(row.seq),
        lease_id: Some(lease_id),
        tokens: Some(returned),
        detail: Some(serde_json::json!({"unspent": req.unspent, "returned": returned})),
        ..Default::default()
    };
    ledger::append(&mut tx, now, Kind::Released, event).await.map_err(fail)?;
    tx.commit().await.map_err(|e| fail(e.into()))?;
    state.metrics.inc_by("allocator_released_tokens_total", &[], returned as f64);
    Ok(updated.to_view())
}

/// `GET /v1/leases/{id}` answer.
#[derive(Debug, Serialize, ToSchema)]
pub struct LeaseWithEvents {
    #[serde(flatten)]
    pub lease: LeaseView,
    pub events: Vec<ledger::Event>,
}

/// `GET /v1/leases/{lease_id}`: one lease with its ledger events.
#[utoipa::path(
    get,
    path = "/v1/leases/{lease_id}",
    params(("lease_id" = Uuid, Path)),
    responses(
        (status = 200, description = "The lease and its events", body = LeaseWithEvents),
        (status = 401, description = "Missing or wrong admin token", body = ErrorBody),
        (status = 404, description = "Unknown lease", body = ErrorBody),
        (status = 422, description = "Not a UUID", body = ErrorBody),
    ),
    security(("admin_token" = [])),
    tag = "operator"
)]
pub(crate) async fn get_lease(
    State(state): State<AppState>,
    ApiPath(lease_id): ApiPath<String>,
) -> Result<Json<serde_json::Value>> {
    let lease_id = parse_lease_id(&lease_id)?;
    let row = sqlx::query_file_as!(LeaseRow, "src/sql/lease_get.sql", lease_id)
        .fetch_optional(&state.db)
        .await?
        .ok_or_else(|| Error::UnknownLease(lease_id.to_string()))?;
    let events = ledger::for_lease(&state.db, lease_id, &row.tenant, &row.resource).await?;
    let body = LeaseWithEvents { lease: row.to_view(), events };
    Ok(Json(serde_json::to_value(body).map_err(|e| Error::Internal(Box::new(e)))?))
}
