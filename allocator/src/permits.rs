//! Permit leases of concurrency quotas (a global semaphore).
//!
//! A concurrency policy allows `max_in_flight` permits held at once across
//! every region. The allocator does not see single permits: each region
//! holds a *permit lease* (`permit_lease`, one row per quota and region),
//! a number of permits its agents hand out locally, set by
//! `POST /v1/permits/lease` to what the region wants, up to what the other
//! regions' live leases leave ([`permit_held`]). A lease lives
//! [`permit_lease_secs`] from its last applied request (never less than it
//! had left: a TTL lowered while permits are out does not shorten the
//! lease they were handed out under); once expired its permits count as
//! returned, whatever the row still says, so a region that vanishes
//! strands them for at most that long.
//!
//! The replicas of a region share its lease: a request names the lease's
//! `seq` as the region last applied it and is applied only if the lease is
//! still at it (compare-and-set). Otherwise nothing changes and the answer
//! is the lease as it is (`conflict: true`), for the agent to adopt. This
//! also makes a request safe to send again (across a PostgreSQL failover):
//! one applied before its answer was lost is answered as a conflict with
//! the lease it made.
//!
//! Each request is one transaction that locks the policy row (serialising
//! the quota's lease requests and its policy writes) and decides on the
//! database's clock (I8). A change of what the region holds is a
//! `permit_lease` ledger event.

use crate::agents;
use crate::error::{Error, Result};
use crate::http::auth::AgentScope;
use crate::http::extract::{check_count, check_id, ApiJson, ApiPath};
use crate::ledger::{self, Kind, NewEvent};
use crate::policies::{DEFAULT_PERMIT_TTL_SECS, MAX_IN_FLIGHT};
use crate::state::AppState;
use axum::extract::State;
use axum::Json;
use chrono::{DateTime, Utc};
use quota_shared::wire::{
    permit_lease_secs, ErrorBody, FailMode, PermitLease, PermitLeaseRequest, PermitRegion, PermitView,
    PolicyKind,
};

/// Permits a region holds after asking for `want`, holding `current` (0
/// when its lease expired), while the other regions' live leases hold
/// `others`: less than it holds is granted at once (the rest return);
/// more is granted up to what the others leave, never taking back what it
/// already holds, so a lowered `max_in_flight` takes effect as regions
/// shrink. Never negative.
pub fn permit_held(max_in_flight: i64, others: i64, current: i64, want: i64) -> i64 {
    let held =
        if want <= current { want } else { want.min(current.max(max_in_flight.saturating_sub(others))) };
    held.max(0)
}

/// A region's lease as the database holds it, read at `now`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mine {
    /// Permits it holds now: 0 once expired.
    pub held: i64,
    pub seq: i64,
    /// What is left of its life (ms), 0 once expired.
    pub remaining_ms: i64,
    /// The longest permit TTL it was renewed under (s), 0 once expired.
    pub ttl_secs: i64,
}

/// What a lease request decides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    /// Permits held after the request.
    pub held: i64,
    /// The lease's sequence number after the request.
    pub seq: i64,
    /// The lease's remaining life (ms) after the request.
    pub lease_ms: i64,
    /// The longest TTL a permit handed out under the lease may have (s).
    pub longest_ttl_secs: i64,
    /// `true`: the request's `seq` was not the lease's; nothing changes.
    pub conflict: bool,
}

