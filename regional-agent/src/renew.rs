//! The renewer (DESIGN §4): one background task per quota that renews ahead
//! of need, in proportion to region-wide demand, and prefetches the next
//! window's lease near the boundary. A Redis lock with expiry lets one
//! replica at a time renew a quota; the others see the credited lease in
//! the shared balance.
//!
//! Crediting (`lua/credit.lua`) is idempotent by lease id and refuses
//! leases of an epoch below the agent's fence (I4, I5). Deadlines are
//! relative (I2): a lease lives `expires_in_ms` from the instant the grant
//! request was *sent*, and a next-window lease opens `window_start −
//! allocator_now` after the instant the answer *arrived*, where
//! `allocator_now = expires_at − expires_in_ms` is read from the answer
//! itself, so only the allocator's clock is ever subtracted from itself.
//! The region's fallback clock takes the allocator's clock as of the send
//! instant plus the time since (never behind it; see `credit`).

use crate::app::{AllocatorClock, App};
use crate::breaker::backoff;
use crate::client::{AllocatorClient, CallError};
use crate::commands;
use crate::config::Settings;
use crate::grant_batch::Grants;
use crate::identity::Identity;
use crate::keys::Keys;
use crate::plan::{self, PlanInput};
use crate::quotas::{Quota, Quotas, Unknown, IDLE_EVICT};
use crate::scripts::{self, Caller, Credit, Lease, On, Outcome, View, ViewArgs};
use crate::store::{Store, StoreError};
use quota_shared::clock::Clock;
use quota_shared::prom::Registry;
use quota_shared::window::Window;
use quota_shared::wire::{GrantRequest, GrantResponse, WindowSel};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// Taken off every lease's life for the Redis round trip of the credit.
const SAFETY_MS: i64 = 5;
/// A quota unused this long is looked at once a second only.
pub const IDLE_AFTER: Duration = Duration::from_secs(30);
/// How long an unanswered grant is resent unchanged; past it a fresh
/// request is cheaper than replaying a lease that has likely expired.
const RESEND_UNANSWERED_FOR: Duration = Duration::from_secs(10);

/// Longest a renewer waits after the allocator did not answer.
const UNREACHABLE_CAP: Duration = Duration::from_millis(400);

/// The renewal backoff to honour: one taken because the allocator was
/// unreachable ends as soon as the allocator answers again (any call of
/// any quota closed the breaker), so the region heals within a round trip
/// instead of sleeping out the backoff; a refusal's backoff stays.
fn heal_backoff(q: &Quota, not_before: Option<Instant>, reachable: bool) -> Option<Instant> {
    let mut r = q.renew.lock().unwrap();
    if r.unreachable && reachable {
        r.unreachable = false;
        r.failures = 0;
        r.not_before = None;
        return None;
    }
    not_before
}

/// What a quota's renewer uses of the agent's state: not the request
/// path's guard, local fallback or fleet counts, nor the task list.
#[derive(Clone)]
pub struct Renewer {
    pub settings: Arc<Settings>,
    pub keys: Keys,
    pub store: Store,
    pub alloc: Arc<AllocatorClient>,
    /// Where grants are asked for (batched with other quotas').
    pub grants: Arc<Grants>,
    /// Observed on every credited grant (I8).
    pub alloc_clock: Arc<AllocatorClock>,
    pub clock: Arc<dyn Clock>,
    pub quotas: Arc<Quotas>,
    /// A 404 puts the quota's name here.
    pub unknown: Arc<Unknown>,
    /// A `concurrency_policy` answer puts the quota here.
    pub permits: Arc<crate::permits::Permits>,
    pub ident: Arc<Identity>,
    pub metrics: Arc<Registry>,
    pub cancel: CancellationToken,
}

impl Renewer {
    /// A renewer's handles on `app`'s parts.
    pub fn of(app: &App) -> Renewer {
        Renewer {
            settings: app.settings.clone(),
            keys: app.keys.clone(),
            store: app.store.clone(),
            alloc: app.alloc.clone(),
            grants: app.grants.clone(),
            alloc_clock: app.alloc_clock.clone(),
            clock: app.clock.clone(),
            quotas: app.quotas.clone(),
            unknown: app.unknown.clone(),
            permits: app.permits.clone(),
            ident: app.ident.clone(),
            metrics: app.metrics.clone(),
            cancel: app.cancel.clone(),
        }
    }
}

