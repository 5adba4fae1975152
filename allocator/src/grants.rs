//! `POST /v1/grants`: one grant, or a batch of them.
//!
//! A grant is one statement, `quota_grant` (see its migration), sent in
//! autocommit: it fences the epoch (I4), looks the idempotency key up (I3),
//! locks the pool row and keeps its limit current (I1, I9), computes the
//! demand-weighted share, inserts the lease clamped to its window (I2),
//! updates the pool and appends the ledger event, all inside the server.
//! One round trip per grant, and the pool row lock (which, not a leader,
//! makes concurrent grants from any number of replicas safe) is held only
//! for the statement's own work, never across a network wait.
//!
//! A grant that meets a PostgreSQL failover (closed connection, read-only
//! server) is sent again within a short budget (`crate::tx::retry_failover`).
//!
//! A batch (`{"items": [...]}`) decides each item exactly as the single form
//! would, several at a time on the connection pool, and answers them item
//! by item with the single form's status and body.

use crate::agents;
use crate::error::{Error, Result};
use crate::http::auth::AgentScope;
use crate::http::extract::{check_count, check_id, parse_json, ApiJson};
use crate::leases::LeaseRow;
use crate::ledger::NewEvent;
use crate::state::AppState;
use axum::extract::State;
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use chrono::{DateTime, Utc};
use futures::StreamExt;
use quota_shared::wire::{
    ErrorBody, GrantBatchRequest, GrantBatchResponse, GrantItemAnswer, GrantRequest, GrantResponse, OnStale,
    PolicyKind, Reserve, MAX_GRANT_BATCH,
};
use serde::Deserialize;
use std::time::Instant;
use tracing::Span;
use uuid::Uuid;

/// Largest demand accepted, tokens per second.
pub(crate) const MAX_DEMAND_PER_SEC: f64 = 1e12;

/// Items of one batch decided at once. Each holds a pool connection for
/// one statement; a quarter of the default pool (16) leaves the rest to
/// single grants, releases and reports arriving meanwhile.
const BATCH_PARALLEL: usize = 4;

fn validate(req: &GrantRequest) -> Result<()> {
    check_id("tenant", &req.tenant)?;
    check_id("resource", &req.resource)?;
    check_id("region", &req.region)?;
    check_id("agent", &req.agent)?;
    check_count("epoch", req.epoch, 1)?;
    check_count("seq", req.seq, 0)?;
    check_count("want", req.want, 1)?;
    if !req.demand_per_sec.is_finite() || !(0.0..=MAX_DEMAND_PER_SEC).contains(&req.demand_per_sec) {
        return Err(Error::invalid(
            "demand_per_sec",
            format!("must be a finite number between 0 and {MAX_DEMAND_PER_SEC}, got {}", req.demand_per_sec),
        ));
    }
    Ok(())
}

/// The body's two forms, for the OpenAPI document (the handler tells them
/// apart by the `items` key, so each form's errors name its own fields).
#[derive(Deserialize, utoipa::ToSchema)]
#[serde(untagged)]
#[allow(dead_code)] // never built, only described
pub(crate) enum GrantBody {
    Single(GrantRequest),
    Batch(GrantBatchRequest),
}

/// The answer's two forms, for the OpenAPI document.
#[derive(Deserialize, utoipa::ToSchema)]
#[serde(untagged)]
#[allow(dead_code, clippy::large_enum_variant)] // never built, only described
pub(crate) enum GrantAnswer {
    Single(GrantResponse),
    Batch(GrantBatchResponse),
}

/// The outcome of one grant attempt.
enum Outcome {
    Granted(LeaseRow, Version),
    Replayed(LeaseRow, Version),
}

/// What a grant answer says of its lease's policy version beyond the
/// lease's own columns.
struct Version {
    on_stale: OnStale,
    reserve: Vec<Reserve>,
}

impl Version {
    /// From the stored columns (written validated).
    fn of(on_stale: &str, reserve: serde_json::Value) -> Version {
        Version {
            on_stale: OnStale::parse(on_stale).unwrap_or_default(),
            reserve: serde_json::from_value(reserve).unwrap_or_default(),
        }
    }

