//! What the agent knows about each quota: the policy learnt from grant
//! answers (also cached in Redis for the other replicas and for restarts
//! during a partition), the incarnation token of the quota's Redis state,
//! measured demand and the renewer's last view.
//!
//! Bounds (F14): a quota whose policy is known stays while it is used and
//! leaves the map (and the agent's quota set in Redis) once it has been
//! idle for [`IDLE_EVICT`] with nothing left to report and no live lease,
//! so the map follows the quotas in use, without a fixed cap that could
//! lock a real quota out. A quota still learning its policy (one grant
//! away from knowing whether it exists) counts against [`MAX_LEARNING`];
//! a 404 from the allocator removes it at once and remembers the name in
//! the [`Unknown`] negative cache, so unknown names leave no Redis key, no
//! registry entry and no task behind.

use crate::batch::SpendQueue;
use crate::identity::Identity;
use crate::scripts::{Bucket, LossCause, Outcome, View};
use crate::store::Store;
use quota_shared::prom::Registry;
use quota_shared::wire::{FailMode, GrantRequest, GrantResponse, OnStale, Reserve};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tokio::sync::Notify;

/// Most quotas one agent holds while they learn their policy (each is one
/// grant away from knowing); beyond it a new name answers 503 for the
/// moment instead of growing memory.
pub const MAX_LEARNING: usize = 1024;
/// A quota unused this long, with an empty outbox and no live lease, leaves
/// the agent's registry.
pub const IDLE_EVICT: std::time::Duration = std::time::Duration::from_secs(300);
/// How long a 404 from the allocator is remembered for a quota name.
pub const UNKNOWN_TTL: std::time::Duration = std::time::Duration::from_secs(5);
/// Most names the negative cache holds.
pub const MAX_UNKNOWN: usize = 4096;

/// [`PolicyInfo::held`] of a policy of `limit` with `reserves`.
pub fn held_by_priority(limit: i64, reserves: &[Reserve]) -> [i64; 5] {
    [0u8, 1, 2, 3, 4].map(|p| Reserve::held(limit, reserves, p))
}

/// The `held` field of the `pol` hash: five comma-separated counts.
fn parse_held(v: &str) -> Option<[i64; 5]> {
    let parts: Vec<i64> =
        v.split(',').map(|p| p.parse::<i64>().ok().filter(|n| *n >= 0)).collect::<Option<_>>()?;
    parts.try_into().ok()
}

/// The `pol` hash's field holding when a grant answer last confirmed the
/// policy (Unix ms, the writer's wall clock).
const CONFIRMED_FIELD: &str = "confirmed_at_ms";

/// A quota's policy as the grant answers show it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PolicyInfo {
    pub limit: i64,
    pub window_secs: i64,
    pub fail_mode: FailMode,
    pub fallback_allowance: i64,
    pub version: i64,
    /// The per-key bucket, if the policy has one.
    pub per_key: Option<Bucket>,
    /// `false`: shadow mode (refuse nobody, count what would be refused).
    pub enforce: bool,
    /// What a decision does once the policy is stale (see [`crate::stale`]).
    pub on_stale: OnStale,
    /// Tokens of the window a request of each priority (0 to 4) may not
    /// take: the reserves kept for more important priorities
    /// ([`Reserve::held`]); all 0 without reserves.
    pub held: [i64; 5],
}

impl PolicyInfo {
    /// The policy a grant answer carries.
    pub fn from_grant(g: &GrantResponse) -> PolicyInfo {
        PolicyInfo {
            limit: g.pool.limit,
            window_secs: (g.window_end - g.window_start).num_seconds().max(1),
            fail_mode: g.fail_mode,
            fallback_allowance: g.fallback_allowance,
            version: g.policy_version,
            per_key: g.per_key.map(|k| Bucket { rate_milli: k.rate_milli().max(1), burst: k.burst.max(1) }),
            enforce: g.enforce,
            on_stale: g.on_stale,
            held: held_by_priority(g.pool.limit, &g.reserve),
        }
    }

