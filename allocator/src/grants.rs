//! `POST /v1/grants`: the grant transaction.
//!
//! In one transaction: fence the epoch (I4), look the idempotency key up
//! (I3), lock the pool row and keep its limit current (I1, I9), compute the
//! demand-weighted share, insert the lease clamped to its window (I2), update
//! the pool and append the ledger event. The pool row lock, not a leader,
//! makes concurrent grants from any number of allocator replicas safe.

use crate::agents;
use crate::error::on_constraint;
use crate::error::{Error, Result};
use crate::http::auth::AgentScope;
use crate::http::extract::{check_count, check_id, ApiJson};
use crate::leases::LeaseRow;
use crate::ledger::{self, Kind, NewEvent};
use crate::policies;
use crate::share::{self, OtherRegion, ShareInput};
use crate::state::AppState;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue};
use axum::Json;
use chrono::{DateTime, Duration, Utc};
use quota_shared::window::Window;
use quota_shared::wire::{ErrorBody, GrantRequest, GrantResponse, WindowSel};
use sqlx::PgConnection;
use std::time::Instant;
use tracing::Span;
use uuid::Uuid;

/// Largest demand accepted, tokens per second.
pub(crate) const MAX_DEMAND_PER_SEC: f64 = 1e12;

/// The longest `retry_after_ms` suggested when a pool is empty.
const MAX_RETRY_AFTER_MS: i64 = 60_000;

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

/// The outcome of one grant attempt.
enum Outcome {
    Granted(LeaseRow),
    Replayed(LeaseRow),
}

/// `POST /v1/grants`: a lease, or a replay of one (I1–I4).
#[utoipa::path(
    post,
    path = "/v1/grants",
    request_body = GrantRequest,
    responses(
        (status = 200, description = "The lease (tokens may be 0 with retry_after_ms); a replay carries Idempotent-Replayed: true", body = GrantResponse),
        (status = 401, description = "Missing or wrong agent token", body = ErrorBody),
        (status = 403, description = "wrong_region: the credential acts only for another region", body = ErrorBody),
        (status = 404, description = "Unknown quota or agent", body = ErrorBody),
        (status = 409, description = "stale_epoch or idempotency_mismatch", body = ErrorBody),
        (status = 422, description = "Invalid value; the message names the field", body = ErrorBody),
    ),
    security(("agent_token" = [])),
    tag = "agents"
)]
pub(crate) async fn grant(
    State(state): State<AppState>,
    scope: AgentScope,
    ApiJson(req): ApiJson<GrantRequest>,
) -> Result<(HeaderMap, Json<GrantResponse>)> {
    validate(&req)?;
    if let Err(e) = scope.check(&req.region) {
        state.metrics.inc("allocator_grants_total", &[("outcome", e.code())]);
        agents::record_refusal(&state, &e, event_of(&req, None, None)).await?;
        return Err(e);
    }
    let started = Instant::now();
    let mut attempts = 0;
    // Two requests with one key racing on different pools both miss the
    // lookup; the loser hits the unique key and retries once to read the
    // winner's lease. Two attempts always suffice: the key then exists.
    let outcome = loop {
        attempts += 1;
        match try_grant(&state, &req).await {
            Err(Error::KeyTaken(_)) if attempts < 2 => continue,
            other => break other,
        }
    };
    let mut headers = HeaderMap::new();
    let result = match outcome {
        // `expires_in_ms` is counted from the database's instant read in the
        // grant transaction, after the agent sent the request: the agent's
        // deadline (send instant + expires_in_ms) can only fall before
        // `expires_at` (I2), whatever this replica's clock says.
        Ok((Outcome::Granted(row), now)) => {
            state.metrics.inc(
                "allocator_grants_total",
                &[("outcome", if row.tokens > 0 { "granted" } else { "empty" })],
            );
            state.metrics.inc_by("allocator_granted_tokens_total", &[], row.tokens as f64);
            Ok(row.to_grant_response(now))
        }
        Ok((Outcome::Replayed(row), now)) => {
            state.metrics.inc("allocator_grants_total", &[("outcome", "replayed")]);
            headers.insert("idempotent-replayed", HeaderValue::from_static("true"));
            Ok(row.to_grant_response(now))
        }
        Err(e) => {
            state.metrics.inc("allocator_grants_total", &[("outcome", e.code())]);
            agents::record_refusal(&state, &e, event_of(&req, None, None)).await?;
            Err(e)
        }
    };
    state.metrics.observe("allocator_grant_seconds", &[], started.elapsed().as_secs_f64());
    Ok((headers, Json(result?)))
}