/// Decides a request for `want` at `req_seq` against the region's lease
/// (`None`: no row, seq 0), the others' live permits and the policy
/// (`max_in_flight`, its permit TTL `ttl_secs`); an applied request renews
/// the lease for `full_ms`, or keeps what it had left when that is longer.
pub fn decide(
    max_in_flight: i64,
    ttl_secs: i64,
    others: i64,
    mine: Option<Mine>,
    req_seq: i64,
    want: i64,
    full_ms: i64,
) -> Decision {
    let mine = mine.unwrap_or(Mine { held: 0, seq: 0, remaining_ms: 0, ttl_secs: 0 });
    let longest_ttl_secs = mine.ttl_secs.max(ttl_secs);
    if mine.seq != req_seq {
        return Decision {
            held: mine.held,
            seq: mine.seq,
            lease_ms: mine.remaining_ms,
            longest_ttl_secs,
            conflict: true,
        };
    }
    Decision {
        held: permit_held(max_in_flight, others, mine.held, want),
        seq: mine.seq + 1,
        lease_ms: full_ms.max(mine.remaining_ms),
        longest_ttl_secs,
        conflict: false,
    }
}

/// One row of `permit_lease`.
struct PermitRow {
    region: String,
    held: i64,
    seq: i64,
    expires_at: DateTime<Utc>,
    ttl_secs: i32,
    updated_at: DateTime<Utc>,
}

impl PermitRow {
    /// Whether the lease is still live at `now`.
    fn live(&self, now: DateTime<Utc>) -> bool {
        self.expires_at > now
    }

    /// Permits it holds at `now`.
    fn held_at(&self, now: DateTime<Utc>) -> i64 {
        if self.live(now) {
            self.held
        } else {
            0
        }
    }
}

/// The policy columns the permit paths read (`permit_policy.sql`, and
/// `permit_policy_lock.sql` with the row locked).
struct PolicyCols {
    kind: String,
    limit_tokens: i64,
    permit_ttl_secs: Option<i32>,
    fail_mode: String,
    version: i64,
}

/// A concurrency quota's policy as the permit paths read it.
struct Semaphore {
    max_in_flight: i64,
    permit_ttl_secs: i64,
    fail_mode: FailMode,
    version: i64,
}

impl Semaphore {
    /// From the policy row of quota `tenant/resource`, if any: 404
    /// `unknown_quota` without one, 409 `rate_policy` for a rate quota.
    fn of(tenant: &str, resource: &str, row: Option<PolicyCols>) -> Result<Semaphore> {
        let quota = || format!("{tenant}/{resource}");
        let pol = row.ok_or_else(|| Error::UnknownQuota(quota()))?;
        match PolicyKind::parse(&pol.kind).unwrap_or_default() {
            PolicyKind::Rate => Err(Error::RatePolicy(quota())),
            PolicyKind::Concurrency => Ok(Semaphore {
                max_in_flight: pol.limit_tokens,
                permit_ttl_secs: pol.permit_ttl_secs.map_or(DEFAULT_PERMIT_TTL_SECS, i64::from),
                fail_mode: FailMode::parse(&pol.fail_mode).unwrap_or(FailMode::Strict),
                version: pol.version,
            }),
        }
    }

    /// The full life of a lease (ms) after an applied request.
    fn lease_ms(&self) -> i64 {
        permit_lease_secs(self.permit_ttl_secs) * 1000
    }
}

fn validate(req: &PermitLeaseRequest) -> Result<()> {
    check_id("tenant", &req.tenant)?;
    check_id("resource", &req.resource)?;
    check_id("region", &req.region)?;
    check_id("agent", &req.agent)?;
    check_count("epoch", req.epoch, 1)?;
    check_count("seq", req.seq, 0)?;
    if !(0..=MAX_IN_FLIGHT).contains(&req.want) {
        return Err(Error::invalid(
            "want",
            format!("must be between 0 and {MAX_IN_FLIGHT}, got {}", req.want),
        ));
    }
    Ok(())
}