    /// Fields of the Redis `pol` hash.
    pub fn to_fields(self) -> Vec<(&'static str, String)> {
        vec![
            ("limit", self.limit.to_string()),
            ("window_secs", self.window_secs.to_string()),
            ("fail_mode", self.fail_mode.as_str().to_string()),
            ("fallback_allowance", self.fallback_allowance.to_string()),
            ("version", self.version.to_string()),
            // "0" for none: HSET must overwrite a bucket the policy dropped.
            ("per_key_rate_milli", self.per_key.map_or(0, |b| b.rate_milli).to_string()),
            ("per_key_burst", self.per_key.map_or(0, |b| b.burst).to_string()),
            ("enforce", if self.enforce { "1" } else { "0" }.to_string()),
            ("on_stale", self.on_stale.as_str().to_string()),
            ("held", self.held.map(|h| h.to_string()).join(",")),
        ]
    }

    /// Reads the Redis `pol` hash.
    pub fn from_fields(m: &HashMap<String, String>) -> Option<PolicyInfo> {
        let int = |k: &str| m.get(k).and_then(|v| v.parse::<i64>().ok());
        let p = PolicyInfo {
            limit: int("limit")?,
            window_secs: int("window_secs")?,
            fail_mode: FailMode::parse(m.get("fail_mode")?)?,
            fallback_allowance: int("fallback_allowance")?,
            version: int("version")?,
            // Absent (written by an agent before per-key limits) or 0: none.
            per_key: match (int("per_key_rate_milli"), int("per_key_burst")) {
                (Some(rate_milli), Some(burst)) if rate_milli > 0 && burst > 0 => {
                    Some(Bucket { rate_milli, burst })
                }
                _ => None,
            },
            // Absent (written before shadow mode): enforced.
            enforce: m.get("enforce").is_none_or(|v| v != "0"),
            // Absent (written before maximum policy age): keep.
            on_stale: m.get("on_stale").and_then(|v| OnStale::parse(v)).unwrap_or_default(),
            // Absent (written before reserves): none.
            held: m.get("held").and_then(|v| parse_held(v)).unwrap_or_default(),
        };
        quota_shared::window::valid_window_secs(p.window_secs).then_some(p)
    }
}

/// Demand measurement from the region-wide demand counter.
#[derive(Debug, Default)]
pub struct Demand {
    last_total: Option<(i64, Instant)>,
    /// Tokens per second, exponentially weighted (time constant 1 s).
    pub rate: f64,
    /// Whether `rate` comes from a reading span yet (false for the first
    /// quarter second of a quota's life in this process: `rate` is 0 then,
    /// whatever the demand).
    pub measured: bool,
}

impl Demand {
    /// Folds in a new reading of the cumulative counter.
    pub fn sample(&mut self, total: i64, at: Instant) {
        if let Some((prev, t)) = self.last_total {
            let dt = at.duration_since(t).as_secs_f64();
            // Readings come every few tens of ms; over so short a span one
            // request looks like a burst of 50/s, and the burst rule below
            // would inflate a slow region's demand, so its leases, and strand
            // tokens other regions need (DESIGN §4 skew).
            if dt >= MIN_SAMPLE_SECS {
                let inst = ((total - prev).max(0)) as f64 / dt;
                let alpha = 1.0 - (-dt).exp();
                self.rate += alpha * (inst - self.rate);
                // A burst should be seen at once, a lull fade smoothly.
                if inst > self.rate {
                    self.rate = self.rate.max(inst * 0.5);
                }
                self.last_total = Some((total, at));
                self.measured = true;
            }
        } else {
            self.last_total = Some((total, at));
        }
    }
}

/// Shortest span a demand reading is taken over.
const MIN_SAMPLE_SECS: f64 = 0.25;