    /// The grant answer of `lease` under this version, at `now`.
    fn answer(self, lease: &LeaseRow, now: DateTime<Utc>) -> GrantResponse {
        GrantResponse { on_stale: self.on_stale, reserve: self.reserve, ..lease.to_grant_response(now) }
    }
}

/// The stale behaviour and reserves of a policy version, read on their
/// own (see `src/sql/policy_version_extras.sql`); a version retention
/// removed reads as `keep` without reserves.
async fn version_extras(state: &AppState, tenant: &str, resource: &str, version: i64) -> Result<Version> {
    let row = sqlx::query_file!("src/sql/policy_version_extras.sql", tenant, resource, version)
        .fetch_optional(&state.db)
        .await?;
    Ok(row.map_or(Version { on_stale: OnStale::Keep, reserve: Vec::new() }, |r| {
        Version::of(&r.on_stale, r.reserve)
    }))
}

/// `POST /v1/grants`: a lease, or a replay of one (I1–I4); or, with
/// `items`, up to `MAX_GRANT_BATCH` of them answered item by item.
#[utoipa::path(
    post,
    path = "/v1/grants",
    request_body = GrantBody,
    responses(
        (status = 200, description = "The lease (tokens may be 0 with retry_after_ms); a replay carries Idempotent-Replayed: true. A batch (`items`, 1 to 64) answers 200 with one answer per item, in order, each with the status and body the single form would have answered (`replayed` for the header)", body = GrantAnswer),
        (status = 401, description = "Missing or wrong agent token", body = ErrorBody),
        (status = 403, description = "wrong_region: the credential acts only for another region", body = ErrorBody),
        (status = 404, description = "Unknown quota or agent", body = ErrorBody),
        (status = 409, description = "stale_epoch, idempotency_mismatch, or concurrency_policy (the quota is a concurrency policy: its permits are leased through POST /v1/permits/lease)", body = ErrorBody),
        (status = 422, description = "Invalid value; the message names the field (a batch with no items or more than 64 names `items`)", body = ErrorBody),
    ),
    security(("agent_token" = [])),
    tag = "agents"
)]
pub(crate) async fn grant(
    State(state): State<AppState>,
    scope: AgentScope,
    ApiJson(body): ApiJson<serde_json::Value>,
) -> Result<Response> {
    if body.get("items").is_some() {
        let batch: GrantBatchRequest = parse_json(&body)?;
        return Ok(Json(grant_batch(&state, &scope, batch).await?).into_response());
    }
    let req: GrantRequest = parse_json(&body)?;
    let (replayed, answer) = grant_one(&state, &scope, &req).await?;
    let mut resp = Json(answer).into_response();
    if replayed {
        resp.headers_mut().insert("idempotent-replayed", HeaderValue::from_static("true"));
    }
    Ok(resp)
}

/// The items of a batch, each decided as the single form would decide it.
async fn grant_batch(
    state: &AppState,
    scope: &AgentScope,
    batch: GrantBatchRequest,
) -> Result<GrantBatchResponse> {
    if batch.items.is_empty() || batch.items.len() > MAX_GRANT_BATCH {
        return Err(Error::invalid(
            "items",
            format!("a batch carries 1 to {MAX_GRANT_BATCH} items, got {}", batch.items.len()),
        ));
    }
    state.metrics.inc("allocator_grant_batches_total", &[]);
    state.metrics.inc_by("allocator_grant_batch_items_total", &[], batch.items.len() as f64);
    // Owned items: a stream of borrowed ones makes the handler's future
    // fail axum's `Send` bound (a higher-ranked lifetime rustc cannot prove).
    let items = futures::stream::iter(batch.items.into_iter().enumerate())
        .map(|(i, req)| async move {
            match grant_one(state, scope, &req).await {
                Ok((replayed, grant)) => GrantItemAnswer {
                    status: StatusCode::OK.as_u16(),
                    replayed,
                    grant: Some(grant),
                    error: None,
                },
                Err(e) => {
                    let e = e.of_batch_item(i);
                    GrantItemAnswer {
                        status: e.status_code().as_u16(),
                        replayed: false,
                        grant: None,
                        error: Some(e.to_body()),
                    }
                }
            }
        })
        .buffered(BATCH_PARALLEL)
        .collect()
        .await;
    Ok(GrantBatchResponse { items })
}

