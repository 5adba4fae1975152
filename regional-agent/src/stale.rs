//! Maximum policy age (seed 002 F24): how old the policy an agent holds
//! for a quota is, and what a decision does once it is too old.
//!
//! A policy is confirmed by every grant answer for its quota (the renewing
//! replica writes the instant into the quota's `pol` hash in Redis, so the
//! region's other replicas and a restart read it too). While the allocator
//! answers, an old policy is corrected by the next grant, which a decision
//! with no tokens waits for anyway; so a policy is **stale** only while the
//! allocator is unreachable and its age is above `--max-policy-age-secs`.
//! Then the policy's `on_stale` decides:
//!
//! * `keep`: the last version stays in force (its fallback allowance,
//!   per-key bucket and shadow mode);
//! * `fail_mode`: the policy's fail mode applies to what is left of the
//!   version: `strict` refuses (`503 policy_stale`), `bounded` keeps only
//!   what a lease or the fallback allowance admits, enforced even if the
//!   version was in shadow mode (a shadow version is what F24's stale,
//!   too-loose policy looks like at its worst: it refuses nobody).
//!
//! Ages are wall-clock milliseconds (the region's replicas share them), so
//! a replica whose clock is ahead sees a policy older by that much.

use quota_shared::wire::{FailMode, OnStale};
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// How often the renewing replica rewrites an unchanged policy into Redis
/// only to record that a grant confirmed it (one `HSET` per quota per
/// period; a replica reading it sees an age at most this much too high).
pub const CONFIRM_WRITE_EVERY_MS: i64 = 10_000;

/// What a decision does with the policy it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    /// Not stale: the policy as learnt.
    Fresh,
    /// Stale, `on_stale: keep`: the policy as learnt.
    Kept,
    /// Stale, `on_stale: fail_mode`, `strict`: `503 policy_stale`.
    Refused,
    /// Stale, `on_stale: fail_mode`, `bounded`: enforced as learnt, shadow
    /// mode off.
    Enforced,
}

impl Applied {
    /// The label of `agent_stale_policy_decisions_total{applied}`; `None`
    /// for a fresh policy.
    pub fn label(self) -> Option<&'static str> {
        match self {
            Applied::Fresh => None,
            Applied::Kept => Some("kept"),
            Applied::Refused => Some("refused"),
            Applied::Enforced => Some("enforced"),
        }
    }
}

/// Whether a policy `age_ms` old is stale: only while the allocator is
/// unreachable, past `max_age` (`None`: never). An unknown age (`None`) is
/// not stale.
pub fn is_stale(age_ms: Option<i64>, max_age: Option<Duration>, reachable: bool) -> bool {
    match (age_ms, max_age) {
        (Some(age), Some(max)) => !reachable && age > max.as_millis() as i64,
        _ => false,
    }
}

/// The rule: what a decision does with a policy of the given stale
/// behaviour and fail mode.
pub fn applied(stale: bool, on_stale: OnStale, fail_mode: FailMode) -> Applied {
    match (stale, on_stale, fail_mode) {
        (false, _, _) => Applied::Fresh,
        (true, OnStale::Keep, _) => Applied::Kept,
        (true, OnStale::FailMode, FailMode::Strict) => Applied::Refused,
        (true, OnStale::FailMode, FailMode::Bounded) => Applied::Enforced,
    }
}

/// Wall-clock Unix milliseconds.
pub fn now_ms() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64)
}

/// When a quota's policy was last confirmed, as this replica knows it.
#[derive(Debug, Default)]
pub struct Confirmed {
    /// Unix ms of the latest confirmation (0: none known).
    at_ms: AtomicI64,
    /// Unix ms this replica last wrote a confirmation to Redis.
    written_ms: AtomicI64,
}

impl Confirmed {
    /// A grant answer (or another replica's record, read from Redis)
    /// confirmed the policy at `at_ms`; later confirmations win.
    pub fn saw(&self, at_ms: i64) {
        self.at_ms.fetch_max(at_ms, Ordering::AcqRel);
    }

    /// The latest confirmation, Unix ms (0: none).
    pub fn at_ms(&self) -> i64 {
        self.at_ms.load(Ordering::Acquire)
    }

    /// The policy's age at `now_ms`; `None` when never confirmed.
    pub fn age_ms(&self, now_ms: i64) -> Option<i64> {
        let at = self.at_ms();
        (at > 0).then(|| (now_ms - at).max(0))
    }

    /// Whether the policy is stale at `now_ms` (see [`is_stale`]).
    pub fn stale(&self, now_ms: i64, max_age: Option<Duration>, reachable: bool) -> bool {
        is_stale(self.age_ms(now_ms), max_age, reachable)
    }

    /// Whether a confirmation at `now_ms` should be written to Redis (the
    /// policy changed, or the last write is [`CONFIRM_WRITE_EVERY_MS`]
    /// old); records the write when it answers `true`.
    pub fn due_write(&self, now_ms: i64, changed: bool) -> bool {
        let last = self.written_ms.load(Ordering::Acquire);
        if changed || now_ms - last >= CONFIRM_WRITE_EVERY_MS {
            self.written_ms.store(now_ms, Ordering::Release);
            true
        } else {
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stale_only_while_unreachable_and_past_the_age() {
        let max = Some(Duration::from_secs(60));
        assert!(!is_stale(Some(60_000), max, false), "at the age, not past it");
        assert!(is_stale(Some(60_001), max, false));
        assert!(!is_stale(Some(10 * 60_000), max, true), "reachable: the next grant refreshes it");
        assert!(!is_stale(Some(10 * 60_000), None, false), "--max-policy-age-secs 0: never");
        assert!(!is_stale(None, max, false), "never confirmed: no age");
    }

    #[test]
    fn the_policy_states_what_a_stale_version_does() {
        use FailMode::{Bounded, Strict};
        use OnStale::{FailMode as Fail, Keep};
        let cases = [
            (false, Keep, Strict, Applied::Fresh),
            (false, Fail, Strict, Applied::Fresh),
            (false, Fail, Bounded, Applied::Fresh),
            (true, Keep, Strict, Applied::Kept),
            (true, Keep, Bounded, Applied::Kept),
            (true, Fail, Strict, Applied::Refused),
            (true, Fail, Bounded, Applied::Enforced),
        ];
        for (stale, on_stale, fail_mode, want) in cases {
            assert_eq!(applied(stale, on_stale, fail_mode), want, "{stale} {on_stale:?} {fail_mode:?}");
        }
    }

    #[test]
    fn confirmations_only_move_forward_and_writes_are_spaced() {
        let c = Confirmed::default();
        assert_eq!(c.age_ms(1_000), None);
        c.saw(50_000);
        c.saw(40_000); // an older record read late
        assert_eq!(c.age_ms(65_000), Some(15_000));
        assert_eq!(c.age_ms(10_000), Some(0), "a clock behind the record: age 0, not negative");
        assert!(c.due_write(50_000, false), "never written");
        assert!(!c.due_write(55_000, false));
        assert!(c.due_write(55_000, true), "a changed policy is written at once");
        assert!(!c.due_write(64_999, false));
        assert!(c.due_write(65_000, false));
    }
}