/// Renewal bookkeeping of one quota.
#[derive(Debug, Default)]
pub struct RenewState {
    /// Consecutive failed renewals, for the backoff.
    pub failures: u32,
    /// No renewal before this instant (backoff).
    pub not_before: Option<Instant>,
    /// The backoff was taken because the allocator did not answer: it ends
    /// when the allocator answers again.
    pub unreachable: bool,
    /// The next window (start) already prefetched.
    pub prefetched: Option<i64>,
    /// No `"next"` request before this instant (the allocator said too early).
    pub next_not_before: Option<Instant>,
    /// Smoothed grant round trip, ms.
    pub rtt_ms: f64,
    /// A grant whose answer never came (timeout, reset, 5xx), with when it
    /// was first sent: the next attempt resends it unchanged, so that a
    /// grant that did commit is replayed (I3) instead of debited twice.
    pub unanswered: Option<(GrantRequest, Instant)>,
    /// When the renewer last read the policy record other replicas keep in
    /// Redis (see [`POLICY_REREAD`]).
    pub policy_read_at: Option<Instant>,
}

/// How often a quota's renewer reads the region's policy record: a
/// replica that does not hold the renew lock gets no grant answers, and
/// learns a new version and the last confirmation from that record.
pub const POLICY_REREAD: std::time::Duration = std::time::Duration::from_secs(5);

/// One quota.
pub struct Quota {
    pub tenant: String,
    pub resource: String,
    /// Key prefix from [`crate::keys::Keys::quota`].
    pub prefix: String,
    /// Incarnation token of the quota's Redis state ('' or '?' before first touch).
    pub token: Mutex<String>,
    pub policy: Mutex<Option<PolicyInfo>>,
    pub view: Mutex<View>,
    pub demand: Mutex<Demand>,
    pub renew: Mutex<RenewState>,
    /// Set while a request waits for a renewal.
    pub waiting: AtomicBool,
    /// The largest cost a waiting request needs (a lease with fewer tokens
    /// does not serve it, so the renewer asks for at least this many).
    pub waiting_need: AtomicI64,
    /// The allocator answered 404 for this quota; until then answer 404.
    pub unknown_until: Mutex<Option<Instant>>,
    pub last_used: Mutex<Instant>,
    /// Request path → renewer.
    pub wake: Notify,
    /// Renewer → waiting requests.
    pub renewed: Notify,
    /// Requests waiting for the quota's next spend run (see [`crate::batch`]).
    pub spends: Arc<SpendQueue>,
    /// The quota's legacy-layout keys were found empty after the region's
    /// legacy gate passed (see [`crate::legacy`]): not swept again while
    /// the gate stays passed.
    pub legacy_done: AtomicBool,
    /// What the allocator last said the quota's pools still hold unleased
    /// (the `RateLimit` header's `r` adds it to the region's balance).
    pub pool_seen: Mutex<PoolSeen>,
    /// Refusals this replica answers from memory for a while (see
    /// [`crate::negative`]).
    pub negative: crate::negative::Negative,
    /// When a grant answer last confirmed the policy (see [`crate::stale`]).
    pub confirmed: crate::stale::Confirmed,
}

impl Quota {
    /// The policy, if known.
    pub fn policy(&self) -> Option<PolicyInfo> {
        *self.policy.lock().unwrap()
    }

    /// The incarnation token to send.
    pub fn token(&self) -> String {
        self.token.lock().unwrap().clone()
    }

    /// Whether the allocator recently said the quota does not exist.
    pub fn unknown(&self) -> bool {
        self.unknown_until.lock().unwrap().is_some_and(|t| Instant::now() < t)
    }

