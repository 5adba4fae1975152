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

use crate::app::AppState;
use crate::batch;
use crate::error::{Error, PolicyRefusal, Result};
use crate::keys::{Keys, Layout};
use crate::quotas::{self, PolicyInfo, Quota};
use crate::renew;
use crate::scripts::{self, Admit, Ask, Caller, Common, On, Outcome, Part, Spend};
use quota_shared::window::Window;
use quota_shared::wire::FailMode;
use serde::Deserialize;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Largest `cost` accepted before the policy is known.
pub const MAX_COST: i64 = 1_000_000_000;
/// Longest `request_id` accepted.
pub const MAX_REQUEST_ID_LEN: usize = 128;
/// Longest `key` (the principal of a per-key limit) accepted.
pub const MAX_KEY_LEN: usize = 128;
/// How long past its window's end a request id is remembered.
pub const REQUEST_ID_MARGIN_MS: i64 = 10_000;
/// Longest a request waits for a next-window lease about to open.
const MAX_OPEN_WAIT_MS: i64 = 250;

fn one() -> i64 {
    1
}

/// Most quotas one request may name.
pub const MAX_RESOURCES: usize = 8;

/// One quota of a request that names several (`resources`).
#[derive(Debug, Clone, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ResourceCost {
    pub resource: String,
    /// Default 1; `null` is the same as leaving it out, as in the single
    /// form's `cost`.
    #[serde(default = "one", deserialize_with = "null_is_one")]
    #[schema(nullable, default = 1)]
    pub cost: i64,
}

/// `cost` absent or `null`: 1 (the one rule of both request forms).
fn null_is_one<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<i64, D::Error> {
    Ok(<Option<i64> as serde::Deserialize>::deserialize(d)?.unwrap_or(1))
}

/// A valid acquire: the quotas it spends, in the request's order.
#[derive(Debug, Clone)]
pub struct Acquire {
    pub tenant: String,
    pub wants: Vec<ResourceCost>,
    /// Whether the request used the `resources` form (its answer lists
    /// each quota).
    pub multi: bool,
    pub request_id: Option<String>,
    pub key: Option<String>,
}

impl Acquire {
    /// The field a problem with quota `i`'s cost or key is named by.
    fn field(&self, single: &'static str) -> &'static str {
        if self.multi {
            "resources"
        } else {
            single
        }
    }

    /// The request id claim's value: what the id stands for.
    fn claim(&self) -> String {
        let mut v = self.wants.iter().map(|w| format!("{}:{}:{}", w.resource.len(), w.resource, w.cost));
        let mut s = v.next().unwrap_or_default();
        for w in v {
            s.push('+');
            s.push_str(&w);
        }
        // The key joins the claim only when given, so a claim written
        // before per-key limits existed still matches its keyless repeat.
        if let Some(k) = &self.key {
            s.push_str(&format!(":{}:{k}", k.len()));
        }
        s
    }
}

/// Whether `s` is 1 to `max` visible ASCII characters (no space, no control).
pub(crate) fn visible_ascii(s: &str, max: usize) -> bool {
    !s.is_empty() && s.len() <= max && s.chars().all(|c| c.is_ascii_graphic())
}

/// Waits until the renewer reports, at most `d`.
async fn wait_renewal(q: &Quota, cost: i64, d: Duration) {
    let n = q.renewed.notified();
    tokio::pin!(n);
    n.as_mut().enable();
    quotas::set_waiting(q, cost);
    q.wake.notify_one();
    let _ = tokio::time::timeout(d, n).await;
}

/// The limit a shadow-mode policy would have refused with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shadow {
    /// The key's bucket was short (`429 per_key_limited` if enforced).
    PerKey,
    /// The quota's pool was empty (`429 quota_exhausted` if enforced).
    Quota,
}

impl Shadow {
    /// The `limit` an enforced policy's 429 would name.
    pub fn limit(self, resource: &str) -> &str {
        match self {
            Shadow::PerKey => "per_key",
            Shadow::Quota => resource,
        }
    }