/// One grant, validated, scoped, decided, counted and (when refused for a
/// reason the ledger tracks) recorded: the lease and whether it is a replay.
async fn grant_one(
    state: &AppState,
    scope: &AgentScope,
    req: &GrantRequest,
) -> Result<(bool, GrantResponse)> {
    validate(req)?;
    if let Err(e) = scope.check(&req.region) {
        state.metrics.inc("allocator_grants_total", &[("outcome", e.code())]);
        agents::record_refusal(state, &e, event_of(req)).await?;
        return Err(e);
    }
    let started = Instant::now();
    // Across a PostgreSQL failover the statement is sent again on a fresh
    // connection: safe, since a grant is idempotent by its key (I3), so an
    // attempt that committed before its answer was lost is replayed.
    let outcome = crate::tx::retry_failover("grant", || async {
        let mut attempts = 0;
        // Two requests with one key racing on different pools both miss the
        // lookup; the loser hits the unique key and retries once to read the
        // winner's lease. Two attempts always suffice: the key then exists.
        loop {
            attempts += 1;
            // No place within the connection wait is the pool's own timeout:
            // the same 503 (`database_unavailable`), retried with the same key.
            let place = state.grant_gate.enter(&req.tenant, &req.resource, crate::DB_ACQUIRE_TIMEOUT).await;
            let r = match place {
                Some(_place) => try_grant(state, req).await,
                None => Err(sqlx::Error::PoolTimedOut.into()),
            };
            match r {
                Err(Error::KeyTaken(_)) if attempts < 2 => continue,
                other => break other,
            }
        }
    })
    .await;
    let result = match outcome {
        // `expires_in_ms` is counted from the database's instant read in the
        // grant statement, after the agent sent the request: the agent's
        // deadline (send instant + expires_in_ms) can only fall before
        // `expires_at` (I2), whatever this replica's clock says.
        Ok((Outcome::Granted(row, v), now)) => {
            state.metrics.inc(
                "allocator_grants_total",
                &[("outcome", if row.tokens > 0 { "granted" } else { "empty" })],
            );
            state.metrics.inc_by("allocator_granted_tokens_total", &[], row.tokens as f64);
            Ok((false, v.answer(&row, now)))
        }
        Ok((Outcome::Replayed(row, v), now)) => {
            state.metrics.inc("allocator_grants_total", &[("outcome", "replayed")]);
            Ok((true, v.answer(&row, now)))
        }
        Err(e) => {
            state.metrics.inc("allocator_grants_total", &[("outcome", e.code())]);
            agents::record_refusal(state, &e, event_of(req)).await?;
            Err(e)
        }
    };
    state.metrics.observe("allocator_grant_seconds", &[], started.elapsed().as_secs_f64());
    result
}

fn event_of(req: &GrantRequest) -> NewEvent {
    NewEvent {
        tenant: Some(req.tenant.clone()),
        resource: Some(req.resource.clone()),
        region: Some(req.region.clone()),
        agent: Some(req.agent.clone()),
        epoch: Some(req.epoch),
        seq: Some(req.seq),
        ..Default::default()
    }
}