    /// The one place a script's word on the quota's incarnation reaches
    /// the agent: adopts the token the script ran on (or found), and for a
    /// loss says what it means. A certain loss (2) and a rollback (3, the
    /// server's history changed and the state was stranded) take a new
    /// epoch, as does a credit that found another incarnation (its lease
    /// is stranded); a first touch of a fresh region (1) needs nothing.
    pub fn settle<T>(&self, o: &Outcome<T>, ident: &Identity, metrics: &Registry) {
        let (token, cause) = match o {
            Outcome::Ran { token, .. } => (token, None),
            Outcome::Lost(l) => (&l.token, Some(l.cause)),
        };
        if !token.is_empty() {
            let mut t = self.token.lock().unwrap();
            if *t != *token {
                t.clone_from(token);
            }
        }
        match cause {
            None | Some(LossCause::Installed) => {}
            Some(LossCause::RolledBack) => {
                metrics.inc("agent_redis_rollbacks_total", &[]);
                tracing::warn!(tenant = %self.tenant, resource = %self.resource,
                    "the region's Redis went back in time (restart, restored snapshot, failover or eviction): \
                     live balances stranded, the window's fallback counted as spent; re-registering");
                ident.request_register();
            }
            Some(LossCause::Lost) => {
                tracing::warn!(tenant = %self.tenant, resource = %self.resource, "Redis state of the quota was lost; re-registering");
                ident.request_register();
            }
            Some(LossCause::Moved) => ident.request_register(),
        }
    }

    /// Reads the policy other replicas cached in Redis; keeps it unless
    /// the one known is as new. The record's confirmation instant counts
    /// too (a record written before maximum policy age has none: it counts
    /// as confirmed when first read, so an upgrade does not make every
    /// cached policy stale at once).
    pub async fn load_policy(&self, store: &Store) -> Option<PolicyInfo> {
        let m = crate::commands::policy_read(store, &self.prefix).await.ok()?;
        let p = PolicyInfo::from_fields(&m)?;
        match m.get(CONFIRMED_FIELD).and_then(|v| v.parse::<i64>().ok()) {
            Some(at) => self.confirmed.saw(at),
            None if self.confirmed.at_ms() == 0 => self.confirmed.saw(crate::stale::now_ms()),
            None => {}
        }
        let mut cur = self.policy.lock().unwrap();
        // The same version with other fields: the record was written from
        // a grant answer this replica has not seen (one that carried the
        // version's reserves or stale behaviour, say), so it is adopted.
        if adopts(*cur, &p) {
            *cur = Some(p);
        }
        *cur
    }

    /// Keeps the policy a grant answer shows, locally and in Redis for the
    /// other replicas (with the instant it was confirmed, rewritten at most
    /// every [`crate::stale::CONFIRM_WRITE_EVERY_MS`] while unchanged), and
    /// (locally) what it said the pool still holds.
    pub async fn learn_policy(&self, store: &Store, g: &GrantResponse) {
        let now_ms = crate::stale::now_ms();
        self.confirmed.saw(now_ms);
        self.pool_seen.lock().unwrap().saw(g.window_start.timestamp(), g.pool.available);
        let p = PolicyInfo::from_grant(g);
        let changed = {
            let mut cur = self.policy.lock().unwrap();
            let changed = adopts(*cur, &p);
            if changed {
                *cur = Some(p);
            }
            changed
        };
        if self.confirmed.due_write(now_ms, changed) {
            // Unchanged: the confirmation alone, so that a replica holding
            // an older version in memory never writes it back over a newer one.
            let mut fields = if changed { p.to_fields() } else { Vec::new() };
            fields.push((CONFIRMED_FIELD, now_ms.to_string()));
            let _ = crate::commands::policy_write(store, &self.prefix, &fields).await;
        }
    }
}

/// Whether a replica holding `cur` takes `p`: versions only move forward
/// (a late or replayed grant answer of an older version, e.g. the candidate
/// of a rollout halted since, is ignored); the same version with other
/// fields is adopted (a record written from an answer that carried the
/// version's reserves or stale behaviour).
pub fn adopts(cur: Option<PolicyInfo>, p: &PolicyInfo) -> bool {
    cur.is_none_or(|c| c != *p && c.version <= p.version)
}

/// Unleased tokens of the quota's pool per window, as the allocator's last
/// grant answer for that window said: of the current window and the next
/// at most (older windows are of no use to a decision).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct PoolSeen {
    /// `(window start, unix s; tokens available)`, newest window last.
    windows: Vec<(i64, i64)>,
}