/// The renew task of one quota; it ends when the quota leaves the registry
/// (idle, or unknown to the allocator).
///
/// Every call that crosses the network is boxed: the task lives as long as
/// its quota and sleeps most of the time, and an async task is as large as
/// the largest state it can be in. Unboxed, a round's state (the grant
/// call, its HTTP client future, the scripts) made every known quota cost
/// about 9 KiB of memory while asleep; boxed, a round allocates it only
/// while it runs (one allocation per round, every 50 ms at most).
pub async fn run(app: Renewer, q: Arc<Quota>) {
    let registry = app.keys.agent_quotas(&app.settings.region, &app.settings.agent);
    let member = format!("{}/{}", q.tenant, q.resource);
    let mut registered = false;
    while app.quotas.holds(&q) {
        // Only a quota that exists goes into the agent's quota set (which a
        // restart reloads): a name the allocator does not know leaves nothing.
        if !registered && q.policy().is_some() {
            registered = Box::pin(commands::join(&app.store, &registry, &member)).await.is_ok();
        }
        Box::pin(count_held_demand(&app, &q)).await;
        if let Err(e) = Box::pin(renew_once(&app, &q)).await {
            tracing::debug!(tenant = %q.tenant, resource = %q.resource, error = %e, "renewal round failed");
        }
        // The round that taught the policy also credited a lease whose
        // release may go into this agent's outbox: the quota set must name
        // the quota before the next tick (a restart or an adopter finds the
        // outbox through it).
        if !registered && q.policy().is_some() {
            registered = Box::pin(commands::join(&app.store, &registry, &member)).await.is_ok();
        }
        let idle_for = q.last_used.lock().unwrap().elapsed();
        if idle_for > IDLE_EVICT && Box::pin(retire_if_idle(&app, &q, &registry, &member)).await {
            return;
        }
        let tick = if q.waiting.load(Ordering::SeqCst) {
            Duration::from_millis(10)
        } else if idle_for > IDLE_AFTER {
            Duration::from_secs(1)
        } else {
            Duration::from_millis(50)
        };
        tokio::select! {
            _ = app.cancel.cancelled() => return,
            _ = q.wake.notified() => {},
            _ = tokio::time::sleep(tick) => {},
        }
    }
}

/// Adds the demand of refusals answered from the negative cache to the
/// region's counter (given back when Redis did not take it).
async fn count_held_demand(app: &Renewer, q: &Quota) {
    let n = q.negative.take_uncounted();
    if n > 0 && commands::add_demand(&app.store, &q.prefix, n).await.is_err() {
        q.negative.add_uncounted(n);
    }
}

/// Takes an idle quota out of the registry when nothing of it is left for
/// this agent to do: no live or pending lease in the region's balance and
/// an empty outbox (counts not yet cut would be cut into it first).
async fn retire_if_idle(app: &Renewer, q: &Arc<Quota>, registry: &str, member: &str) -> bool {
    let v = *q.view.lock().unwrap();
    if v.available > 0 || v.pending > 0 {
        return false;
    }
    let ob = Keys::outbox(&q.prefix, &app.settings.agent);
    let outbox = commands::list_len(&app.store, &ob).await;
    let uncut = commands::uncut_windows(&app.store, &q.prefix).await;
    if !matches!((outbox, uncut), (Ok(0), Ok(0))) {
        return false;
    }
    if !app.quotas.remove(q) {
        return true;
    }
    let _ = commands::leave(&app.store, registry, member).await;
    tracing::info!(tenant = %q.tenant, resource = %q.resource, "idle quota left the registry");
    true
}

/// Runs the view script: sweeps expired leases, reads balance and demand;
/// tokens count as lasting in leases with at least `lasting_ms` to live.
/// `None` when the quota's state changed incarnation (settled).
async fn view(app: &Renewer, q: &Quota, lasting_ms: i64) -> Result<Option<(View, i64)>, StoreError> {
    let (window_secs, allowance) =
        q.policy().map(|p| (p.window_secs, p.fallback_allowance)).unwrap_or((1, 0));
    let token = q.token();
    let on = On { prefix: &q.prefix, token: &token };
    let by = Caller { agent: &app.settings.agent, epoch: app.ident.epoch() };
    let r = scripts::view(&app.store, on, by, ViewArgs { window_secs, allowance, lasting_ms }).await?;
    q.settle(&r, &app.ident, &app.metrics);
    Ok(match r {
        Outcome::Ran { value, .. } => Some(value),
        Outcome::Lost(_) => None,
    })
}