fn event_of(req: &GrantRequest, lease_id: Option<Uuid>, tokens: Option<i64>) -> NewEvent {
    NewEvent {
        tenant: Some(req.tenant.clone()),
        resource: Some(req.resource.clone()),
        region: Some(req.region.clone()),
        agent: Some(req.agent.clone()),
        epoch: Some(req.epoch),
        seq: Some(req.seq),
        lease_id,
        tokens,
        ..Default::default()
    }
}

/// Whether a stored lease was granted for exactly this request body.
fn same_body(row: &LeaseRow, req: &GrantRequest) -> bool {
    row.tenant == req.tenant
        && row.resource == req.resource
        && row.want == req.want
        && row.demand_per_sec == req.demand_per_sec
        && row.window_sel == req.window.unwrap_or_default().as_str()
}

/// The grant transaction, with the database instant it decided at. Its
/// span carries the lease id once the lease is written (or replayed).
#[tracing::instrument(name = "grant", skip_all, fields(
    tenant = %req.tenant, resource = %req.resource, region = %req.region, agent = %req.agent,
    epoch = req.epoch, seq = req.seq, lease_id = tracing::field::Empty,
))]
async fn try_grant(state: &AppState, req: &GrantRequest) -> Result<(Outcome, DateTime<Utc>)> {
    let mut tx = crate::tx::begin(&state.db).await?;
    agents::fence(&mut tx, &req.region, &req.agent, req.epoch).await?;
    // Read after the fence (which may wait on a registration's row lock), so
    // the window is decided as late as possible on the one clock (I8).
    let now = state.db_clock.now(&mut tx).await?;

    let existing =
        sqlx::query_file_as!(LeaseRow, "src/sql/lease_by_key.sql", req.region, req.agent, req.epoch, req.seq)
            .fetch_optional(&mut *tx)
            .await?;
    if let Some(row) = existing {
        Span::current().record("lease_id", tracing::field::display(row.lease_id));
        if !same_body(&row, req) {
            return Err(Error::IdempotencyMismatch(format!(
                "grant key (region {}, agent {}, epoch {}, seq {}) was used for lease {} with a different body",
                req.region, req.agent, req.epoch, req.seq, row.lease_id
            )));
        }
        ledger::append(&mut tx, now, Kind::Replayed, event_of(req, Some(row.lease_id), Some(row.tokens)))
            .await?;
        tx.commit().await?;
        return Ok((Outcome::Replayed(row), now));
    }

    let policy = policies::require(&mut tx, &req.tenant, &req.resource).await?;
    let current = Window::containing(now, policy.window_secs);
    let window = match req.window.unwrap_or_default() {
        WindowSel::Current => current,
        WindowSel::Next => {
            let opens_at = current.end_at() - Duration::seconds(policy.lease_ttl_secs);
            if now < opens_at {
                return Err(Error::invalid(
                    "window",
                    format!("\"next\" is allowed only within the last lease_ttl_secs of a window, from {opens_at}"),
                ));
            }
            current.next()
        }
    };
    // The `granted` ledger event is appended by the lease insert itself.
    let row = grant_in_window(&mut tx, req, &policy, window, now).await?;
    Span::current().record("lease_id", tracing::field::display(row.lease_id));
    tx.commit().await?;
    // Tenant, resource, region, epoch and lease id are the span's.
    tracing::debug!(tokens = row.tokens, window_start = window.start, "lease granted");
    Ok((Outcome::Granted(row), now))
}