impl PoolSeen {
    /// Windows remembered.
    const KEEP: usize = 2;

    /// A grant answer for the window starting at `window_start` said the
    /// pool holds `available` more tokens.
    pub fn saw(&mut self, window_start: i64, available: i64) {
        let available = available.max(0);
        match self.windows.iter_mut().find(|(w, _)| *w == window_start) {
            Some(seen) => seen.1 = available,
            None => {
                self.windows.push((window_start, available));
                self.windows.sort_unstable();
                if self.windows.len() > Self::KEEP {
                    self.windows.remove(0);
                }
            }
        }
    }

    /// Tokens the pool of the window starting at `window_start` still held
    /// unleased when last heard of; 0 when never heard of.
    pub fn room(&self, window_start: i64) -> i64 {
        self.windows.iter().find(|(w, _)| *w == window_start).map_or(0, |(_, a)| *a)
    }
}

/// The bounded map of quotas.
#[derive(Default)]
pub struct Quotas {
    map: Mutex<HashMap<(String, String), Arc<Quota>>>,
}

impl Quotas {
    /// The quota, and whether it was created now; `None` when
    /// [`MAX_LEARNING`] quotas are still learning their policy (unless
    /// `known`: a quota from the agent's quota set exists, whatever its
    /// policy cache says, and must be loaded for its outbox to drain).
    pub fn get_or_create(
        &self,
        tenant: &str,
        resource: &str,
        prefix: impl FnOnce() -> String,
        first_token: &str,
        known: bool,
    ) -> Option<(Arc<Quota>, bool)> {
        let mut m = self.map.lock().unwrap();
        if let Some(q) = m.get(&(tenant.to_string(), resource.to_string())) {
            return Some((q.clone(), false));
        }
        if !known
            && m.len() >= MAX_LEARNING
            && m.values().filter(|q| q.policy().is_none()).count() >= MAX_LEARNING
        {
            return None;
        }
        let q = Arc::new(Quota {
            tenant: tenant.to_string(),
            resource: resource.to_string(),
            prefix: prefix(),
            token: Mutex::new(first_token.to_string()),
            policy: Mutex::new(None),
            view: Mutex::new(View { ws: -1, life_ms: -1, ..Default::default() }),
            demand: Mutex::new(Demand::default()),
            renew: Mutex::new(RenewState::default()),
            waiting: AtomicBool::new(false),
            waiting_need: AtomicI64::new(0),
            unknown_until: Mutex::new(None),
            last_used: Mutex::new(Instant::now()),
            wake: Notify::new(),
            renewed: Notify::new(),
            spends: Arc::new(SpendQueue::default()),
            legacy_done: AtomicBool::new(false),
            pool_seen: Mutex::new(PoolSeen::default()),
            negative: Default::default(),
            confirmed: Default::default(),
        });
        m.insert((tenant.to_string(), resource.to_string()), q.clone());
        Some((q, true))
    }

    /// Removes `q` if it is still the registered object of its name.
    pub fn remove(&self, q: &Arc<Quota>) -> bool {
        let mut m = self.map.lock().unwrap();
        let key = (q.tenant.clone(), q.resource.clone());
        if m.get(&key).is_some_and(|cur| Arc::ptr_eq(cur, q)) {
            m.remove(&key);
            return true;
        }
        false
    }

    /// Whether `q` is the registered object of its name (its renewer stops
    /// once it is not).
    pub fn holds(&self, q: &Arc<Quota>) -> bool {
        self.map
            .lock()
            .unwrap()
            .get(&(q.tenant.clone(), q.resource.clone()))
            .is_some_and(|cur| Arc::ptr_eq(cur, q))
    }

    /// How many quotas the agent holds.
    pub fn len(&self) -> usize {
        self.map.lock().unwrap().len()
    }