/// One round of the renewer: look at the balance, then grant what
/// [`plan::plan`] says.
#[tracing::instrument(skip_all, fields(tenant = %q.tenant, resource = %q.resource))]
async fn renew_once(app: &Renewer, q: &Arc<Quota>) -> Result<(), StoreError> {
    if q.policy().is_none() {
        return Box::pin(learn(app, q)).await;
    }
    let reread = {
        let mut r = q.renew.lock().unwrap();
        let due = r.policy_read_at.is_none_or(|t| t.elapsed() >= crate::quotas::POLICY_REREAD);
        if due {
            r.policy_read_at = Some(Instant::now());
        }
        due
    };
    if reread {
        q.load_policy(&app.store).await;
    }
    let horizon_ms =
        plan::horizon_ms(app.settings.renew_ahead.as_millis() as f64, q.renew.lock().unwrap().rtt_ms);
    let lasting_ms = match q.policy() {
        Some(p) => {
            let now = app.clock.now_utc();
            plan::lasting_ms(horizon_ms, Window::containing(now, p.window_secs).ms_until_end(now))
        }
        None => horizon_ms as i64,
    };
    let Some((v, demand_total)) = view(app, q, lasting_ms).await? else { return Ok(()) };
    *q.view.lock().unwrap() = v;
    if v.available > 0 {
        // Tokens in the region's balance (another replica's lease, a
        // release): a held "pool spent" refusal ends at once, so the hold
        // costs this replica at most one renewer tick of them.
        q.negative.clear_pool();
    }
    let (rate, measured) = {
        let mut d = q.demand.lock().unwrap();
        d.sample(demand_total, Instant::now());
        (d.rate, d.measured)
    };
    let label = format!("{}/{}", q.tenant, q.resource);
    app.metrics.set("agent_lease_tokens", &[("quota", &label)], v.available as f64);
    let waiting = q.waiting.load(Ordering::SeqCst);
    let need = q.waiting_need.load(Ordering::SeqCst).max(1);
    if plan::serves_waiters(&v, waiting, need) {
        crate::quotas::clear_waiting(q);
        q.renewed.notify_waiters();
    }
    if !plan::active(rate, waiting) {
        return Ok(());
    }
    if app.ident.epoch() == 0 {
        // Not registered yet: wait briefly for it rather than a whole tick.
        let n = app.ident.registered.notified();
        let _ = tokio::time::timeout(app.settings.allocator_timeout, n).await;
        if app.ident.epoch() == 0 {
            if waiting {
                q.renewed.notify_waiters();
            }
            return Ok(());
        }
    }
    let (not_before, prefetched, next_not_before) = {
        let r = q.renew.lock().unwrap();
        (r.not_before, r.prefetched, r.next_not_before)
    };
    let now_i = Instant::now();
    let not_before = heal_backoff(q, not_before, app.alloc.breaker.reachable());
    if not_before.is_some_and(|t| now_i < t) || app.alloc.breaker.is_open() {
        if waiting {
            q.renewed.notify_waiters();
        }
        return Ok(());
    }
    let Some(p) = q.policy() else { return Ok(()) };
    let now = app.clock.now_utc();
    let win = Window::containing(now, p.window_secs);
    let planned = plan::plan(&PlanInput {
        view: v,
        rate,
        measured,
        waiting,
        need,
        limit: p.limit,
        window_secs: p.window_secs,
        horizon_ms,
        to_end_ms: win.ms_until_end(now),
        next_held: prefetched == Some(win.next().start) || next_not_before.is_some_and(|t| now_i < t),
    });
    if planned == plan::Plan::default() {
        return Ok(());
    }
    // Boxed: most rounds only look (above), and a round's task holds the
    // largest state it can reach while it waits (see [`run`]).
    Box::pin(with_lock(app, q, move |app, q| async move {
        if let Some(want) = planned.current {
            grant(&app, &q, WindowSel::Current, want, rate).await;
        }
        if let Some(want) = planned.next {
            grant(&app, &q, WindowSel::Next, want, rate).await;
        }
    }))
    .await?;
    Ok(())
}

