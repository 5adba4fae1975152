//! The region's permit lease at the allocator: one call that moves it
//! (grow, give back, renew) and applies the answer to the region's Redis,
//! the hand-out and return of one permit around it, and the task that
//! gives idle permits back and keeps the leases of held ones renewed.

use super::rule::{self, Goal};
use super::{PermitPolicy, PermitQuota, Permits};
use crate::client::CallError;
use crate::error::{Error, Result};
use crate::scripts::{self, PermitPlan, PermitReturn, PermitSynced, PermitTake};
use quota_shared::wire::{PermitLease, PermitLeaseRequest};
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// How often the maintenance task looks at every known quota.
const TICK: Duration = Duration::from_secs(2);

/// Hand-out attempts of one acquire (each lease call in between may lose
/// a race to another replica).
const TRIES: usize = 4;

/// How long one replica may hold the region's lock on a lost or new
/// permit state while it syncs with the allocator.
const LOST_LOCK_MS: u64 = 5_000;

/// Lease calls the maintenance task makes at once.
const TIDY_PARALLEL: usize = 8;

/// A refusal's `Retry-After` hint: permits come back when released, which
/// nothing predicts; a second (plus the answer's jitter) is a polite poll.
const RETRY_MS: i64 = 1000;

/// A permit handed out.
#[derive(Debug, Clone)]
pub struct Taken {
    pub permit_id: String,
    pub expires_in_ms: i64,
    /// More permits the region's lease holds that are not handed out.
    pub left: i64,
    pub policy: PermitPolicy,
}

fn store_err(_: crate::store::StoreError) -> Error {
    Error::StoreUnavailable
}

impl Permits {
    /// One lease call for `q` toward `goal`, applied to the region's
    /// Redis, with the number of permits it asked for. `Ok(None)`: no call
    /// was due. The region's cap falls before the allocator hears of it
    /// and rises only after the allocator granted (see `lua/permit.lua`).
    pub async fn call(&self, q: &PermitQuota, goal: Goal) -> Result<Option<(PermitLease, i64)>> {
        let _one = q.calling.lock().await;
        let mut plan = scripts::permit_plan(&self.store, &q.prefix, None).await.map_err(store_err)?;
        // A lost (or never written) state is synced by one replica of the
        // region at a time: two syncing at once would each see the other's
        // fresh lease as one this region forgot. The others wait (polling,
        // bounded by the lock's life) for the state it writes.
        let mut locked = false;
        let deadline = std::time::Instant::now() + Duration::from_millis(LOST_LOCK_MS);
        while plan.state.is_none() && !locked {
            locked = crate::commands::take_renew_lock(&self.store, &q.prefix, &self.agent, LOST_LOCK_MS)
                .await
                .map_err(store_err)?;
            if !locked {
                if std::time::Instant::now() >= deadline {
                    return Err(Error::StoreUnavailable);
                }
                // Another replica's sync is under way: its result, soon.
                tokio::time::sleep(Duration::from_millis(100)).await;
                plan = scripts::permit_plan(&self.store, &q.prefix, None).await.map_err(store_err)?;
            }
        }
        let r = self.call_from(q, goal, plan).await;
        if locked {
            let _ = scripts::unlock(&self.store, &q.prefix, &self.agent).await;
        }
        r
    }

