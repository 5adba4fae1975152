//! The admission decision of one request (I5) on one quota or several of
//! one tenant, asked by `POST /v1/acquire` ([`crate::acquire`]) and by
//! Envoy's rate limit service ([`crate::rls`]): made by a run of
//! `lua/spend.lua` (shared with the concurrent requests on the same quota,
//! see [`crate::batch`]) that checks each quota's incarnation, each lease's
//! expiry and epoch fence, the key's buckets and the balances, and debits
//! every limit or none. The request path never calls the allocator: when no
//! token is left it wakes the renewer and waits (bounded) for it, and it
//! answers from the region's fallback counter only while the allocator is
//! unreachable.

use crate::app::Decider;
use crate::batch;
use crate::error::{Error, PolicyRefusal, Result};
use crate::keys::{Keys, Layout};
use crate::negative::{self, Held};
use crate::quotas::{self, PolicyInfo, Quota};
use crate::request::{Acquire, Decided, Paid, Refused, ResourceCost, Shadow};
use crate::request_id;
use crate::scripts::{Admit, Ask, Common, Outcome, Spend};
use crate::spend_run;
use crate::stale::{self, Applied};
use crate::step::{step, Seen, Step, MAX_TRIES};
use quota_shared::window::Window;
use quota_shared::wire::FailMode;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Waits until the renewer reports, at most `d`.
async fn wait_renewal(q: &Quota, cost: i64, d: Duration) {
    let n = q.renewed.notified();
    tokio::pin!(n);
    n.as_mut().enable();
    quotas::set_waiting(q, cost);
    q.wake.notify_one();
    let _ = tokio::time::timeout(d, n).await;
}

/// A decision on a concurrency quota: its permits are taken alone by
/// `POST /v1/acquire` (which answers before it gets here) and released,
/// which a request naming several quotas, or Envoy, cannot do.
fn concurrency(tenant: &str, resource: &str) -> Error {
    Error::PolicyRefuses {
        field: "resource".into(),
        reason: PolicyRefusal::ConcurrencyQuota,
        message: format!(
            "{tenant}/{resource} is a concurrency quota: acquire its permit alone (one `resource`, cost 1) and release it"
        ),
    }
}

/// A quota of the request with its policy, learned if need be.
async fn learn(app: &Arc<Decider>, tenant: &str, resource: &str) -> Result<(Arc<Quota>, PolicyInfo)> {
    let unknown = || Error::UnknownQuota(format!("{tenant}/{resource}"));
    if app.unknown.contains(tenant, resource) {
        return Err(unknown());
    }
    if app.permits.is_concurrency(tenant, resource) {
        return Err(concurrency(tenant, resource));
    }
    let q = app.registry.quota(tenant, resource).ok_or(Error::TooManyQuotas)?;
    *q.last_used.lock().unwrap() = Instant::now();
    if q.unknown() {
        return Err(unknown());
    }
    let mut policy = q.policy();
    if policy.is_none() {
        policy = q.load_policy(&app.store).await;
    }
    if policy.is_none() {
        // The first acquire of a quota nobody in the region knows: wait for
        // one grant (this is the only time a request waits on the allocator
        // while it is reachable).
        let learn =
            app.settings.acquire_wait.max(app.settings.allocator_timeout + Duration::from_millis(300));
        let deadline = Instant::now() + learn;
        while q.policy().is_none()
            && !q.unknown()
            && !app.unknown.contains(tenant, resource)
            && !app.permits.is_concurrency(tenant, resource)
            && Instant::now() < deadline
        {
            wait_renewal(&q, 1, deadline.saturating_duration_since(Instant::now())).await;
            if !app.allocator_reachable() {
                break;
            }
        }
        policy = q.policy();
    }
    if q.unknown() || app.unknown.contains(tenant, resource) {
        return Err(unknown());
    }
    if app.permits.is_concurrency(tenant, resource) {
        return Err(concurrency(tenant, resource));
    }
    let Some(p) = policy else {
        return Err(Error::AllocatorUnreachable);
    };
    Ok((q, p))
}