/// A quota whose policy is not known yet: nothing is read or written in
/// Redis for it (the name may not exist); when a request waits, one grant
/// for the current window tells whether it exists and teaches the policy
/// (404: the quota leaves the registry, see [`grant`]). Replicas learning
/// together each ask for one token: no lock, so no key for a name that
/// may not exist.
async fn learn(app: &Renewer, q: &Arc<Quota>) -> Result<(), StoreError> {
    if !q.waiting.load(Ordering::SeqCst) {
        return Ok(());
    }
    if app.ident.epoch() == 0 {
        let n = app.ident.registered.notified();
        let _ = tokio::time::timeout(app.settings.allocator_timeout, n).await;
    }
    let nb = q.renew.lock().unwrap().not_before;
    let blocked = heal_backoff(q, nb, app.alloc.breaker.reachable()).is_some_and(|t| Instant::now() < t);
    if app.ident.epoch() == 0 || blocked || app.alloc.breaker.is_open() {
        q.renewed.notify_waiters();
        return Ok(());
    }
    grant(app, q, WindowSel::Current, 1, 0.0).await;
    Ok(())
}

/// Runs `f` while holding the quota's renew lock; skips it when another
/// replica holds the lock (it is renewing the shared balance).
async fn with_lock<F, Fut>(app: &Renewer, q: &Arc<Quota>, f: F) -> Result<bool, StoreError>
where
    F: FnOnce(Renewer, Arc<Quota>) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let holder = format!("{}:{}", app.settings.agent, uuid::Uuid::new_v4().simple());
    let ttl = (app.settings.allocator_timeout * 3).as_millis() as u64 + 500;
    if !commands::take_renew_lock(&app.store, &q.prefix, &holder, ttl).await? {
        return Ok(false);
    }
    f(app.clone(), q.clone()).await;
    let _ = scripts::unlock(&app.store, &q.prefix, &holder).await;
    Ok(true)
}