    /// The refusal a shadow-mode policy turns into an admit, if `e` is one:
    /// only the 429s (a 503 is no decision, and a shadow policy cannot
    /// decide either).
    pub fn of(e: &Error) -> Option<Shadow> {
        match e {
            Error::KeyLimited { .. } => Some(Shadow::PerKey),
            Error::Exhausted { .. } => Some(Shadow::Quota),
            _ => None,
        }
    }
}

/// One quota's part of an admit, and whether it is one only because the
/// policy is in shadow mode (then nothing was debited on that quota: its
/// decision was a refusal).
#[derive(Debug, Clone, PartialEq)]
pub struct Paid {
    pub admit: Admit,
    pub shadow: Option<Shadow>,
    /// Unleased tokens of the quota's pool in the admit's window as the
    /// allocator last said (0 when unknown): what other leases may still
    /// bring the region beyond its own balance.
    pub pool_room: i64,
}

impl Paid {
    /// The outcome label of this quota's part.
    pub fn outcome(&self) -> &'static str {
        match (&self.shadow, self.admit.source.as_str()) {
            (Some(_), _) => "shadow_refused",
            (None, "fallback") => "fallback",
            (None, _) => "lease",
        }
    }

    /// What the quota can still admit as the agent knows it: the region's
    /// balance after this admit plus what the pool held unleased at the
    /// last grant. Other regions may have taken some of that since, but it
    /// is never 0 while the pool was last known to have room (a client
    /// told `r=0` slows down for nothing).
    pub fn quota_left(&self) -> i64 {
        self.admit.remaining.max(0).saturating_add(self.pool_room)
    }

    /// What the `RateLimit` headers show of this part: what the quota can
    /// still admit ([`Paid::quota_left`]; none after a key's shadow
    /// refusal, which, as a refusal, says nothing of it) and the key's
    /// bucket.
    pub fn shown(&self) -> (Option<i64>, Option<i64>) {
        let remaining = match self.shadow {
            Some(Shadow::PerKey) => None,
            _ => Some(self.quota_left()),
        };
        (remaining, self.admit.key_remaining)
    }
}

/// What the `RateLimit` headers show after refusal `e`: a key's refusal
/// says nothing of the quota's balance (they describe the key's bucket);
/// any other refusal shows the quota empty.
pub fn refusal_shown(e: &Error) -> (Option<i64>, Option<i64>) {
    match e {
        Error::KeyLimited { remaining, .. } => (None, Some(*remaining)),
        _ => (Some(0), None),
    }
}

/// An admit: one part per quota of the request, in its order.
#[derive(Debug, Clone, PartialEq)]
pub struct Decided {
    pub parts: Vec<Paid>,
}

impl Decided {
    /// The part whose most restrictive limit (its pool or its key's
    /// bucket) has the fewest units left: the one the headers describe.
    /// `name(i)` is part `i`'s `<tenant>/<resource>`.
    pub fn tightest(
        &self,
        name: impl Fn(usize) -> String,
        policies: &[PolicyInfo],
        now: chrono::DateTime<chrono::Utc>,
    ) -> usize {
        (0..self.parts.len())
            .min_by_key(|&i| {
                let (r, k) = self.parts[i].shown();
                crate::headers::header_limit(&name(i), policies.get(i).copied(), r, k, now).r
            })
            .unwrap_or(0)
    }
}

/// A refusal, and the index of the quota that refused (none when the
/// agent could not decide for all of them, or before any was looked at).
pub(crate) type Refused = (Error, Option<usize>);

