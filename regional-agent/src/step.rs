//! The pure rule of a request that found no token (docs/guarantees.md,
//! what each event costs): sleep until a next-window lease opens, wait for
//! the renewer, retry on the fallback, or answer 429 or 503. No I/O: the
//! loop that applies it is [`crate::spend`]'s; the table tests below are
//! the rule's specification.

use quota_shared::wire::FailMode;
use std::time::Duration;

/// Most spend runs one request makes (a bound on the loop, whatever the
/// clocks do; the time budget normally ends it first).
pub(crate) const MAX_TRIES: usize = 64;

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

/// Longest a request waits for a next-window lease about to open.
const MAX_OPEN_WAIT_MS: i64 = 250;

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