/// One grant request and what follows from its answer.
async fn grant(app: &Renewer, q: &Arc<Quota>, sel: WindowSel, want: i64, rate: f64) {
    let retry = q.renew.lock().unwrap().unanswered.take().filter(|(p, first)| {
        p.window == Some(sel) && p.epoch == app.ident.epoch() && first.elapsed() < RESEND_UNANSWERED_FOR
    });
    let (req, first_sent) = match retry {
        Some(r) => r,
        None => {
            let (epoch, seq) = app.ident.next_seq();
            if epoch == 0 {
                return;
            }
            let req = GrantRequest {
                tenant: q.tenant.clone(),
                resource: q.resource.clone(),
                region: app.settings.region.clone(),
                agent: app.settings.agent.clone(),
                epoch,
                seq,
                want,
                demand_per_sec: if rate.is_finite() { rate.max(0.0) } else { 0.0 },
                window: Some(sel),
            };
            (req, Instant::now())
        }
    };
    let sent = Instant::now();
    let result = app.grants.grant(&req).await;
    let arrived = Instant::now();
    let outcome = match result {
        Ok(g) => {
            {
                let mut r = q.renew.lock().unwrap();
                let rtt = arrived.duration_since(sent).as_secs_f64() * 1000.0;
                r.rtt_ms = if r.rtt_ms == 0.0 { rtt } else { r.rtt_ms * 0.8 + rtt * 0.2 };
                r.failures = 0;
                r.not_before = None;
                r.unreachable = false;
                if sel == WindowSel::Next {
                    r.prefetched = Some(g.window_start.timestamp());
                }
            }
            q.learn_policy(&app.store, &g).await;
            credit(app, q, sel, &g, sent, arrived).await
        }
        Err(CallError::Refused { status: 404, .. }) => {
            if q.policy().is_none() {
                // Never known: forget it entirely (F14).
                app.unknown.insert(&q.tenant, &q.resource);
                app.quotas.remove(q);
            } else {
                *q.unknown_until.lock().unwrap() = Some(Instant::now() + Duration::from_secs(2));
            }
            "unknown_quota"
        }
        Err(e) if e.code() == Some("concurrency_policy") => {
            // A concurrency quota: its permits are leased by
            // `crate::permits`, not by this renewer.
            if app.permits.mark(&q.tenant, &q.resource).is_some() {
                app.quotas.remove(q);
            }
            "concurrency_policy"
        }
        Err(e) if e.code() == Some("stale_epoch") => {
            // Only an answer to the current epoch's request says this
            // epoch is stale: one sent before a registration that finished
            // meanwhile would otherwise register again and retire the new
            // epoch's fresh leases.
            if req.epoch == app.ident.epoch() {
                app.ident.request_register();
            }
            "stale_epoch"
        }
        Err(CallError::Refused { status, code, message, .. }) => {
            if sel == WindowSel::Next {
                // Too early for "next" (the window's lease_ttl is shorter than our lead).
                q.renew.lock().unwrap().next_not_before = Some(Instant::now() + Duration::from_millis(250));
            } else {
                let mut r = q.renew.lock().unwrap();
                r.failures += 1;
                r.not_before = Some(
                    Instant::now() + backoff(r.failures, Duration::from_millis(100), Duration::from_secs(5)),
                );
            }
            tracing::warn!(tenant = %q.tenant, resource = %q.resource, status, code, message, "grant refused");
            "refused"
        }
        Err(CallError::Unreachable(why)) => {
            let mut r = q.renew.lock().unwrap();
            r.unanswered = Some((req, first_sent));
            r.failures += 1;
            // Short: the breaker already keeps calls from leaving while the
            // allocator is down, and a renewer asleep for seconds after it
            // came back is a region answering 503 for nothing (heal < 1 s).
            r.not_before =
                Some(Instant::now() + backoff(r.failures, Duration::from_millis(50), UNREACHABLE_CAP));
            r.unreachable = true;
            tracing::debug!(tenant = %q.tenant, resource = %q.resource, why, "grant failed: allocator unreachable");
            "unreachable"
        }
    };
    app.metrics.inc("agent_renewals_total", &[("result", outcome)]);
    app.metrics.set("agent_allocator_reachable", &[], if app.alloc.breaker.reachable() { 1.0 } else { 0.0 });
    crate::quotas::clear_waiting(q);
    q.renewed.notify_waiters();
}

