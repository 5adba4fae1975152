//! The negative cache (seed 002 F13, game day 2): once a quota's pool is
//! spent and the allocator said so, or a key's bucket is short, this
//! replica refuses the same quota (or key) from memory for a while instead
//! of running the spend script for every attempt of a flood.
//!
//! How long: for a spent pool, the allocator's retry hint, at least
//! [`FLOOR_MS`]; for a key, exactly the bucket's time to refill the cost;
//! never past the end of the window it was refused in. A
//! lease credited to the quota ends a pool hold at once, and so does a
//! renewer round that sees tokens in the region's balance (another
//! replica's lease; rounds run every 50 ms while the quota is in use). The
//! cost of the shortcut is staleness: tokens that reach the region's
//! balance wait at most one renewer round on this replica, and tokens
//! another region releases to the pool wait until the hold ends (at most
//! the allocator's hint, at least [`FLOOR_MS`]); nothing is ever admitted
//! from the cache, so the bound (I6) is untouched.
//!
//! A request with a `request_id` never takes the shortcut: a repeat of an
//! admitted request must get its first answer, which only the script has.
//! Refusals answered here still count as demand (the allocator shares
//! pools by demand): their costs are kept in `Negative::uncounted` and
//! added to the region's demand counter by the renewer's next round.

use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Shortest hold: a flood costs at most one script run per quota per
/// this long.
pub const FLOOR_MS: i64 = 250;
/// Most keys held per quota (a bounded map: a flood of distinct principals
/// cannot grow it; past the bound, keys are decided by the script).
pub const MAX_KEYS: usize = 1024;

/// How long to hold a refusal whose hint is `hint_ms`, `to_end_ms` before
/// its window ends; `None` when the window is over.
pub fn hold_for(hint_ms: i64, to_end_ms: i64) -> Option<Duration> {
    if to_end_ms <= 0 {
        return None;
    }
    Some(Duration::from_millis(hint_ms.max(FLOOR_MS).min(to_end_ms) as u64))
}

/// How long to hold a key's refusal: exactly until its bucket has refilled
/// the cost (`refill_ms`, on the region's Redis clock), no floor (a floor
/// would refuse tokens the bucket already holds), never past the window.
pub fn key_hold_for(refill_ms: i64, to_end_ms: i64) -> Option<Duration> {
    if to_end_ms <= 0 || refill_ms <= 0 {
        return None;
    }
    Some(Duration::from_millis(refill_ms.min(to_end_ms) as u64))
}

/// A key's refusal: costs of at least `cost` are refused until `until`.
#[derive(Debug, Clone, Copy)]
struct KeyHold {
    until: Instant,
    /// When the bucket holds the cost again (the answer's retry hint; the
    /// hold itself may end sooner, at the window's end).
    refilled: Instant,
    cost: i64,
    remaining: i64,
}

/// What a held refusal answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Held {
    /// The pool is spent: retry after this many ms.
    Pool { retry_ms: i64 },
    /// The key's bucket is short: retry after this many ms; whole tokens
    /// left in it when it refused.
    Key { retry_ms: i64, remaining: i64 },
}

/// One quota's held refusals.
#[derive(Debug, Default)]
pub struct Negative {
    pool: Mutex<Option<Instant>>,
    keys: Mutex<HashMap<String, KeyHold>>,
    /// Demand (tokens) of refusals answered from here, not yet counted in
    /// the region's demand counter.
    uncounted: AtomicI64,
}

fn ms(d: Duration) -> i64 {
    d.as_millis().max(1) as i64
}

impl Negative {
    /// The held refusal of a request of `cost` for `key` at `now`, if any.
    pub fn check(&self, key: Option<&str>, cost: i64, now: Instant) -> Option<Held> {
        if let Some(until) = *self.pool.lock().unwrap() {
            if now < until {
                return Some(Held::Pool { retry_ms: ms(until - now) });
            }
        }
        let k = key?;
        let keys = self.keys.lock().unwrap();
        let h = keys.get(k)?;
        (now < h.until && cost >= h.cost).then(|| Held::Key {
            retry_ms: ms(h.refilled.saturating_duration_since(now)),
            remaining: h.remaining,
        })
    }

    /// Holds the pool's refusal for `d` from `now`.
    pub fn hold_pool(&self, d: Duration, now: Instant) {
        *self.pool.lock().unwrap() = Some(now + d);
    }

    /// A lease was credited: the pool has tokens again.
    pub fn clear_pool(&self) {
        *self.pool.lock().unwrap() = None;
    }