/// The row `sql/grant.sql` answers: the outcome, and the lease's columns
/// when there is a lease (granted, replayed, or the one a mismatched key
/// names).
struct GrantRow {
    outcome: String,
    now_at: Option<DateTime<Utc>>,
    current_epoch: Option<i64>,
    opens_at: Option<DateTime<Utc>>,
    lease_id: Option<Uuid>,
    tenant: Option<String>,
    resource: Option<String>,
    region: Option<String>,
    agent: Option<String>,
    epoch: Option<i64>,
    seq: Option<i64>,
    window_start: Option<i64>,
    window_secs: Option<i64>,
    want: Option<i64>,
    demand_per_sec: Option<f64>,
    window_sel: Option<String>,
    tokens: Option<i64>,
    issued_at: Option<DateTime<Utc>>,
    expires_at: Option<DateTime<Utc>>,
    policy_version: Option<i64>,
    fallback_allowance: Option<i64>,
    fail_mode: Option<String>,
    pool_limit: Option<i64>,
    pool_granted: Option<i64>,
    pool_available: Option<i64>,
    retry_after_ms: Option<i64>,
    unspent: Option<i64>,
    returned: Option<i64>,
    released_at: Option<DateTime<Utc>>,
    per_key_rate_milli: Option<i64>,
    per_key_burst: Option<i64>,
    enforce: Option<bool>,
    /// Of the lease's policy version; `None` only if retention removed
    /// that version (read as `keep`).
    on_stale: Option<String>,
    /// Of the lease's policy version, like `on_stale`.
    reserve: Option<serde_json::Value>,
}

/// A column `quota_grant` always fills for a lease, missing: a bug.
fn missing(column: &str) -> Error {
    Error::Internal(format!("quota_grant answered a lease without {column}").into())
}

impl GrantRow {
    /// The instant the statement decided at.
    fn now(&self) -> Result<DateTime<Utc>> {
        self.now_at.ok_or_else(|| missing("now_at"))
    }

    /// The lease the row carries, and what the statement read of its
    /// policy version (`None` when its snapshot predates that version).
    fn lease_and_version(mut self) -> Result<(LeaseRow, Option<Version>)> {
        let version = match (self.on_stale.take(), self.reserve.take()) {
            (Some(on_stale), Some(reserve)) => Some(Version::of(&on_stale, reserve)),
            _ => None,
        };
        Ok((self.lease()?, version))
    }

    /// The lease the row carries.
    fn lease(self) -> Result<LeaseRow> {
        Ok(LeaseRow {
            lease_id: self.lease_id.ok_or_else(|| missing("lease_id"))?,
            tenant: self.tenant.ok_or_else(|| missing("tenant"))?,
            resource: self.resource.ok_or_else(|| missing("resource"))?,
            region: self.region.ok_or_else(|| missing("region"))?,
            agent: self.agent.ok_or_else(|| missing("agent"))?,
            epoch: self.epoch.ok_or_else(|| missing("epoch"))?,
            seq: self.seq.ok_or_else(|| missing("seq"))?,
            window_start: self.window_start.ok_or_else(|| missing("window_start"))?,
            window_secs: self.window_secs.ok_or_else(|| missing("window_secs"))?,
            want: self.want.ok_or_else(|| missing("want"))?,
            demand_per_sec: self.demand_per_sec.ok_or_else(|| missing("demand_per_sec"))?,
            window_sel: self.window_sel.ok_or_else(|| missing("window_sel"))?,
            tokens: self.tokens.ok_or_else(|| missing("tokens"))?,
            issued_at: self.issued_at.ok_or_else(|| missing("issued_at"))?,
            expires_at: self.expires_at.ok_or_else(|| missing("expires_at"))?,
            policy_version: self.policy_version.ok_or_else(|| missing("policy_version"))?,
            fallback_allowance: self.fallback_allowance.ok_or_else(|| missing("fallback_allowance"))?,
            fail_mode: self.fail_mode.ok_or_else(|| missing("fail_mode"))?,
            pool_limit: self.pool_limit.ok_or_else(|| missing("pool_limit"))?,
            pool_granted: self.pool_granted.ok_or_else(|| missing("pool_granted"))?,
            pool_available: self.pool_available.ok_or_else(|| missing("pool_available"))?,
            retry_after_ms: self.retry_after_ms,
            unspent: self.unspent,
            returned: self.returned,
            released_at: self.released_at,
            per_key_rate_milli: self.per_key_rate_milli,
            per_key_burst: self.per_key_burst,
            enforce: self.enforce.ok_or_else(|| missing("enforce"))?,
        })
    }
}