/// The pool part of the transaction: lock, share, then insert the lease,
/// debit the pool and append the ledger event in one statement.
#[tracing::instrument(level = "debug", skip_all, fields(window_start = window.start, window_secs = window.secs))]
async fn grant_in_window(
    conn: &mut PgConnection,
    req: &GrantRequest,
    policy: &policies::PolicyRow,
    window: Window,
    now: DateTime<Utc>,
) -> Result<LeaseRow> {
    let pool_key = (&req.tenant, &req.resource, window.start, window.secs);
    let pool = sqlx::query_file!(
        "src/sql/pool_lock.sql",
        pool_key.0,
        pool_key.1,
        pool_key.2,
        pool_key.3,
        policy.limit_tokens,
        policy.fallback_allowance(),
        now
    )
    .fetch_one(&mut *conn)
    .await?;
    let (granted, returned, owed) = (pool.granted, pool.returned, pool.fallback_owed);
    let region = sqlx::query_file!(
        "src/sql/pool_region_demand.sql",
        pool_key.0,
        pool_key.1,
        pool_key.2,
        pool_key.3,
        req.region,
        req.demand_per_sec,
        req.want,
        now
    )
    .fetch_one(&mut *conn)
    .await?;
    let (region_granted, region_returned) = (region.granted, region.returned);
    let active_since = now - Duration::seconds(policy.lease_ttl_secs.max(1));
    let others = sqlx::query_file_as!(
        OtherRegion,
        "src/sql/pool_region_others.sql",
        pool_key.0,
        pool_key.1,
        pool_key.2,
        pool_key.3,
        req.region,
        active_since
    )
    .fetch_all(&mut *conn)
    .await?;
    let available = share::available(policy.limit_tokens, granted, returned, owed);
    let tokens = share::tokens(&ShareInput {
        want: req.want,
        demand_per_sec: req.demand_per_sec,
        chunk_min: policy.chunk_min,
        chunk_max: policy.chunk_max,
        limit: policy.limit_tokens,
        available,
        region_holding: region_granted - region_returned,
        others: &others,
    });
    // A lease's life starts when its window opens: a lease prefetched for the
    // next window would otherwise expire before that window ends and strand
    // its tokens. Either way it never outlives its window (I2).
    let life_from = now.max(window.start_at());
    let expires_at = (life_from + Duration::seconds(policy.lease_ttl_secs)).min(window.end_at());
    let retry_after_ms = (tokens == 0).then(|| window.ms_until_end(now).clamp(1, MAX_RETRY_AFTER_MS));
    let pool_granted = granted + tokens;
    let pool_available = share::available(policy.limit_tokens, pool_granted, returned, owed);
    // The binds in the order of lease_insert.sql's column list.
    let row = sqlx::query_file_as!(
        LeaseRow,
        "src/sql/lease_insert.sql",
        Uuid::new_v4(),                          // $1 lease_id
        req.tenant,                              // $2 tenant
        req.resource,                            // $3 resource
        req.region,                              // $4 region
        req.agent,                               // $5 agent
        req.epoch,                               // $6 epoch
        req.seq,                                 // $7 seq
        window.start,                            // $8 window_start
        window.secs,                             // $9 window_secs
        req.want,                                // $10 want
        req.demand_per_sec,                      // $11 demand_per_sec
        req.window.unwrap_or_default().as_str(), // $12 window_sel
        tokens,                                  // $13 tokens
        now,                                     // $14 issued_at
        expires_at,                              // $15 expires_at
        policy.version,                          // $16 policy_version
        policy.fallback_allowance(),             // $17 fallback_allowance
        policy.fail_mode,                        // $18 fail_mode
        policy.limit_tokens,                     // $19 pool_limit
        pool_granted,                            // $20 pool_granted
        pool_available,                          // $21 pool_available
        retry_after_ms,                          // $22 retry_after_ms
        policy.per_key_rate_milli,               // $23 per_key_rate_milli
        policy.per_key_burst,                    // $24 per_key_burst
        policy.enforce                           // $25 enforce
    )
    .fetch_one(&mut *conn)
    .await
    .map_err(on_constraint("lease_idempotency_key", Error::KeyTaken))?;
    Ok(row)
}