/// The policy a decision applies: the one learnt, unless it is stale
/// (see [`crate::stale`]); then its `on_stale` says.
fn if_stale(app: &Decider, q: &Quota, p: PolicyInfo) -> Result<PolicyInfo> {
    let max_age = app.settings.max_policy_age;
    // Only an unreachable allocator makes a policy stale: the decision path
    // reads no clock while it answers.
    let reachable = app.allocator_reachable();
    if max_age.is_none() || reachable {
        return Ok(p);
    }
    let now_ms = stale::now_ms();
    let applied = stale::applied(q.confirmed.stale(now_ms, max_age, reachable), p.on_stale, p.fail_mode);
    if let Some(label) = applied.label() {
        app.metrics.inc("agent_stale_policy_decisions_total", &[("applied", label)]);
    }
    match applied {
        Applied::Fresh | Applied::Kept => Ok(p),
        Applied::Enforced => Ok(PolicyInfo { enforce: true, ..p }),
        Applied::Refused => {
            Err(Error::PolicyStale { age_secs: q.confirmed.age_ms(now_ms).unwrap_or(0) / 1000 })
        }
    }
}

/// The checks of one quota's cost and key against its policy.
fn check(req: &Acquire, w: &ResourceCost, p: PolicyInfo) -> Result<()> {
    let on = if req.multi { format!(" on {:?}", w.resource) } else { String::new() };
    let refuse = |field: &str, reason, message| {
        Err(Error::PolicyRefuses { field: field.to_string(), reason, message })
    };
    if w.cost > p.limit {
        return refuse(
            req.field("cost"),
            PolicyRefusal::CostAboveLimit,
            format!("{}{on} is above the quota's limit {}", w.cost, p.limit),
        );
    }
    if let Some(b) = p.per_key {
        if req.key.is_none() {
            return refuse(
                "key",
                PolicyRefusal::PrincipalMissing,
                format!(
                    "the quota{on} has a per-key limit: name the principal (user, API key) the request spends for"
                ),
            );
        }
        if w.cost > b.burst {
            return refuse(
                req.field("cost"),
                PolicyRefusal::CostAboveBurst,
                format!("{}{on} is above the per-key burst {}", w.cost, b.burst),
            );
        }
    }
    Ok(())
}

/// Makes the decision for a valid request; `policies` receives the policy
/// of each quota as it is learned.
pub(crate) async fn decide(
    app: &Arc<Decider>,
    req: &Acquire,
    policies: &mut Vec<PolicyInfo>,
) -> std::result::Result<Decided, Refused> {
    // An overloaded agent sheds the least important requests before any
    // work (see `shed`): nothing is charged, nothing reaches Redis.
    let _in_flight = app.shed.enter(req.priority).map_err(|s| {
        app.metrics.inc("agent_shed_total", &[("priority", crate::shed::label(s.priority))]);
        (Error::Shed { priority: s.priority }, None)
    })?;
    // Nothing is decided on a Redis that may evict the agent's keys (see `guard`).
    app.guard.admit().map_err(|e| (e, None))?;
    if req.multi && req.wants.len() > 1 && app.keys.layout() == Layout::Legacy {
        return Err((
            Error::invalid(
                "resources",
                "several quotas in one decision need the tenant key layout (--key-layout tenant)",
            ),
            None,
        ));
    }
    let mut qs = Vec::with_capacity(req.wants.len());
    for (i, w) in req.wants.iter().enumerate() {
        let (q, p) = learn(app, &req.tenant, &w.resource).await.map_err(|e| match e {
            Error::PolicyRefuses { reason: PolicyRefusal::ConcurrencyQuota, message, .. } => (
                Error::PolicyRefuses {
                    field: req.field("resource").into(),
                    reason: PolicyRefusal::ConcurrencyQuota,
                    message,
                },
                Some(i),
            ),
            e => (e, Some(i)),
        })?;
        // Known before the stale check, so that its refusal is counted
        // against the quota's version like any other.
        policies.push(p);
        let p = if_stale(app, &q, p).map_err(|e| (e, Some(i)))?;
        if let Some(last) = policies.last_mut() {
            *last = p;
        }
        check(req, w, p).map_err(|e| (e, Some(i)))?;
        qs.push(q);
    }
    let claimed = match &req.request_id {
        Some(rid) => match request_id::claim(app, req, rid, policies[0]).await {
            Ok(c) => c,
            Err(request_id::ClaimError::Mismatch(m)) => return Err((Error::RequestIdMismatch(m), None)),
            Err(request_id::ClaimError::Store(e)) => {
                tracing::warn!(tenant = %req.tenant, error = %e, "request id claim failed");
                return local_fallback(app, req, policies[0]).map_err(|e| (e, None));
            }
        },
        None => false,
    };
    // A quota in shadow mode that would refuse is left out and the others
    // decided again (at most once per quota).
    let mut shadow: Vec<Option<(Shadow, Error)>> = (0..qs.len()).map(|_| None).collect();
    // Demand is counted by the first run of the request only, also across
    // the runs after a shadow-mode quota was left out.
    let mut counted = false;
    let decided = loop {
        let active: Vec<usize> = (0..qs.len()).filter(|&i| shadow[i].is_none()).collect();
        if active.is_empty() {
            break Ok(Vec::new());
        }
        match spend_with_waits(app, &qs, policies, req, &active, &mut counted).await {
            Ok(admits) => break Ok(admits),
            Err((e, Some(i))) if !policies[i].enforce && Shadow::of(&e).is_some() => {
                shadow[i] = Shadow::of(&e).map(|s| (s, e));
            }
            Err(r) => break Err(r),
        }
    };
    let admits = match decided {
        Ok(a) => a,
        Err(r) => {
            if let (true, Some(rid)) = (claimed, &req.request_id) {
                request_id::forget(app, req, rid).await;
            }
            return Err(r);
        }
    };
    // One admit per quota decided, in order; the others are shadow admits.
    let mut admits = admits.into_iter();
    let mut parts = Vec::with_capacity(qs.len());
    for (i, q) in qs.iter().enumerate() {
        let part = match &shadow[i] {
            Some((s, e)) => crate::shadow::shadow_admit(app, q, policies[i], *s, e).await,
            None => match admits.next() {
                Some(admit) => {
                    let pool_room = q.pool_seen.lock().unwrap().room(admit.window_start);
                    Paid { admit, shadow: None, pool_room }
                }
                None => return Err((short(), None)),
            },
        };
        parts.push(part);
    }
    Ok(Decided { parts })
}