/// Credits a granted lease into the region's balance (or marks the pool
/// exhausted when it carried no tokens).
async fn credit(
    app: &Renewer,
    q: &Quota,
    sel: WindowSel,
    g: &GrantResponse,
    sent: Instant,
    arrived: Instant,
) -> &'static str {
    if g.tokens <= 0 {
        if sel == WindowSel::Current {
            tracing::debug!(tenant = %q.tenant, resource = %q.resource, "the allocator said the pool is empty");
            // Tell every replica: answer 429 at once. Re-asked after at most
            // a second, since releases can refill the pool.
            let retry = g.retry_after_ms.unwrap_or(1000).max(1);
            let ttl = retry.min(1000);
            let _ = commands::mark_exhausted(&app.store, &q.prefix, retry, ttl).await;
            // Nothing left unleased: a reserve is then all in the regions'
            // balances (see lua/spend.lua).
            let ws = g.window_start.timestamp();
            let ttl = (g.window_end - g.window_start).num_milliseconds() + crate::keys::COUNTER_TTL_MS;
            let _ = commands::pool_room_empty(&app.store, &q.prefix, ws, ttl).await;
        }
        return "empty";
    }
    // The allocator's instant when it answered, read off the answer itself.
    let alloc_at = g.expires_at - chrono::Duration::milliseconds(g.expires_in_ms);
    // Both of the agent's readings of the allocator's clock (the one its own
    // decisions read, and the region's fallback clock, credit.lua's offset)
    // count from the instant the request was *sent*: the allocator read
    // `alloc_at` after that, so neither lags its clock and an admit just
    // after a window's end cannot land in the ended window; they may lead by
    // one round trip. (Counted from the arrival, a slow grant made them lag
    // by the grant's whole duration: seen as a 200 charged to a window that
    // had ended when the request was sent, on an overloaded machine.)
    app.alloc_clock.observe(alloc_at, sent);
    if matches!(q.token().as_str(), "" | "?") {
        // The first grant of a quota learning its policy: the quota exists,
        // so its Redis state may now be set up (the view adopts or installs
        // the incarnation) before the lease is credited under it.
        if let Err(e) = view(app, q, 0).await {
            tracing::warn!(tenant = %q.tenant, resource = %q.resource, lease_id = %g.lease_id, error = %e,
                "cannot credit lease; its tokens are stranded");
            return "store_unavailable";
        }
    }
    // The lease's life, the allocator's "now" and the wait until a next
    // window's lease may be spent are read after the view
    // above (an extra round trip on a quota's first grant), just before the
    // credit: credit.lua starts the lease's relative timer when it runs, so
    // read earlier they would let the lease outlive its window, and the
    // fallback clock lag, by that round trip.
    let life_ms = g.expires_in_ms - sent.elapsed().as_millis() as i64 - SAFETY_MS;
    let alloc_now_ms = alloc_at.timestamp_millis() + sent.elapsed().as_millis() as i64;
    let nb_ms = if sel == WindowSel::Next {
        let opens_in = (g.window_start - alloc_at).num_milliseconds() + 2;
        (opens_in - arrived.elapsed().as_millis() as i64).max(0)
    } else {
        0
    };
    let lease = Lease {
        id: g.lease_id.to_string(),
        epoch: g.epoch,
        tokens: g.tokens,
        window_start: g.window_start.timestamp(),
        life_ms,
        nb_ms,
        alloc_now_ms,
        pool_available: g.pool.available,
    };
    let token = q.token();
    let on = On { prefix: &q.prefix, token: &token };
    match scripts::credit(&app.store, on, &app.settings.agent, &lease).await {
        Ok(r) => {
            // A credit that found another incarnation strands the lease
            // (safe); the next round adopts the new state.
            q.settle(&r, &app.ident, &app.metrics);
            match r {
                Outcome::Ran { value: Credit::Credited, .. } => {
                    q.negative.clear_pool();
                    tracing::debug!(tenant = %q.tenant, resource = %q.resource, lease_id = %g.lease_id, epoch = g.epoch,
                        tokens = g.tokens, life_ms, nb_ms, "lease credited");
                    "granted"
                }
                Outcome::Ran { value: Credit::Replayed, .. } => "replayed",
                Outcome::Ran { value: Credit::Expired, .. } => "expired_on_arrival",
                Outcome::Ran { value: Credit::Stale, .. } => "stale_epoch",
                Outcome::Lost(_) => "lost",
            }
        }
        Err(e) => {
            tracing::warn!(tenant = %q.tenant, resource = %q.resource, lease_id = %g.lease_id, error = %e,
                "cannot credit lease; its tokens are stranded");
            "store_unavailable"
        }
    }
}

#[cfg(test)]
mod size {
    /// The size of the future a function of two arguments returns,
    /// without calling it.
    fn future_size<A, B, Fut, F: FnOnce(A, B) -> Fut>(_: F) -> usize {
        std::mem::size_of::<Fut>()
    }

    /// A known quota's renew task stays small while it sleeps (issue 28's
    /// 2 KiB per quota): unboxed, the grant call's state made it 9.5 KiB.
    #[test]
    fn a_renew_task_stays_small_while_it_sleeps() {
        let size = future_size(super::run);
        assert!(size <= 1024, "the renew task's future is {size} bytes");
    }

    /// A round is boxed only while it runs, but an agent with many quotas
    /// has many rounds in flight (measured: about one per known quota,
    /// each waiting for its look at Redis): a round that only looks must
    /// not carry a grant's state (2.9 KiB), nor a Redis call the state of
    /// a Sentinel lookup it does not make (6.3 KiB, in every call before
    /// `Store::eval` boxed it); together they made 9 KiB per round.
    #[test]
    fn a_round_that_only_looks_stays_small() {
        use super::{renew_once, view, Quota, Renewer};
        use std::sync::Arc;
        let round = future_size(|a: &'static Renewer, q: &'static Arc<Quota>| renew_once(a, q));
        assert!(round <= 2560, "a renewal round's future is {round} bytes");
        let look = future_size(|a: &'static Renewer, q: &'static Quota| view(a, q, 0));
        assert!(look <= 2048, "a look at Redis is {look} bytes");
    }
}
