//! The region's permit lease at the allocator: one call that moves it
//! (grow, give back, renew) and applies the answer to the region's Redis,
//! the hand-out and return of one permit around it, and the task that
//! gives idle permits back and keeps the leases of held ones renewed.

use super::rule::{self, Goal};
use super::{PermitQuota, Permits};
use crate::client::CallError;
use crate::error::{Error, Result};
use crate::scripts::{self, PermitReturn, PermitTake};
use quota_shared::wire::{PermitLease, PermitLeaseRequest};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// How often the maintenance task looks at every known quota.
const TICK: Duration = Duration::from_secs(2);

/// Hand-out attempts of one acquire (each lease call in between may lose
/// a race to another replica).
const TRIES: usize = 4;

/// A permit handed out.
#[derive(Debug, Clone)]
pub struct Taken {
    pub permit_id: String,
    pub expires_in_ms: i64,
    /// More permits the region's lease holds that are not handed out.
    pub left: i64,
    pub policy: super::PermitPolicy,
}

fn store_err(_: crate::store::StoreError) -> Error {
    Error::StoreUnavailable
}

/// A refusal's `Retry-After` hint: permits come back when released, which
/// nothing predicts; a second (plus the answer's jitter) is a polite poll.
const RETRY_MS: i64 = 1000;