    /// Holds `key`'s refusal of `cost` (`remaining` whole tokens left) for
    /// `d` from `now`; expired holds are dropped first, and a full map
    /// holds nothing more.
    pub fn hold_key(&self, key: &str, cost: i64, remaining: i64, refill_ms: i64, d: Duration, now: Instant) {
        let mut keys = self.keys.lock().unwrap();
        if keys.len() >= MAX_KEYS {
            keys.retain(|_, h| h.until > now);
        }
        if keys.len() < MAX_KEYS || keys.contains_key(key) {
            let refilled = now + Duration::from_millis(refill_ms.max(0) as u64);
            keys.insert(key.to_string(), KeyHold { until: now + d, refilled, cost, remaining });
        }
    }

    /// Counts `cost` of a refusal answered from here as demand.
    pub fn add_uncounted(&self, cost: i64) {
        self.uncounted.fetch_add(cost, Ordering::Relaxed);
    }

    /// Takes the demand not yet counted (the caller counts it, or gives it
    /// back with [`Negative::add_uncounted`] when it could not).
    pub fn take_uncounted(&self) -> i64 {
        self.uncounted.swap(0, Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hold_lasts_the_hint_at_least_the_floor_and_never_past_the_window() {
        let d = |ms: u64| Some(Duration::from_millis(ms));
        assert_eq!(hold_for(800, 10_000), d(800));
        assert_eq!(hold_for(10, 10_000), d(FLOOR_MS as u64));
        assert_eq!(hold_for(800, 120), d(120));
        assert_eq!(hold_for(800, 0), None);
        assert_eq!(key_hold_for(5, 10_000), d(5), "a key waits for its refill only");
        assert_eq!(key_hold_for(800, 120), d(120));
        assert_eq!(key_hold_for(0, 10_000), None);
    }

    #[test]
    fn a_pool_hold_refuses_every_key_until_it_ends_or_a_lease_arrives() {
        let n = Negative::default();
        let t0 = Instant::now();
        n.hold_pool(Duration::from_millis(500), t0);
        assert_eq!(n.check(None, 1, t0 + Duration::from_millis(100)), Some(Held::Pool { retry_ms: 400 }));
        assert_eq!(
            n.check(Some("k"), 1, t0 + Duration::from_millis(100)),
            Some(Held::Pool { retry_ms: 400 })
        );
        assert_eq!(n.check(None, 1, t0 + Duration::from_millis(500)), None);
        n.hold_pool(Duration::from_millis(500), t0);
        n.clear_pool();
        assert_eq!(n.check(None, 1, t0), None);
    }

    #[test]
    fn a_key_hold_refuses_that_key_at_that_cost_or_more_only() {
        let n = Negative::default();
        let t0 = Instant::now();
        n.hold_key("alice", 3, 1, 300, Duration::from_millis(300), t0);
        let at = t0 + Duration::from_millis(100);
        assert_eq!(n.check(Some("alice"), 3, at), Some(Held::Key { retry_ms: 200, remaining: 1 }));
        assert_eq!(n.check(Some("alice"), 1, at), None, "a smaller cost may fit the bucket");
        assert_eq!(n.check(Some("bob"), 3, at), None);
        assert_eq!(n.check(None, 3, at), None);
        assert_eq!(n.check(Some("alice"), 3, t0 + Duration::from_millis(300)), None);
        // Held until the window ends (100 ms), answered with the refill (1 s).
        n.hold_key("carol", 1, 0, 1000, Duration::from_millis(100), t0);
        let held = n.check(Some("carol"), 1, t0 + Duration::from_millis(50));
        assert_eq!(held, Some(Held::Key { retry_ms: 950, remaining: 0 }));
    }

    #[test]
    fn the_key_map_is_bounded_and_makes_room_from_expired_holds() {
        let n = Negative::default();
        let t0 = Instant::now();
        for i in 0..MAX_KEYS {
            n.hold_key(&format!("k{i}"), 1, 0, 10, Duration::from_millis(10), t0);
        }
        n.hold_key("late", 1, 0, 10, Duration::from_millis(10), t0);
        assert_eq!(n.check(Some("late"), 1, t0), None, "full: not held");
        let later = t0 + Duration::from_millis(20);
        n.hold_key("late", 1, 0, 10, Duration::from_millis(10), later);
        assert!(n.check(Some("late"), 1, later).is_some(), "expired holds made room");
        assert!(n.keys.lock().unwrap().len() <= MAX_KEYS);
    }

    #[test]
    fn uncounted_demand_is_taken_once() {
        let n = Negative::default();
        n.add_uncounted(2);
        n.add_uncounted(3);
        assert_eq!((n.take_uncounted(), n.take_uncounted()), (5, 0));
    }
}