    async fn call_from(
        &self,
        q: &PermitQuota,
        goal: Goal,
        plan: PermitPlan,
    ) -> Result<Option<(PermitLease, i64)>> {
        let ttl_ms = q.policy().map_or(0, |p| p.ttl_ms);
        let (seq, want, lost, origin) = match plan.state {
            // Lost, or never written: ask as a region that knows of no
            // lease. If the allocator holds one for it, the answer is a
            // conflict showing it, and hand-outs stop until what the lost
            // state handed out has expired.
            None => (0, i64::from(goal == Goal::Grow), true, plan.now_ms),
            Some(s) if s.blocked_in_ms > 0 && goal == Goal::Tidy => return Ok(None),
            Some(s) => match rule::want(goal, s.cap, s.live, s.lease_in_ms, ttl_ms) {
                None => return Ok(None),
                Some(w) if w < s.cap => {
                    let lowered =
                        scripts::permit_plan(&self.store, &q.prefix, Some(w)).await.map_err(store_err)?;
                    let l = lowered.state.ok_or(Error::StoreUnavailable)?;
                    (l.seq, l.cap, false, lowered.now_ms)
                }
                Some(w) => (s.seq, w, false, plan.now_ms),
            },
        };
        let epoch = self.ident.epoch();
        if epoch == 0 {
            return Err(Error::AllocatorUnreachable);
        }
        let req = PermitLeaseRequest {
            tenant: q.tenant.clone(),
            resource: q.resource.clone(),
            region: self.region.clone(),
            agent: self.agent.clone(),
            epoch,
            seq,
            want,
        };
        let answer = match self.alloc.permit_lease(&req).await {
            Ok(a) => a,
            Err(e) => return Err(self.refused(q, &e, epoch)),
        };
        q.learn(&answer);
        // The lease's end on the region's clock, counted from before the
        // request left: however late this is applied, it cannot stretch.
        let exp_ms = origin + rule::trusted_ms(answer.lease_ms);
        let ttl_ms = answer.permit_ttl_secs.saturating_mul(1000);
        if lost || answer.conflict {
            // A conflict's answer is the allocator's lease as it is; if the
            // state is lost when it is applied (before the call planned, or
            // since), what the allocator holds for the region may be out in
            // clients' hands with no record here. (A region the allocator
            // holds no lease for, a first touch, gets its request applied:
            // nothing of it can be out.)
            let block = rule::answer_block_ms(
                answer.conflict,
                answer.held,
                answer.lease_ms,
                answer.longest_ttl_secs.saturating_mul(1000),
            );
            let force = answer.conflict && answer.seq < seq;
            let synced = scripts::permit_sync(
                &self.store,
                &q.prefix,
                answer.seq,
                answer.held,
                exp_ms,
                block,
                ttl_ms,
                force,
            )
            .await
            .map_err(store_err)?;
            if synced == PermitSynced::Blocked {
                self.metrics.inc("agent_permit_state_lost_total", &[]);
                tracing::warn!(tenant = %q.tenant, resource = %q.resource, held = answer.held, block_ms = block,
                    "the region's permit state was lost while the allocator held permits for it: \
                     no permit is handed out until the forgotten ones have expired");
            }
        } else {
            scripts::permit_apply(&self.store, &q.prefix, seq, answer.seq, answer.held, exp_ms, ttl_ms)
                .await
                .map_err(store_err)?;
        }
        self.metrics.inc(
            "agent_permit_lease_calls_total",
            &[("outcome", if answer.conflict { "conflict" } else { "applied" })],
        );
        Ok(Some((answer, want)))
    }

    /// What a failed lease call means for the request that needed it.
    fn refused(&self, q: &PermitQuota, e: &CallError, epoch: i64) -> Error {
        self.metrics.inc("agent_permit_lease_calls_total", &[("outcome", "failed")]);
        match e {
            CallError::Refused { status: 404, code, .. } if code == "unknown_quota" => {
                Error::UnknownQuota(format!("{}/{}", q.tenant, q.resource))
            }
            CallError::Refused { code, .. } if code == "stale_epoch" || code == "unknown_agent" => {
                if self.ident.epoch() == epoch {
                    self.ident.request_register();
                }
                Error::AllocatorUnreachable
            }
            CallError::Refused { status, code, message, .. } => {
                tracing::warn!(tenant = %q.tenant, resource = %q.resource, status, code, message, "permit lease refused");
                Error::AllocatorUnreachable
            }
            CallError::Unreachable(_) => Error::AllocatorUnreachable,
        }
    }

    /// Hands out one permit of `q` (the acquire's `key` as its holder),
    /// growing the region's lease by one when all it holds are out.
    pub async fn take(&self, q: &PermitQuota, holder: &str, request_id: Option<&str>) -> Result<Taken> {
        let id = super::new_id(&q.tenant, &q.resource, request_id);
        let limited = || Error::ConcurrencyLimited { resource: q.resource.clone(), retry_after_ms: RETRY_MS };
        for _ in 0..TRIES {
            let Some(p) = q.policy() else {
                // First hand-out this replica makes: the lease call learns
                // the policy.
                self.call(q, Goal::Grow).await.map_err(|e| self.refuse(e))?;
                continue;
            };
            match scripts::permit_take(&self.store, &q.prefix, &id, p.ttl_ms, holder)
                .await
                .map_err(store_err)?
            {
                PermitTake::Taken { expires_in_ms, left, dup } => {
                    let outcome = if dup { "replayed" } else { "granted" };
                    self.metrics.inc("agent_permit_decisions_total", &[("outcome", outcome)]);
                    return Ok(Taken { permit_id: id, expires_in_ms, left: left.max(0), policy: p });
                }
                PermitTake::Mismatch => {
                    return Err(self.refuse(Error::RequestIdMismatch(
                        "request_id was first used for a permit of another key".into(),
                    )));
                }
                PermitTake::Blocked { ms } => {
                    self.metrics.inc("agent_permit_decisions_total", &[("outcome", "blocked")]);
                    return Err(Error::ConcurrencyLimited {
                        resource: q.resource.clone(),
                        retry_after_ms: ms,
                    });
                }
                PermitTake::Lost => {
                    self.call(q, Goal::Grow).await.map_err(|e| self.refuse(e))?;
                }
                PermitTake::Full { .. } => match self.call(q, Goal::Grow).await {
                    // The allocator had none to spare: refused now, not
                    // after more calls that would find the same.
                    Ok(Some((a, want))) if !a.conflict && a.held < want => return Err(self.refuse(limited())),
                    Ok(_) => {}
                    // Cut off from the allocator with every permit out: the
                    // region may not hand out more (no fallback allowance).
                    Err(Error::AllocatorUnreachable) => return Err(self.refuse(limited())),
                    Err(e) => return Err(self.refuse(e)),
                },
                PermitTake::Lease { .. } => {
                    // Cut off long enough that the lease would end before a
                    // permit handed out now: 503 until the allocator answers.
                    self.call(q, Goal::Grow).await.map_err(|e| self.refuse(e))?;
                }
            }
        }
        Err(self.refuse(limited()))
    }