/// A run that answered fewer quotas than it decided on.
fn short() -> Error {
    tracing::error!("the spend script answered fewer quotas than the request named");
    Error::StoreUnavailable
}

/// A refusal of the request this replica holds from an earlier decision
/// (see [`crate::negative`]): the first active quota whose pool is held
/// spent, or whose bucket is held short for the request's key. Never for a
/// request with a `request_id` (a repeat must get its first answer). The
/// request's demand is counted as the script would have, once.
fn held_refusal(
    app: &Decider,
    qs: &[Arc<Quota>],
    req: &Acquire,
    active: &[usize],
    counted: &mut bool,
) -> Option<Refused> {
    if req.request_id.is_some() {
        return None;
    }
    let now = Instant::now();
    let (i, held) = active
        .iter()
        .find_map(|&i| qs[i].negative.check(req.key.as_deref(), req.wants[i].cost, now).map(|h| (i, h)))?;
    if !*counted {
        for &j in active {
            qs[j].negative.add_uncounted(req.wants[j].cost);
        }
        *counted = true;
    }
    let resource = req.wants[i].resource.clone();
    Some(match held {
        Held::Pool { retry_ms } => {
            app.metrics.inc("agent_negative_cache_refusals_total", &[("limit", "quota")]);
            (Error::Exhausted { resource, retry_after_ms: retry_ms }, Some(i))
        }
        Held::Key { retry_ms, remaining } => {
            app.metrics.inc("agent_negative_cache_refusals_total", &[("limit", "per_key")]);
            (Error::KeyLimited { resource, retry_after_ms: retry_ms, remaining }, Some(i))
        }
    })
}

/// Longest `Retry-After` of a reserve's refusal: the reserve lasts to the
/// window's end, but a client told to come back in an hour would not try
/// the next window on time when windows are long and the hint is only a
/// hint (a 429's `Retry-After` elsewhere is capped the same way).
const RESERVE_RETRY_MAX_MS: i64 = 60_000;

/// Milliseconds until the end of the window the allocator's clock is in.
fn ms_to_window_end(app: &Decider, p: PolicyInfo) -> i64 {
    let now = app.allocator_now();
    Window::containing(now, p.window_secs).ms_until_end(now)
}