    /// Whether the agent holds no quota.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Every quota.
    pub fn all(&self) -> Vec<Arc<Quota>> {
        let mut v: Vec<_> = self.map.lock().unwrap().values().cloned().collect();
        v.sort_by(|a, b| (&a.tenant, &a.resource).cmp(&(&b.tenant, &b.resource)));
        v
    }
}

/// The negative cache of quota names the allocator answered 404 for:
/// at most [`MAX_UNKNOWN`] names, each for [`UNKNOWN_TTL`].
#[derive(Default)]
pub struct Unknown {
    map: Mutex<HashMap<(String, String), Instant>>,
}

impl Unknown {
    /// Whether the name was answered 404 within the last [`UNKNOWN_TTL`].
    pub fn contains(&self, tenant: &str, resource: &str) -> bool {
        let m = self.map.lock().unwrap();
        m.get(&(tenant.to_string(), resource.to_string())).is_some_and(|until| Instant::now() < *until)
    }

    /// Remembers a 404. When full, expired names go first, then (a flood of
    /// fresh names) everything: forgetting only costs one more grant call.
    pub fn insert(&self, tenant: &str, resource: &str) {
        let now = Instant::now();
        let mut m = self.map.lock().unwrap();
        if m.len() >= MAX_UNKNOWN {
            m.retain(|_, until| now < *until);
            if m.len() >= MAX_UNKNOWN {
                m.clear();
            }
        }
        m.insert((tenant.to_string(), resource.to_string()), now + UNKNOWN_TTL);
    }

    /// How many names are cached.
    pub fn len(&self) -> usize {
        self.map.lock().unwrap().len()
    }

    /// Whether no name is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Marks a quota as waited on by a request of `cost` (the renewer then
/// renews even without measured demand, for at least `cost` tokens).
pub fn set_waiting(q: &Quota, cost: i64) {
    q.waiting_need.fetch_max(cost, Ordering::SeqCst);
    q.waiting.store(true, Ordering::SeqCst);
}

/// The renewer served the waiters (or gave up on this round).
pub fn clear_waiting(q: &Quota) {
    q.waiting.store(false, Ordering::SeqCst);
    q.waiting_need.store(0, Ordering::SeqCst);
}

#[cfg(test)]
mod tests {
    use super::PoolSeen;

    #[test]
    fn pool_seen_keeps_the_last_word_of_the_two_newest_windows() {
        let mut p = PoolSeen::default();
        assert_eq!(p.room(60), 0, "never heard of: nothing assumed");
        p.saw(60, 900);
        p.saw(60, 850);
        assert_eq!(p.room(60), 850, "the last answer of a window wins");
        p.saw(120, 1000);
        assert_eq!((p.room(60), p.room(120)), (850, 1000));
        p.saw(180, 5);
        assert_eq!((p.room(60), p.room(120), p.room(180)), (0, 1000, 5), "the oldest window goes");
        p.saw(180, -3);
        assert_eq!(p.room(180), 0, "never negative");
    }

    use super::*;
    use std::time::Duration;

    #[test]
    fn the_learning_cap_holds_new_names_but_not_quotas_the_agent_already_knew() {
        let qs = Quotas::default();
        for i in 0..MAX_LEARNING {
            assert!(qs.get_or_create("t", &format!("r{i}"), || format!("p{i}"), "", false).is_some());
        }
        assert!(qs.get_or_create("t", "new", || "p".into(), "", false).is_none(), "cap reached");
        // Reloaded from the agent's quota set at a restart: its outbox must drain.
        let (q, created) = qs.get_or_create("t", "known", || "p".into(), "", true).expect("known quota");
        assert!(created && qs.holds(&q));
        assert_eq!(qs.len(), MAX_LEARNING + 1);
    }

    #[test]
    fn demand_follows_a_steady_rate() {
        let mut d = Demand::default();
        let t0 = Instant::now();
        for i in 0..=50 {
            d.sample(i * 10, t0 + Duration::from_millis(i as u64 * 100));
        }
        assert!((d.rate - 100.0).abs() < 5.0, "{}", d.rate);
    }