    fn refuse(&self, e: Error) -> Error {
        let outcome = if matches!(e, Error::ConcurrencyLimited { .. }) { "refused" } else { e.code() };
        self.metrics.inc("agent_permit_decisions_total", &[("outcome", outcome)]);
        e
    }

    /// Releases permit `id` (`renew`: extends it instead by its TTL, never
    /// past the region's lease). `holder`: the key it must have been
    /// handed out to (`""`: any). Reads and writes only the region's
    /// Redis, so it needs no policy and learns nothing: an id naming a
    /// quota that has no permits finds none.
    pub async fn give_back(&self, id: &str, holder: &str, renew: bool) -> Result<PermitReturn> {
        let Some((tenant, resource)) = super::parse_id(id) else {
            return Err(Error::invalid(
                "permit_id",
                "not a permit id of this service (`<tenant>~<resource>~<32 hex>`)",
            ));
        };
        let prefix = self.keys.permit_quota(tenant, resource);
        let r = scripts::permit_return(&self.store, &prefix, id, renew, holder).await.map_err(store_err)?;
        let outcome = match r {
            PermitReturn::Released => "released",
            PermitReturn::Renewed { .. } => "renewed",
            PermitReturn::Gone => "gone",
            PermitReturn::NotHolder => "not_holder",
        };
        self.metrics.inc("agent_permit_decisions_total", &[("outcome", outcome)]);
        Ok(r)
    }

    /// One pass of the maintenance task: every known quota gives back its
    /// idle permits and renews its lease when due, [`TIDY_PARALLEL`] at a
    /// time (a slow allocator must not hold the last quotas' renewals past
    /// their slack); the live permits of the pass are the gauge's. Quotas
    /// idle for long with nothing held are forgotten.
    pub async fn tidy(self: &Arc<Self>) {
        let mut live = 0;
        let mut running = tokio::task::JoinSet::new();
        for q in self.all() {
            if q.policy().is_none() {
                self.forget_if_idle(&q);
                continue;
            }
            if running.len() >= TIDY_PARALLEL {
                live += running.join_next().await.and_then(|r| r.ok()).unwrap_or(0);
            }
            let me = self.clone();
            running.spawn(async move { me.tidy_one(&q).await });
        }
        while let Some(r) = running.join_next().await {
            live += r.unwrap_or(0);
        }
        self.metrics.set("agent_permits_live", &[], live as f64);
    }

    /// [`Permits::tidy`] of one quota: its live permits after it.
    async fn tidy_one(&self, q: &PermitQuota) -> i64 {
        match self.call(q, Goal::Tidy).await {
            Ok(_) | Err(Error::AllocatorUnreachable) => {}
            Err(e) => {
                tracing::debug!(tenant = %q.tenant, resource = %q.resource, error = %e, "permit lease call")
            }
        }
        match scripts::permit_plan(&self.store, &q.prefix, None).await {
            Ok(PermitPlan { state: Some(s), .. }) => {
                if s.live == 0 && s.cap == 0 {
                    self.forget_if_idle(q);
                }
                s.live
            }
            _ => 0,
        }
    }
}

/// The maintenance task: [`Permits::tidy`] every two seconds until cancelled.
pub async fn run(permits: Arc<Permits>, cancel: CancellationToken) {
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(TICK) => {}
        }
        permits.tidy().await;
    }
}
