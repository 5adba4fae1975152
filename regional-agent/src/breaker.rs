//! Capped exponential backoff with jitter and the circuit breaker in front
//! of the allocator (DESIGN §4 Partitions).
//!
//! The breaker opens after [`TRIP_AFTER`] consecutive failures (timeouts,
//! refused connections, 5xx) and stays open for a backoff that grows with
//! each trip, capped at [`OPEN_CAP`]; while open no call leaves the agent, so
//! a down allocator costs the request path nothing. When the open period
//! ends one call goes through (half-open: a single probe, so thousands of
//! quotas do not stampede an allocator that is just coming back); its
//! failure re-opens the breaker for longer, its success closes it. The cap
//! is short because it bounds how long a region keeps refusing after the
//! allocator is back (heal within a second).

use rand::Rng;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Consecutive failures that open the breaker.
pub const TRIP_AFTER: u32 = 2;

/// `min(cap, base · 2^attempt)` with "equal jitter": uniformly in
/// `[d/2, d]`, so retries of many agents spread out but never collapse to 0.
pub fn backoff(attempt: u32, base: Duration, cap: Duration) -> Duration {
    let d = base.saturating_mul(1u32 << attempt.min(16)).min(cap);
    let ms = d.as_millis().max(1) as u64;
    Duration::from_millis(rand::rng().random_range(ms / 2..=ms))
}

#[derive(Debug, Default)]
struct State {
    failures: u32,
    trips: u32,
    open_until: Option<Instant>,
    /// A half-open probe is out until this instant (a probe whose caller
    /// was cancelled never reports, so the slot frees itself).
    probe_until: Option<Instant>,
}

/// The breaker. A std `Mutex`: every operation is a few field updates and
/// is never held across an await.
#[derive(Debug, Default)]
pub struct Breaker {
    state: Mutex<State>,
}

/// Backoff of the first trip.
const OPEN_BASE: Duration = Duration::from_millis(100);
/// Longest the breaker stays open between probes.
pub const OPEN_CAP: Duration = Duration::from_millis(500);
/// Longest a half-open probe holds the probe slot.
const PROBE_GRACE: Duration = Duration::from_secs(2);

impl Breaker {
    /// Whether a call may be made now; while half-open, `true` for one
    /// caller (the probe) only.
    pub fn allow(&self) -> bool {
        let mut s = self.state.lock().unwrap();
        let now = Instant::now();
        match s.open_until {
            None => true,
            Some(t) if now < t => false,
            Some(_) => {
                if s.probe_until.is_some_and(|p| now < p) {
                    return false;
                }
                s.probe_until = Some(now + PROBE_GRACE);
                true
            }
        }
    }

    /// Whether a call could be made now, without taking the probe slot.
    pub fn is_open(&self) -> bool {
        let s = self.state.lock().unwrap();
        s.open_until.is_some_and(|t| Instant::now() < t)
    }

    /// The last call succeeded (or was answered with a 4xx: the allocator is up).
    pub fn success(&self) {
        let mut s = self.state.lock().unwrap();
        *s = State::default();
    }

    /// The last call failed for a reason that means "unreachable".
    pub fn failure(&self) {
        let mut s = self.state.lock().unwrap();
        s.failures = s.failures.saturating_add(1);
        s.probe_until = None;
        if s.failures >= TRIP_AFTER {
            s.open_until = Some(Instant::now() + backoff(s.trips, OPEN_BASE, OPEN_CAP));
            s.trips = s.trips.saturating_add(1);
        }
    }

    /// Whether the allocator counts as reachable: the last call did not fail.
    pub fn reachable(&self) -> bool {
        self.state.lock().unwrap().failures == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_is_capped_and_jittered() {
        let base = Duration::from_millis(100);
        let cap = Duration::from_secs(2);
        for attempt in 0..40 {
            let d = backoff(attempt, base, cap);
            let full = base.saturating_mul(1 << attempt.min(16)).min(cap);
            assert!(d <= full && d >= full / 2, "{attempt}: {d:?}");
        }
    }

    #[test]
    fn breaker_opens_after_consecutive_failures_and_closes_on_success() {
        let b = Breaker::default();
        assert!(b.allow() && b.reachable());
        b.failure();
        assert!(!b.reachable());
        assert!(b.allow(), "one failure does not open it");
        b.failure();
        assert!(!b.allow(), "open after {TRIP_AFTER}");
        b.success();
        assert!(b.allow() && b.reachable());
    }

    #[test]
    fn half_open_lets_one_probe_through_and_the_open_period_is_capped() {
        let b = Breaker::default();
        for _ in 0..40 {
            b.failure();
        }
        assert!(b.is_open() && !b.allow());
        // However many trips, the breaker is open at most OPEN_CAP.
        let until = b.state.lock().unwrap().open_until.unwrap();
        assert!(until <= Instant::now() + OPEN_CAP);
        b.state.lock().unwrap().open_until = Some(Instant::now());
        assert!(b.allow(), "the probe");
        assert!(!b.allow(), "a second caller while the probe is out");
        assert!(!b.reachable());
        b.success();
        assert!(b.allow() && b.allow() && b.reachable(), "closed on the probe's success");
    }

    #[test]
    fn a_failed_probe_reopens() {
        let b = Breaker::default();
        b.failure();
        b.failure();
        b.state.lock().unwrap().open_until = Some(Instant::now());
        assert!(b.allow());
        b.failure();
        assert!(b.is_open() && !b.allow());
    }
}