    #[test]
    fn a_slow_trickle_read_every_20_ms_is_not_mistaken_for_bursts() {
        let mut d = Demand::default();
        let t0 = Instant::now();
        // One request every 50 ms (20/s), the counter read every 20 ms.
        for i in 0..=250u64 {
            d.sample((i * 20 / 50) as i64, t0 + Duration::from_millis(i * 20));
        }
        assert!((d.rate - 20.0).abs() < 3.0, "{}", d.rate);
    }

    #[test]
    fn the_negative_cache_stays_bounded_and_forgets() {
        let u = Unknown::default();
        for i in 0..(MAX_UNKNOWN + 10) {
            u.insert("t", &format!("r{i}"));
        }
        assert!(u.len() <= MAX_UNKNOWN, "{}", u.len());
        assert!(u.contains("t", &format!("r{}", MAX_UNKNOWN + 9)));
        assert!(!u.contains("t", "never"));
    }

    #[test]
    fn versions_only_move_forward() {
        let v = |version: i64, limit: i64| PolicyInfo {
            limit,
            window_secs: 60,
            fail_mode: FailMode::Strict,
            fallback_allowance: 0,
            version,
            per_key: None,
            enforce: true,
            on_stale: Default::default(),
            held: [0; 5],
        };
        assert!(adopts(None, &v(2, 10)));
        // A rollout's candidate 2 (limit 10), then the halt's 3 (limit 1000):
        // a late answer naming 2 changes nothing.
        assert!(adopts(Some(v(2, 10)), &v(3, 1000)));
        assert!(!adopts(Some(v(3, 1000)), &v(2, 10)));
        // The same version seen again: nothing to do; with other fields: taken.
        assert!(!adopts(Some(v(3, 1000)), &v(3, 1000)));
        assert!(adopts(Some(v(3, 1000)), &PolicyInfo { held: [1, 0, 0, 0, 0], ..v(3, 1000) }));
    }

    #[test]
    fn policy_round_trips_through_redis_fields() {
        let p = PolicyInfo {
            limit: 10,
            window_secs: 60,
            fail_mode: FailMode::Strict,
            fallback_allowance: 0,
            version: 3,
            per_key: None,
            enforce: true,
            on_stale: Default::default(),
            held: [0; 5],
        };
        let fields = |p: PolicyInfo| -> HashMap<String, String> {
            p.to_fields().into_iter().map(|(k, v)| (k.to_string(), v)).collect()
        };
        assert_eq!(PolicyInfo::from_fields(&fields(p)), Some(p));
        let with_key = PolicyInfo { per_key: Some(Bucket { rate_milli: 8000, burst: 8 }), ..p };
        assert_eq!(PolicyInfo::from_fields(&fields(with_key)), Some(with_key));
        // A cache written before per-key limits existed reads as none.
        let mut old = fields(with_key);
        old.remove("per_key_rate_milli");
        old.remove("per_key_burst");
        old.remove("enforce");
        assert_eq!(PolicyInfo::from_fields(&old), Some(p));
        let shadow = PolicyInfo { enforce: false, ..p };
        assert_eq!(PolicyInfo::from_fields(&fields(shadow)), Some(shadow));
        let reserved = PolicyInfo {
            held: held_by_priority(10, &[Reserve { up_to_priority: 1, pct: 20 }]),
            on_stale: OnStale::FailMode,
            ..p
        };
        assert_eq!(reserved.held, [0, 0, 2, 2, 2]);
        assert_eq!(PolicyInfo::from_fields(&fields(reserved)), Some(reserved));
        // A field that does not read holds nothing back (and written before
        // reserves, none is there).
        let mut bad = fields(reserved);
        bad.insert("held".into(), "1,2,x".into());
        assert_eq!(PolicyInfo::from_fields(&bad).map(|p| p.held), Some([0; 5]));
    }
}