/// A quota of the request with its policy, learned if need be.
async fn learn(app: &AppState, tenant: &str, resource: &str) -> Result<(Arc<Quota>, PolicyInfo)> {
    let unknown = || Error::UnknownQuota(format!("{tenant}/{resource}"));
    if app.unknown.contains(tenant, resource) {
        return Err(unknown());
    }
    let q = renew::quota(app, tenant, resource).ok_or(Error::TooManyQuotas)?;
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
    let Some(p) = policy else {
        return Err(Error::AllocatorUnreachable);
    };
    Ok((q, p))
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
    app: &AppState,
    req: &Acquire,
    policies: &mut Vec<PolicyInfo>,
) -> std::result::Result<Decided, Refused> {
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
        let (q, p) = learn(app, &req.tenant, &w.resource).await.map_err(|e| (e, Some(i)))?;
        policies.push(p);
        check(req, w, p).map_err(|e| (e, Some(i)))?;
        qs.push(q);
    }
    let claimed = match &req.request_id {
        Some(rid) => match claim_request_id(app, req, rid, policies[0]).await {
            Ok(c) => c,
            Err(ClaimError::Mismatch(m)) => return Err((Error::RequestIdMismatch(m), None)),
            Err(ClaimError::Store(e)) => {
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
            if claimed {
                // Only admits are remembered: a refused request may be
                // retried with the same id and another cost.
                let key =
                    app.keys.request_id_claim(&req.tenant, req.request_id.as_deref().unwrap_or_default());
                let _ = crate::commands::forget_request_id(&app.store, &key).await;
            }
            return Err(r);
        }
    };
    // One admit per quota decided, in order; the others are shadow admits.
    let mut admits = admits.into_iter();
    let mut parts = Vec::with_capacity(qs.len());
    for (i, q) in qs.iter().enumerate() {
        let part = match &shadow[i] {
            Some((s, e)) => shadow_admit(app, q, policies[i], *s, e).await,
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

/// Shadow mode: the refusal `e` an enforced policy would answer becomes an
/// admit that debits nothing on the quota, counted for the window's report.
async fn shadow_admit(app: &AppState, q: &Quota, p: PolicyInfo, s: Shadow, e: &Error) -> Paid {
    let ws = Window::containing(app.allocator_now(), p.window_secs).start;
    if let Err(err) = scripts::shadow(&app.store, &q.prefix, ws).await {
        tracing::warn!(tenant = %q.tenant, resource = %q.resource, error = %err, "shadow refusal not counted");
        app.metrics.inc("agent_shadow_uncounted_total", &[]);
    }
    let limit = match s {
        Shadow::PerKey => "per_key",
        Shadow::Quota => "quota",
    };
    app.metrics.inc("agent_shadow_refusals_total", &[("limit", limit)]);
    let key_remaining = match e {
        Error::KeyLimited { remaining, .. } => Some(*remaining),
        _ => None,
    };
    Paid {
        admit: Admit { source: "shadow".into(), window_start: ws, remaining: 0, key_remaining },
        shadow: Some(s),
        pool_room: 0,
    }
}

/// Most spend runs one request makes (a bound on the loop, whatever the
/// clocks do; the time budget normally ends it first).
const MAX_TRIES: usize = 64;

/// What one spend run that found no token saw.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Seen {
    /// ms until a next-window lease opens, or -1.
    pub wait_ms: i64,
    /// > 0: the allocator said the pool is empty, retry after this many ms.
    pub exhausted_ms: i64,
    /// Whether the allocator counts as reachable.
    pub reachable: bool,
    pub fail_mode: FailMode,
    /// Whether this run was allowed to admit from the fallback allowance.
    pub fallback_tried: bool,
}

/// What the request does next.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Step {
    /// A next-window lease opens this soon: sleep, then spend again.
    SleepOpen(Duration),
    /// Wake the renewer and wait for its round, at most this long.
    WaitRenewal(Duration),
    /// Spend again at once (reachability changed: the fallback may admit).
    Again,
    /// `429`: the allocator said the pool is empty.
    Exhausted(i64),
    /// `503`: the agent cannot decide (allocator unreachable and the fail
    /// mode or the allowance says no, or no lease came within the budget).
    Unavailable,
}

/// The acquire rule (docs/guarantees.md, what each event costs): a request
/// with no token waits for the renewer within one time budget; it is
/// answered 429 only when the allocator said the pool is empty, never
/// because a renewal is late (a late renewal ends in 503 once the budget is
/// spent); while the allocator is unreachable the fail mode decides
/// (bounded: the fallback allowance, then 503; strict: 503).
pub fn step(seen: Seen, elapsed: Duration, budget: Duration) -> Step {
    let left = budget.saturating_sub(elapsed);
    if (0..=MAX_OPEN_WAIT_MS).contains(&seen.wait_ms) {
        return Step::SleepOpen(Duration::from_millis(seen.wait_ms as u64 + 2));
    }
    if seen.exhausted_ms > 0 && seen.reachable {
        return Step::Exhausted(seen.exhausted_ms);
    }
    if !seen.reachable {
        if seen.fail_mode == FailMode::Strict || seen.fallback_tried {
            return Step::Unavailable;
        }
        return Step::Again;
    }
    if left.is_zero() {
        return Step::Unavailable;
    }
    Step::WaitRenewal(left)
}

/// Spends on the quotas `active` (indices into `qs`) in one atomic
/// decision, waiting for renewals by [`step`]'s rule. Answers one admit per
/// active quota, in order, or the refusal and the quota that refused.
async fn spend_with_waits(
    app: &AppState,
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
            // The key's own limit: no renewal or fallback changes it.
            Outcome::Ran { value: Spend::KeyLimited { quota, retry_ms, remaining }, .. } => {
                let i = active.get(quota).copied().unwrap_or(active[0]);
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

/// Why a request id could not be claimed.
enum ClaimError {
    Mismatch(String),
    Store(crate::store::StoreError),
}

/// Ties a request id to its request, tenant-wide: the first use records
/// the quotas and costs (until the current window's end plus a margin); a
/// repeat with the same ones proceeds (the spend script answers it with
/// the first decision), one with others is refused. Returns whether this
/// request made the claim.
async fn claim_request_id(
    app: &AppState,
    req: &Acquire,
    rid: &str,
    p: PolicyInfo,
) -> std::result::Result<bool, ClaimError> {
    let key = app.keys.request_id_claim(&req.tenant, rid);
    let value = req.claim();
    let ttl = request_id_ttl_ms(app, p);
    let old =
        crate::commands::claim_request_id(&app.store, &key, &value, ttl).await.map_err(ClaimError::Store)?;
    match old {
        None => Ok(true),
        Some(o) if o == value => Ok(false),
        Some(o) => Err(ClaimError::Mismatch(format!(
            "request_id {rid:?} was first used for {}; this request names {}",
            describe_claim(&o).unwrap_or_else(|| "another request".into()),
            describe_claim(&value).unwrap_or_default(),
        ))),
    }
}

/// A claim's value in words: `resource "read" with cost 1 and key "u"`.
fn describe_claim(v: &str) -> Option<String> {
    let mut parts = Vec::new();
    let mut rest = v;
    let mut key = None;
    loop {
        let (n, after) = rest.split_once(':')?;
        let n: usize = n.parse().ok()?;
        let (res, after) = (after.get(..n)?, after.get(n + 1..)?);
        let end = after.find(['+', ':']).unwrap_or(after.len());
        parts.push(format!("resource {res:?} with cost {}", &after[..end]));
        match after.as_bytes().get(end) {
            Some(b'+') => rest = &after[end + 1..],
            Some(_) => {
                key = after[end + 1..].split_once(':').map(|(_, k)| k.to_string());
                break;
            }
            None => break,
        }
    }
    let key = key.map(|k| format!(" and key {k:?}")).unwrap_or_default();
    Some(format!("{}{key}", parts.join(" + ")))
}

/// How long a request id is remembered: until the end of the window it is
/// decided in, plus a margin for clocks and retries.
fn request_id_ttl_ms(app: &AppState, p: PolicyInfo) -> i64 {
    let now = app.clock.now_utc();
    Window::containing(now, p.window_secs).ms_until_end(now).max(0) + REQUEST_ID_MARGIN_MS
}

/// The agent's own allowance while Redis cannot be used: a request on one
/// quota only (a decision over several needs their shared state).
fn local_fallback(app: &AppState, req: &Acquire, p: PolicyInfo) -> std::result::Result<Decided, Error> {
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
    app: &AppState,
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
        rid_ttl_ms: request_id_ttl_ms(app, ps[i]),
        per_key: ps[i].per_key,
        legacy_fallback: legacy[i],
    };
    let rid = req.request_id.as_deref().map(Keys::request_id_suffix).unwrap_or_default();
    let key = match (active.iter().any(|&i| ps[i].per_key.is_some()), &req.key) {
        (true, Some(k)) => Keys::per_key_suffix(k),
        _ => String::new(),
    };
    let costs = active.iter().map(|&i| req.wants[i].cost).collect();
    let ask = Ask { costs, rid, count_demand, key };
    let sent = Instant::now();
    let r = if let [i] = active {
        let q = qs[*i].clone();
        let run = {
            let (app, q) = (app.clone(), q.clone());
            move |common, asks: Vec<Ask>| {
                let (app, q) = (app.clone(), q.clone());
                async move { spend_run(&app, &[q], &[common], &asks).await }
            }
        };
        batch::spend(&q.spends, app.settings.redis_timeout, common(*i), ask, run).await
    } else {
        let quotas: Vec<Arc<Quota>> = active.iter().map(|&i| qs[i].clone()).collect();
        let commons: Vec<Common> = active.iter().map(|&i| common(i)).collect();
        let bound = app.settings.redis_timeout;
        match tokio::time::timeout(bound, spend_run(app, &quotas, &commons, std::slice::from_ref(&ask))).await
        {
            Ok(r) => batch::first(r),
            Err(_) => Err(crate::store::StoreError::Timeout(bound)),
        }
    };
    app.metrics.observe("agent_acquire_store_seconds", &[], sent.elapsed().as_secs_f64());
    r
}

/// One run of the spend script for `asks` on `quotas`, settled (each
/// quota's token adopted, a loss handled) before its answers go out.
async fn spend_run(
    app: &AppState,
    quotas: &[Arc<Quota>],
    commons: &[Common],
    asks: &[Ask],
) -> batch::RunAnswer {
    app.metrics.inc("agent_spend_runs_total", &[]);
    let tokens: Vec<String> = quotas.iter().map(|q| q.token()).collect();
    let parts: Vec<Part> = quotas
        .iter()
        .zip(commons)
        .zip(&tokens)
        .map(|((q, c), t)| Part { on: On { prefix: &q.prefix, token: t }, common: *c })
        .collect();
    let by = Caller { agent: &app.settings.agent, epoch: app.ident.epoch() };
    let r = scripts::spend(&app.store, by, &parts, asks).await?;
    Ok(match r {
        Outcome::Lost(l) => {
            let o = Outcome::Lost(l.clone());
            if let Some(q) = quotas.get(l.quota) {
                q.settle(&o, &app.ident, &app.metrics);
            }
            o
        }
        Outcome::Ran { value, .. } => {
            for (q, token) in quotas.iter().zip(&value.tokens) {
                q.settle(&Outcome::Ran { token: token.clone(), value: () }, &app.ident, &app.metrics);
            }
            Outcome::Ran { token: value.tokens.first().cloned().unwrap_or_default(), value: value.decisions }
        }
    })
}

#[cfg(test)]
mod step_tests {
    use super::*;

    const B: Duration = Duration::from_millis(600);

    fn seen(
        wait_ms: i64,
        exhausted_ms: i64,
        reachable: bool,
        fail_mode: FailMode,
        fallback_tried: bool,
    ) -> Seen {
        Seen { wait_ms, exhausted_ms, reachable, fail_mode, fallback_tried }
    }

    #[test]
    fn a_next_window_lease_about_to_open_is_waited_for() {
        let s = seen(40, -1, true, FailMode::Bounded, false);
        assert_eq!(step(s, Duration::ZERO, B), Step::SleepOpen(Duration::from_millis(42)));
        // Beyond the longest open wait: the renewer is asked instead.
        let s = seen(MAX_OPEN_WAIT_MS + 1, -1, true, FailMode::Bounded, false);
        assert_eq!(step(s, Duration::ZERO, B), Step::WaitRenewal(B));
    }

    #[test]
    fn a_429_only_when_the_allocator_said_empty() {
        let s = seen(-1, 700, true, FailMode::Strict, false);
        assert_eq!(step(s, Duration::ZERO, B), Step::Exhausted(700));
        // A late renewal is never a 429: wait within the budget, then 503.
        let s = seen(-1, -1, true, FailMode::Strict, false);
        assert_eq!(step(s, Duration::from_millis(100), B), Step::WaitRenewal(Duration::from_millis(500)));
        assert_eq!(step(s, B, B), Step::Unavailable);
        assert_eq!(step(s, B * 3, B), Step::Unavailable);
    }

    #[test]
    fn unreachable_follows_the_fail_mode() {
        // Strict: 503 at once, even with an old "empty" mark.
        assert_eq!(step(seen(-1, -1, false, FailMode::Strict, false), Duration::ZERO, B), Step::Unavailable);
        assert_eq!(step(seen(-1, 500, false, FailMode::Strict, false), Duration::ZERO, B), Step::Unavailable);
        // Bounded: spend again with the fallback; once it was tried, 503.
        assert_eq!(step(seen(-1, -1, false, FailMode::Bounded, false), Duration::ZERO, B), Step::Again);
        assert_eq!(step(seen(-1, -1, false, FailMode::Bounded, true), Duration::ZERO, B), Step::Unavailable);
    }

    #[test]
    fn the_acquire_rule_table() {
        use FailMode::{Bounded, Strict};
        let ms = Duration::from_millis;
        // (case, seen, waited so far, next step), budget B = 600 ms.
        let cases = [
            ("lease opens now", seen(0, -1, true, Strict, false), ms(0), Step::SleepOpen(ms(2))),
            (
                "lease opens at the open-wait limit",
                seen(MAX_OPEN_WAIT_MS, -1, true, Strict, false),
                ms(0),
                Step::SleepOpen(ms(252)),
            ),
            (
                "an opening lease beats an empty mark",
                seen(10, 900, true, Bounded, false),
                ms(0),
                Step::SleepOpen(ms(12)),
            ),
            (
                "an opening lease is waited for even unreachable",
                seen(10, -1, false, Strict, false),
                ms(0),
                Step::SleepOpen(ms(12)),
            ),
            ("pool empty, reachable: 429", seen(-1, 900, true, Bounded, false), ms(0), Step::Exhausted(900)),
            (
                "pool empty after the budget: still 429",
                seen(-1, 900, true, Bounded, false),
                ms(700),
                Step::Exhausted(900),
            ),
            ("no mark (0 ms left): wait", seen(-1, 0, true, Bounded, false), ms(0), Step::WaitRenewal(B)),
            (
                "no token, budget left: wait the rest",
                seen(-1, -1, true, Bounded, false),
                ms(250),
                Step::WaitRenewal(ms(350)),
            ),
            ("no token, budget spent: 503", seen(-1, -1, true, Bounded, false), ms(600), Step::Unavailable),
            ("unreachable, strict: 503", seen(-1, -1, false, Strict, false), ms(0), Step::Unavailable),
            (
                "unreachable, bounded: try the fallback",
                seen(-1, 900, false, Bounded, false),
                ms(0),
                Step::Again,
            ),
            (
                "unreachable, fallback tried and spent: 503",
                seen(-1, -1, false, Bounded, true),
                ms(0),
                Step::Unavailable,
            ),
        ];
        for (case, s, waited, want) in cases {
            assert_eq!(step(s, waited, B), want, "{case}");
        }
    }

    #[test]
    fn the_budget_bounds_every_wait() {
        let s = seen(-1, -1, true, FailMode::Bounded, false);
        let mut waited = Duration::ZERO;
        let mut tries = 0;
        while let Step::WaitRenewal(d) = step(s, waited, B) {
            assert!(d <= B);
            waited += d.max(Duration::from_millis(50));
            tries += 1;
        }
        assert!(waited >= B && tries <= 2, "{waited:?} {tries}");
    }
}