impl Permits {
    /// One lease call for `q` toward `goal`, applied to the region's
    /// Redis. `Ok(None)`: no call was due. The region's cap falls before
    /// the allocator hears of it and rises only after the allocator
    /// granted (see `lua/permit.lua`).
    pub async fn call(&self, q: &PermitQuota, goal: Goal) -> Result<Option<PermitLease>> {
        let _one = q.calling.lock().await;
        let state = scripts::permit_state_of(&self.store, &q.prefix, None).await.map_err(store_err)?;
        let ttl_ms = q.policy().map_or(0, |p| p.ttl_ms);
        let (seq, want, lost) = match state {
            // Lost, or never written: ask as a region that knows of no
            // lease. If the allocator holds one for it, the answer is a
            // conflict showing it, and hand-outs stop for a TTL.
            None => (0, i64::from(goal == Goal::Grow), true),
            Some(s) if s.blocked_in_ms > 0 && goal == Goal::Tidy => return Ok(None),
            Some(s) => match rule::want(goal, s.cap, s.live, s.lease_in_ms, ttl_ms) {
                None => return Ok(None),
                Some(w) if w < s.cap => {
                    let lowered = scripts::permit_state_of(&self.store, &q.prefix, Some(w))
                        .await
                        .map_err(store_err)?
                        .ok_or(Error::StoreUnavailable)?;
                    (lowered.seq, lowered.cap, false)
                }
                Some(w) => (s.seq, w, false),
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
        let sent = Instant::now();
        let answer = match self.alloc.permit_lease(&req).await {
            Ok(a) => a,
            Err(e) => return Err(self.refused(&e, epoch)),
        };
        q.learn(&answer);
        let trusted = rule::trusted_ms(answer.lease_ms, sent.elapsed());
        let ttl_ms = answer.permit_ttl_secs.saturating_mul(1000);
        if lost || answer.conflict {
            // A conflict's answer is the allocator's lease as it is; after
            // a loss, what it holds for the region may be out in clients'
            // hands with no record here. (A region the allocator holds no
            // lease for, a first touch, gets its request applied: nothing
            // of it can be out.)
            let block = if lost && answer.conflict { rule::block_ms(answer.held, ttl_ms) } else { 0 };
            if block > 0 {
                self.metrics.inc("agent_permit_state_lost_total", &[]);
                tracing::warn!(tenant = %q.tenant, resource = %q.resource, held = answer.held, block_ms = block,
                    "the region's permit state was lost while the allocator held permits for it: \
                     no permit is handed out until the forgotten ones have expired");
            }
            let force = answer.conflict && answer.seq < seq;
            scripts::permit_sync(&self.store, &q.prefix, answer.seq, answer.held, trusted, block, force)
                .await
                .map_err(store_err)?;
        } else {
            scripts::permit_apply(&self.store, &q.prefix, seq, answer.seq, answer.held, trusted)
                .await
                .map_err(store_err)?;
        }
        self.metrics.inc(
            "agent_permit_lease_calls_total",
            &[("outcome", if answer.conflict { "conflict" } else { "applied" })],
        );
        Ok(Some(answer))
    }

    /// What a failed lease call means for the request that needed it.
    fn refused(&self, e: &CallError, epoch: i64) -> Error {
        self.metrics.inc("agent_permit_lease_calls_total", &[("outcome", "failed")]);
        match e {
            CallError::Refused { status: 404, .. } => Error::UnknownQuota(String::new()),
            CallError::Refused { code, .. } if code == "stale_epoch" => {
                if self.ident.epoch() == epoch {
                    self.ident.request_register();
                }
                Error::AllocatorUnreachable
            }
            _ => Error::AllocatorUnreachable,
        }
    }

    /// Hands out one permit of `q` (the acquire's `key` as its holder),
    /// growing the region's lease by one when all it holds are out.
    pub async fn take(&self, q: &PermitQuota, holder: &str, request_id: Option<&str>) -> Result<Taken> {
        let id = super::new_id(&q.tenant, &q.resource, request_id);
        let resource = format!("{}/{}", q.tenant, q.resource);
        let limited = || Error::ConcurrencyLimited { resource: q.resource.clone(), retry_after_ms: RETRY_MS };
        let mut last = limited();
        for _ in 0..TRIES {
            let Some(p) = q.policy() else {
                // First hand-out this replica makes: the lease call learns
                // the policy.
                self.call(q, Goal::Grow).await.map_err(|e| name(e, &resource))?;
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
                PermitTake::Blocked { ms } => {
                    self.metrics.inc("agent_permit_decisions_total", &[("outcome", "blocked")]);
                    return Err(Error::ConcurrencyLimited {
                        resource: q.resource.clone(),
                        retry_after_ms: ms,
                    });
                }
                PermitTake::Lost => {
                    self.call(q, Goal::Grow).await.map_err(|e| name(e, &resource))?;
                }
                PermitTake::Full { .. } => match self.call(q, Goal::Grow).await {
                    Ok(_) => last = limited(),
                    // Cut off from the allocator with every permit out: the
                    // region may not hand out more (no fallback allowance).
                    Err(Error::AllocatorUnreachable) => return Err(self.refuse(limited())),
                    Err(e) => return Err(name(e, &resource)),
                },
                PermitTake::Lease { .. } => match self.call(q, Goal::Grow).await {
                    Ok(_) => last = Error::AllocatorUnreachable,
                    Err(e) => return Err(self.refuse(name(e, &resource))),
                },
            }
        }
        Err(self.refuse(last))
    }

    fn refuse(&self, e: Error) -> Error {
        let outcome = if matches!(e, Error::ConcurrencyLimited { .. }) { "refused" } else { e.code() };
        self.metrics.inc("agent_permit_decisions_total", &[("outcome", outcome)]);
        e
    }

    /// Releases permit `id` (`renew`: extends it instead by a TTL, never
    /// past the region's lease). `holder`: the key it must have been
    /// handed out to (`""`: any).
    pub async fn give_back(&self, id: &str, holder: &str, renew: bool) -> Result<PermitReturn> {
        let Some((tenant, resource)) = super::parse_id(id) else {
            return Err(Error::invalid(
                "permit_id",
                "not a permit id of this service (`<tenant>~<resource>~<32 hex>`)",
            ));
        };
        let q = self.mark(tenant, resource).ok_or(Error::TooManyQuotas)?;
        let ttl = if renew {
            if q.policy().is_none() {
                // A replica that never handed out this quota's permits
                // learns the TTL from the allocator first.
                let _ = self.call(&q, Goal::Tidy).await;
                if q.policy().is_none() {
                    self.call(&q, Goal::Grow).await?;
                }
            }
            Some(q.policy().map_or(0, |p| p.ttl_ms))
        } else {
            None
        };
        let r = scripts::permit_return(&self.store, &q.prefix, id, ttl, holder).await.map_err(store_err)?;
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
    /// idle permits and renews its lease when due; the live permits of the
    /// pass are the gauge's.
    pub async fn tidy(&self) {
        let mut live = 0;
        for q in self.all() {
            if q.policy().is_none() {
                continue;
            }
            match self.call(&q, Goal::Tidy).await {
                Ok(_) | Err(Error::AllocatorUnreachable) => {}
                Err(e) => {
                    tracing::debug!(tenant = %q.tenant, resource = %q.resource, error = %e, "permit lease call")
                }
            }
            if let Ok(Some(s)) = scripts::permit_state_of(&self.store, &q.prefix, None).await {
                live += s.live;
                if s.live == 0 && s.cap == 0 {
                    self.forget_if_idle(&q);
                }
            }
        }
        self.metrics.set("agent_permits_live", &[], live as f64);
    }
}

/// Names the quota in an unknown-quota error.
fn name(e: Error, resource: &str) -> Error {
    match e {
        Error::UnknownQuota(_) => Error::UnknownQuota(resource.to_string()),
        e => e,
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