/// Spends on the quotas `active` (indices into `qs`) in one atomic
/// decision, waiting for renewals by [`step`]'s rule. Answers one admit per
/// active quota, in order, or the refusal and the quota that refused.
async fn spend_with_waits(
    app: &Arc<Decider>,
    qs: &[Arc<Quota>],
    ps: &[PolicyInfo],
    req: &Acquire,
    active: &[usize],
    // Whether an earlier run of this request already counted its demand.
    counted: &mut bool,
) -> std::result::Result<Vec<Admit>, Refused> {
    // One wait for the renewal the request wakes, then up to one allocator
    // timeout for its answer: a renewal that times out makes the allocator
    // unreachable, which the fail mode then decides.
    let budget = app.settings.acquire_wait + app.settings.allocator_timeout + Duration::from_millis(100);
    let started = Instant::now();
    for _ in 0..MAX_TRIES {
        if let Some(refused) = held_refusal(app, qs, req, active, counted) {
            return Err(refused);
        }
        let reachable = app.allocator_reachable();
        let fallback: Vec<bool> = ps.iter().map(|p| !reachable && p.fail_mode == FailMode::Bounded).collect();
        let r = match spend_once(app, qs, ps, req, active, &fallback, !*counted).await {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(tenant = %req.tenant, error = %e, "spend failed");
                return match local_fallback(app, req, ps[active[0]]) {
                    Ok(d) => Ok(d.parts.into_iter().map(|p| p.admit).collect()),
                    Err(e) => Err((e, None)),
                };
            }
        };
        let (at, wait_ms, exhausted_ms) = match r {
            Outcome::Ran { value: Spend::Admit(a), .. } if a.len() == active.len() => return Ok(a),
            Outcome::Ran { value: Spend::Admit(_), .. } => return Err((short(), None)),
            // The script has stranded what it could not trust and the
            // run settled the loss (re-registering); decide again on the
            // fresh incarnation.
            Outcome::Lost(_) => continue,
            Outcome::Ran { value: Spend::None { quota, wait_ms, exhausted_ms }, .. } => {
                (active.get(quota).copied().unwrap_or(active[0]), wait_ms, exhausted_ms)
            }
            // What is left is kept for more important priorities: no
            // renewal changes that before the window ends. Not held in the
            // negative cache: a more important request must still pass.
            Outcome::Ran { value: Spend::Reserved { quota, .. }, .. } => {
                let i = active.get(quota).copied().unwrap_or(active[0]);
                app.metrics
                    .inc("agent_reserve_refusals_total", &[("priority", crate::shed::label(req.priority))]);
                let resource = req.wants[i].resource.clone();
                let retry_after_ms = ms_to_window_end(app, ps[i]).clamp(1, RESERVE_RETRY_MAX_MS);
                return Err((Error::Reserved { resource, retry_after_ms }, Some(i)));
            }
            // The key's own limit: no renewal or fallback changes it.
            Outcome::Ran { value: Spend::KeyLimited { quota, retry_ms, remaining }, .. } => {
                let i = active.get(quota).copied().unwrap_or(active[0]);
                if let (Some(k), None) = (&req.key, &req.request_id) {
                    if let Some(d) = negative::key_hold_for(retry_ms, ms_to_window_end(app, ps[i])) {
                        qs[i].negative.hold_key(k, req.wants[i].cost, remaining, retry_ms, d, Instant::now());
                    }
                }
                let resource = req.wants[i].resource.clone();
                return Err((Error::KeyLimited { resource, retry_after_ms: retry_ms, remaining }, Some(i)));
            }
        };
        *counted = true;
        let seen = Seen {
            wait_ms,
            exhausted_ms,
            reachable,
            fail_mode: ps[at].fail_mode,
            fallback_tried: fallback[at],
        };
        match step(seen, started.elapsed(), budget) {
            Step::SleepOpen(d) => tokio::time::sleep(d).await,
            Step::WaitRenewal(d) => wait_renewal(&qs[at], req.wants[at].cost, d).await,
            Step::Again => {}
            Step::Exhausted(ms) => {
                if let Some(d) = negative::hold_for(ms, ms_to_window_end(app, ps[at])) {
                    qs[at].negative.hold_pool(d, Instant::now());
                }
                let resource = req.wants[at].resource.clone();
                return Err((Error::Exhausted { resource, retry_after_ms: ms }, Some(at)));
            }
            Step::Unavailable => {
                if reachable {
                    tracing::debug!(tenant = %req.tenant, resource = %req.wants[at].resource,
                        waited_ms = started.elapsed().as_millis() as u64, "no token after both waits");
                }
                return Err((Error::AllocatorUnreachable, Some(at)));
            }
        }
    }
    Err((Error::AllocatorUnreachable, None))
}