/// One grant statement, with the database instant it decided at. Its span
/// carries the lease id once the lease is written (or replayed).
#[tracing::instrument(name = "grant", skip_all, fields(
    tenant = %req.tenant, resource = %req.resource, region = %req.region, agent = %req.agent,
    epoch = req.epoch, seq = req.seq, lease_id = tracing::field::Empty,
))]
async fn try_grant(state: &AppState, req: &GrantRequest) -> Result<(Outcome, DateTime<Utc>)> {
    let who = || format!("{}/{}", req.region, req.agent);
    // No BEGIN: one statement in autocommit is its own transaction, and a
    // request dropped mid-statement leaves nothing open (see crate::tx).
    let row = sqlx::query_file_as!(
        GrantRow,
        "src/sql/grant.sql",
        Uuid::new_v4(),
        req.tenant,
        req.resource,
        req.region,
        req.agent,
        req.epoch,
        req.seq,
        req.want,
        req.demand_per_sec,
        req.window.unwrap_or_default().as_str(),
        state.db_clock.shift_us()
    )
    .fetch_one(&state.db)
    .await
    .map_err(crate::error::on_constraint("lease_idempotency_key", Error::KeyTaken))?;
    match row.outcome.as_str() {
        "granted" | "replayed" => {
            let now = row.now()?;
            let replayed = row.outcome == "replayed";
            let lease = row.lease_and_version()?;
            let (lease, v) = match lease {
                (lease, Some(v)) => (lease, v),
                (lease, None) => {
                    let v =
                        version_extras(state, &lease.tenant, &lease.resource, lease.policy_version).await?;
                    (lease, v)
                }
            };
            Span::current().record("lease_id", tracing::field::display(lease.lease_id));
            if replayed {
                return Ok((Outcome::Replayed(lease, v), now));
            }
            // Tenant, resource, region, epoch and lease id are the span's.
            tracing::debug!(tokens = lease.tokens, window_start = lease.window_start, "lease granted");
            Ok((Outcome::Granted(lease, v), now))
        }
        "unknown_agent" => Err(Error::UnknownAgent(who())),
        "stale_epoch" => Err(Error::StaleEpoch {
            who: who(),
            got: req.epoch,
            current: row.current_epoch.ok_or_else(|| missing("current_epoch"))?,
        }),
        "epoch_not_issued" => Err(Error::invalid(
            "epoch",
            format!(
                "epoch {} was never issued to {} (current {})",
                req.epoch,
                who(),
                row.current_epoch.ok_or_else(|| missing("current_epoch"))?
            ),
        )),
        "idempotency_mismatch" => {
            let lease_id = row.lease_id.ok_or_else(|| missing("lease_id"))?;
            Span::current().record("lease_id", tracing::field::display(lease_id));
            Err(Error::IdempotencyMismatch(format!(
                "grant key (region {}, agent {}, epoch {}, seq {}) was used for lease {} with a different body",
                req.region, req.agent, req.epoch, req.seq, lease_id
            )))
        }
        // The statement reads a concurrency policy as none (it is never
        // granted); telling the two apart costs a query on this miss only.
        "unknown_quota" => {
            let quota = format!("{}/{}", req.tenant, req.resource);
            let kind = sqlx::query_file_scalar!("src/sql/policy_kind.sql", req.tenant, req.resource)
                .fetch_optional(&state.db)
                .await?;
            match kind.as_deref().and_then(PolicyKind::parse) {
                Some(PolicyKind::Concurrency) => Err(Error::ConcurrencyPolicy(quota)),
                _ => Err(Error::UnknownQuota(quota)),
            }
        }
        "next_too_early" => Err(Error::invalid(
            "window",
            format!(
                "\"next\" is allowed only within the last lease_ttl_secs of a window, from {}",
                row.opens_at.ok_or_else(|| missing("opens_at"))?
            ),
        )),
        other => Err(Error::Internal(format!("quota_grant answered an unknown outcome {other:?}").into())),
    }
}