/// `POST /v1/permits/lease`: set the permits a region holds for a
/// concurrency quota (compare-and-set on the lease's `seq`).
#[utoipa::path(
    post,
    path = "/v1/permits/lease",
    request_body = PermitLeaseRequest,
    responses(
        (status = 200, description = "The region's lease: applied (renewed for permit_ttl_secs + max(30 s, permit_ttl_secs / 20), never shortened), or with conflict: true the lease as it is, unchanged, when seq was not the lease's", body = PermitLease),
        (status = 401, description = "Missing or wrong agent token", body = ErrorBody),
        (status = 403, description = "wrong_region: the credential acts only for another region", body = ErrorBody),
        (status = 404, description = "Unknown quota or agent", body = ErrorBody),
        (status = 409, description = "stale_epoch, or rate_policy (the quota is a rate policy: it has no permits)", body = ErrorBody),
        (status = 422, description = "Invalid value; the message and `field` name the field (an epoch never issued names `epoch`)", body = ErrorBody),
    ),
    security(("agent_token" = [])),
    tag = "agents"
)]
pub(crate) async fn lease(
    State(state): State<AppState>,
    scope: AgentScope,
    ApiJson(req): ApiJson<PermitLeaseRequest>,
) -> Result<Json<PermitLease>> {
    validate(&req)?;
    let outcome = match scope.check(&req.region) {
        // Safe to send again: an attempt that committed before its answer
        // was lost is answered as a conflict carrying the lease it made.
        Ok(()) => crate::tx::retry_failover("permit_lease", || apply(&state, &req)).await,
        Err(e) => Err(e),
    };
    match outcome {
        Ok(lease) => {
            let outcome = if lease.conflict { "conflict" } else { "applied" };
            state.metrics.inc("allocator_permit_leases_total", &[("outcome", outcome)]);
            Ok(Json(lease))
        }
        Err(e) => {
            state.metrics.inc("allocator_permit_leases_total", &[("outcome", e.code())]);
            let event = NewEvent {
                tenant: Some(req.tenant.clone()),
                resource: Some(req.resource.clone()),
                region: Some(req.region.clone()),
                agent: Some(req.agent.clone()),
                epoch: Some(req.epoch),
                seq: Some(req.seq),
                ..Default::default()
            };
            agents::record_refusal(&state, &e, event).await?;
            Err(e)
        }
    }
}

/// The lease transaction.
#[tracing::instrument(name = "permit_lease", skip_all, fields(
    tenant = %req.tenant, resource = %req.resource, region = %req.region, agent = %req.agent,
    epoch = req.epoch, seq = req.seq, want = req.want,
))]
async fn apply(state: &AppState, req: &PermitLeaseRequest) -> Result<PermitLease> {
    let mut tx = crate::tx::begin(&state.db).await?;
    agents::fence(&mut tx, &req.region, &req.agent, req.epoch).await?;
    let row = sqlx::query_file_as!(PolicyCols, "src/sql/permit_policy_lock.sql", req.tenant, req.resource)
        .fetch_optional(&mut *tx)
        .await?;
    let sem = Semaphore::of(&req.tenant, &req.resource, row)?;
    // After the lock, so the decision is made on the clock as it is now (I8).
    let now = state.db_clock.now(&mut tx).await?;
    let rows = sqlx::query_file_as!(PermitRow, "src/sql/permit_rows.sql", req.tenant, req.resource)
        .fetch_all(&mut *tx)
        .await?;
    let others: i64 = rows.iter().filter(|r| r.region != req.region).map(|r| r.held_at(now)).sum();
    let mine = rows.iter().find(|r| r.region == req.region).map(|r| Mine {
        held: r.held_at(now),
        seq: r.seq,
        remaining_ms: if r.live(now) { (r.expires_at - now).num_milliseconds().max(0) } else { 0 },
        ttl_secs: if r.live(now) { i64::from(r.ttl_secs) } else { 0 },
    });
    let before = mine.map_or(0, |m| m.held);
    let d = decide(sem.max_in_flight, sem.permit_ttl_secs, others, mine, req.seq, req.want, sem.lease_ms());
    if !d.conflict {
        let expires_at = now + chrono::Duration::milliseconds(d.lease_ms);
        sqlx::query_file!(
            "src/sql/permit_upsert.sql",
            req.tenant,
            req.resource,
            req.region,
            d.held,
            d.seq,
            expires_at,
            i32::try_from(d.longest_ttl_secs).unwrap_or(i32::MAX),
            now
        )
        .execute(&mut *tx)
        .await?;
        if d.held != before {
            let event = NewEvent {
                tenant: Some(req.tenant.clone()),
                resource: Some(req.resource.clone()),
                region: Some(req.region.clone()),
                agent: Some(req.agent.clone()),
                epoch: Some(req.epoch),
                seq: Some(d.seq),
                tokens: Some(d.held),
                detail: Some(serde_json::json!({
                    "held_before": before,
                    "held": d.held,
                    "want": req.want,
                    "others": others,
                    "max_in_flight": sem.max_in_flight,
                    "expires_at": expires_at,
                    "policy_version": sem.version,
                })),
                ..Default::default()
            };
            ledger::append(&mut tx, now, Kind::PermitLease, event).await?;
        }
    }
    tx.commit().await?;
    tracing::debug!(held = d.held, lease_seq = d.seq, conflict = d.conflict, others, "permit lease");
    Ok(PermitLease {
        tenant: req.tenant.clone(),
        resource: req.resource.clone(),
        region: req.region.clone(),
        seq: d.seq,
        held: d.held,
        lease_ms: d.lease_ms,
        conflict: d.conflict,
        max_in_flight: sem.max_in_flight,
        permit_ttl_secs: sem.permit_ttl_secs,
        longest_ttl_secs: d.longest_ttl_secs,
        fail_mode: sem.fail_mode,
        version: sem.version,
    })
}