/// The agent's own allowance while Redis cannot be used: a request on one
/// quota only (a decision over several needs their shared state).
fn local_fallback(app: &Arc<Decider>, req: &Acquire, p: PolicyInfo) -> std::result::Result<Decided, Error> {
    let n = app.settings.local_fallback_per_agent;
    let [w] = req.wants.as_slice() else {
        return Err(Error::StoreUnavailable);
    };
    if n == 0 {
        return Err(Error::StoreUnavailable);
    }
    let ws = Window::containing(app.allocator_now(), p.window_secs).start;
    match app.local.try_admit(&req.tenant, &w.resource, ws, w.cost, n) {
        Some(remaining) => Ok(Decided {
            parts: vec![Paid {
                admit: Admit { source: "fallback".into(), window_start: ws, remaining, key_remaining: None },
                shadow: None,
                pool_room: 0,
            }],
        }),
        None => Err(Error::StoreUnavailable),
    }
}

/// One spend run for the request on the quotas `active`: shared with the
/// concurrent requests of the quota when it is one (see [`crate::batch`]),
/// a run of its own when several.
async fn spend_once(
    app: &Arc<Decider>,
    qs: &[Arc<Quota>],
    ps: &[PolicyInfo],
    req: &Acquire,
    active: &[usize],
    fallback: &[bool],
    count_demand: bool,
) -> batch::Answer {
    // On the fallback path, the legacy key layout's count of the window
    // joins this layout's (see `crate::legacy`).
    let mut legacy = vec![None; qs.len()];
    for &i in active {
        let q = &qs[i];
        if fallback[i] && app.keys.layout() == Layout::Tenant && app.legacy.any() {
            let ws = Window::containing(app.allocator_now(), ps[i].window_secs).start;
            let allowance = ps[i].fallback_allowance;
            legacy[i] = Some(
                crate::legacy::legacy_fallback(&app.store, &app.keys, &q.tenant, &q.resource, ws, allowance)
                    .await,
            );
        }
    }
    let common = |i: usize| Common {
        legacy_until_ms: app.legacy.for_spend_ms(),
        fallback: fallback[i],
        window_secs: ps[i].window_secs,
        allowance: ps[i].fallback_allowance,
        rid_ttl_ms: request_id::ttl_ms(app, ps[i]),
        per_key: ps[i].per_key,
        legacy_fallback: legacy[i],
    };
    let rid = req.request_id.as_deref().map(Keys::request_id_suffix).unwrap_or_default();
    let key = match (active.iter().any(|&i| ps[i].per_key.is_some()), &req.key) {
        (true, Some(k)) => Keys::per_key_suffix(k),
        _ => String::new(),
    };
    let costs = active.iter().map(|&i| req.wants[i].cost).collect();
    let held = active.iter().map(|&i| ps[i].held[usize::from(req.priority.min(4))]).collect();
    let ask = Ask { costs, rid, count_demand, key, held };
    let sent = Instant::now();
    let r = if let [i] = active {
        let q = &qs[*i];
        batch::spend(
            &q.spends,
            app.settings.redis_timeout,
            common(*i),
            ask,
            spend_run::QuotaRuns::new(app, q),
        )
        .await
    } else {
        let quotas: Vec<Arc<Quota>> = active.iter().map(|&i| qs[i].clone()).collect();
        let commons: Vec<Common> = active.iter().map(|&i| common(i)).collect();
        let bound = app.settings.redis_timeout;
        match tokio::time::timeout(bound, spend_run::run(app, &quotas, &commons, std::slice::from_ref(&ask)))
            .await
        {
            Ok(r) => batch::first(r),
            Err(_) => Err(crate::store::StoreError::Timeout(bound)),
        }
    };
    let waited = sent.elapsed();
    app.shed.observe_store(waited);
    app.metrics.observe("agent_acquire_store_seconds", &[], waited.as_secs_f64());
    r
}