/// `GET /v1/permits/{tenant}/{resource}`: where a concurrency quota's
/// permits are.
#[utoipa::path(
    get,
    path = "/v1/permits/{tenant}/{resource}",
    params(("tenant" = String, Path), ("resource" = String, Path)),
    responses(
        (status = 200, description = "Every region's permit lease (held 0 once expired) and the live total", body = PermitView),
        (status = 401, description = "Missing or wrong admin token", body = ErrorBody),
        (status = 404, description = "Unknown quota", body = ErrorBody),
        (status = 409, description = "rate_policy: the quota is a rate policy (it has no permits)", body = ErrorBody),
        (status = 422, description = "Invalid identifier", body = ErrorBody),
    ),
    security(("admin_token" = [])),
    tag = "operator"
)]
pub(crate) async fn view(
    State(state): State<AppState>,
    ApiPath((tenant, resource)): ApiPath<(String, String)>,
) -> Result<Json<PermitView>> {
    check_id("tenant", &tenant)?;
    check_id("resource", &resource)?;
    let mut conn = state.db.acquire().await?;
    let row = sqlx::query_file_as!(PolicyCols, "src/sql/permit_policy.sql", tenant, resource)
        .fetch_optional(&mut *conn)
        .await?;
    let sem = Semaphore::of(&tenant, &resource, row)?;
    let now = state.db_clock.now(&mut conn).await?;
    let rows = sqlx::query_file_as!(PermitRow, "src/sql/permit_rows.sql", tenant, resource)
        .fetch_all(&mut *conn)
        .await?;
    let regions: Vec<PermitRegion> = rows
        .iter()
        .map(|r| PermitRegion {
            region: r.region.clone(),
            held: r.held_at(now),
            seq: r.seq,
            expires_at: r.expires_at,
            updated_at: r.updated_at,
        })
        .collect();
    Ok(Json(PermitView {
        held: regions.iter().map(|r| r.held).sum(),
        regions,
        tenant,
        resource,
        max_in_flight: sem.max_in_flight,
        permit_ttl_secs: sem.permit_ttl_secs,
        version: sem.version,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_region_gets_up_to_what_the_others_leave() {
        // max 3: A holds 2, B wants 2 and gets 1.
        assert_eq!(permit_held(3, 0, 0, 2), 2);
        assert_eq!(permit_held(3, 2, 0, 2), 1);
        // Nothing left: nothing more, but what it holds stays.
        assert_eq!(permit_held(3, 3, 0, 2), 0);
        assert_eq!(permit_held(3, 1, 2, 5), 2);
        // Growing from what it holds up to the room left.
        assert_eq!(permit_held(10, 4, 3, 8), 6);
        assert_eq!(permit_held(10, 0, 3, 8), 8);
    }

    #[test]
    fn shrinking_is_granted_at_once_and_never_negative() {
        assert_eq!(permit_held(3, 0, 3, 1), 1);
        assert_eq!(permit_held(3, 0, 3, 0), 0);
        assert_eq!(permit_held(3, 3, 2, 2), 2);
        assert_eq!(permit_held(3, 0, 0, -4), 0);
    }

    #[test]
    fn a_lowered_limit_takes_effect_as_regions_shrink() {
        // max lowered to 2 while A holds 3 and B holds 1: nobody grows, A
        // keeps what it has until it asks for less.
        assert_eq!(permit_held(2, 1, 3, 4), 3);
        assert_eq!(permit_held(2, 3, 1, 2), 1);
        assert_eq!(permit_held(2, 1, 3, 1), 1);
        // Once A is down to 1, B may have 1 (2 − 1), not more.
        assert_eq!(permit_held(2, 1, 0, 2), 1);
        // The others holding more than the limit leaves nothing to take.
        assert_eq!(permit_held(2, i64::MAX, 0, 2), 0);
    }

    #[test]
    fn a_request_at_the_leases_seq_is_applied_and_renews_it() {
        let d = decide(3, 60, 2, None, 0, 2, 90_000);
        assert_eq!(d, Decision { held: 1, seq: 1, lease_ms: 90_000, longest_ttl_secs: 60, conflict: false });
        let mine = Mine { held: 1, seq: 1, remaining_ms: 40_000, ttl_secs: 60 };
        let d = decide(3, 60, 0, Some(mine), 1, 3, 90_000);
        assert_eq!(d, Decision { held: 3, seq: 2, lease_ms: 90_000, longest_ttl_secs: 60, conflict: false });
        // An expired lease counts 0 held but keeps its seq.
        let expired = Mine { held: 0, seq: 7, remaining_ms: 0, ttl_secs: 0 };
        assert_eq!(decide(3, 60, 0, Some(expired), 7, 2, 90_000).seq, 8);
    }

    #[test]
    fn a_lowered_ttl_neither_shortens_a_live_lease_nor_forgets_the_longer_ttl() {
        // Renewed under TTL 600 s (lease 630 s), then the TTL is lowered to
        // 10 s: a permit handed out just before may live 600 s more.
        let mine = Mine { held: 2, seq: 3, remaining_ms: 620_000, ttl_secs: 600 };
        let d = decide(3, 10, 0, Some(mine), 3, 2, 40_000);
        assert_eq!((d.lease_ms, d.longest_ttl_secs, d.conflict), (620_000, 600, false));
        // Once it expired, the new TTL alone counts.
        let gone = Mine { held: 0, seq: 4, remaining_ms: 0, ttl_secs: 0 };
        assert_eq!(decide(3, 10, 0, Some(gone), 4, 1, 40_000).longest_ttl_secs, 10);
    }

    #[test]
    fn a_request_at_another_seq_changes_nothing() {
        let mine = Mine { held: 2, seq: 4, remaining_ms: 12_345, ttl_secs: 60 };
        for seq in [0, 3, 5] {
            let d = decide(3, 60, 0, Some(mine), seq, 1, 90_000);
            assert_eq!(
                d,
                Decision { held: 2, seq: 4, lease_ms: 12_345, longest_ttl_secs: 60, conflict: true },
                "{seq}"
            );
        }
        // No lease: only seq 0 applies.
        assert_eq!(
            decide(3, 60, 0, None, 2, 1, 90_000),
            Decision { held: 0, seq: 0, lease_ms: 0, longest_ttl_secs: 60, conflict: true }
        );
    }
}
