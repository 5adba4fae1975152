//! The pure rules of a region's permits (see the module above): how many
//! to ask the allocator for, how long a lease may be trusted here, and how
//! long hand-outs stop after the region's Redis forgot its permits.

use quota_shared::wire::permit_lease_secs;

/// What a lease call is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Goal {
    /// One more permit than the region holds (an acquire found them all
    /// handed out, or the lease too short for one more).
    Grow,
    /// Give back what is not handed out, and renew the lease if it is due.
    Tidy,
}

/// The full length of a permit lease (ms), as the allocator grants it.
pub fn lease_len_ms(ttl_ms: i64) -> i64 {
    permit_lease_secs(ttl_ms / 1000) * 1000
}

/// Whether a lease with `lease_in_ms` left is due for renewal: once half
/// its slack beyond a TTL is gone, so that a permit handed out or renewed
/// while the allocator answers always gets its full TTL, and renewals come
/// every slack / 2 (15 s for TTLs up to 600 s).
pub fn due(lease_in_ms: i64, ttl_ms: i64) -> bool {
    let slack = lease_len_ms(ttl_ms) - ttl_ms;
    lease_in_ms < ttl_ms + slack / 2
}

/// Permits to ask for, from the region's state: `None` when no call is due.
/// `Grow`: one more than both the lease and the live permits (a lease too
/// short for another permit is renewed with one more in the same call).
/// `Tidy`: the live permits (the rest go back, so another region may take
/// them), when some are idle or the lease is due for renewal; nothing when
/// the region holds none.
pub fn want(goal: Goal, cap: i64, live: i64, lease_in_ms: i64, ttl_ms: i64) -> Option<i64> {
    match goal {
        Goal::Grow => Some(cap.max(live) + 1),
        Goal::Tidy => {
            if cap > live || (cap > 0 && due(lease_in_ms, ttl_ms)) {
                Some(live)
            } else {
                None
            }
        }
    }
}

/// How long the region may use a lease the allocator said lasts
/// `lease_ms`, counted from the region's clock read before the request
/// left (the allocator's count started no earlier): less a second and 1 %
/// for clocks that run at different rates. The slack of a lease
/// ([`permit_lease_secs`]) is always larger than this margin.
pub fn trusted_ms(lease_ms: i64) -> i64 {
    (lease_ms - 1000 - lease_ms / 100).max(0)
}

/// The block a lease call's answer carries to the region's Redis: any
/// conflict's (the state may have been lost since the call planned, and
/// the script sets it only on a state lost when the answer is applied);
/// none for an applied request (the allocator held no lease the region
/// could have forgotten, or the region's record was whole).
pub fn answer_block_ms(conflict: bool, held: i64, lease_ms: i64, longest_ttl_ms: i64) -> i64 {
    if conflict {
        block_ms(held, lease_ms, longest_ttl_ms)
    } else {
        0
    }
}

/// How long hand-outs stop after the region's permit state was lost while
/// the allocator held `held` permits for it under a lease with `lease_ms`
/// left whose permits may live up to `longest_ttl_ms`: a permit the lost
/// state knew may be held until it expires (renewals included, each at
/// most a TTL from when it was made, and never past the lease), so nothing
/// is handed out until then.
pub fn block_ms(held: i64, lease_ms: i64, longest_ttl_ms: i64) -> i64 {
    if held > 0 {
        lease_ms.min(longest_ttl_ms + 1000)
    } else {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grow_asks_one_more_than_the_lease_and_the_live_permits() {
        assert_eq!(want(Goal::Grow, 2, 2, 90_000, 60_000), Some(3));
        assert_eq!(want(Goal::Grow, 0, 0, 0, 60_000), Some(1));
        // A lease lowered below its live permits (a lowered limit) still grows past them.
        assert_eq!(want(Goal::Grow, 1, 3, 90_000, 60_000), Some(4));
    }

    #[test]
    fn tidy_gives_back_idle_permits_and_renews_when_due() {
        let ttl = 60_000;
        let fresh = trusted_ms(lease_len_ms(ttl));
        let due = ttl + 15_000 - 1;
        assert_eq!(want(Goal::Tidy, 3, 1, fresh, ttl), Some(1));
        assert_eq!(want(Goal::Tidy, 2, 2, fresh, ttl), None);
        assert_eq!(want(Goal::Tidy, 2, 2, due, ttl), Some(2));
        // Nothing held: nothing to renew, nothing to give back.
        assert_eq!(want(Goal::Tidy, 0, 0, 0, ttl), None);
    }

    #[test]
    fn every_ttl_leaves_room_for_a_full_permit_after_the_margin_and_renews_before_it_is_short() {
        for ttl_s in [1, 2, 60, 600, 2_870, 3_600, 86_400] {
            let ttl = ttl_s * 1000;
            let trusted = trusted_ms(lease_len_ms(ttl));
            assert!(trusted > ttl, "ttl {ttl_s} s: trusted {trusted} ms");
            // Fresh from the allocator: not due, so the tidy task does not
            // call on every tick.
            assert!(!due(trusted, ttl), "ttl {ttl_s} s");
            // Due while a full permit still fits, two tidy ticks ahead.
            assert!(due(ttl + 4_000, ttl) || lease_len_ms(ttl) - ttl < 8_000, "ttl {ttl_s} s");
        }
    }

    #[test]
    fn a_lease_is_trusted_for_less_than_the_allocator_said() {
        assert_eq!(trusted_ms(90_000), 90_000 - 1000 - 900);
        assert_eq!(trusted_ms(500), 0);
    }

    #[test]
    fn every_conflict_carries_a_block_and_an_applied_request_none() {
        assert_eq!(answer_block_ms(true, 2, 80_000, 60_000), 61_000);
        assert_eq!(answer_block_ms(true, 0, 80_000, 60_000), 0);
        assert_eq!(answer_block_ms(false, 2, 80_000, 60_000), 0);
    }

    #[test]
    fn a_lost_state_blocks_until_its_permits_expired_only_when_permits_were_held() {
        assert_eq!(block_ms(0, 80_000, 60_000), 0);
        assert_eq!(block_ms(2, 80_000, 60_000), 61_000);
        // Never past the lease: its permits cannot outlive it.
        assert_eq!(block_ms(2, 5_000, 60_000), 5_000);
    }
}
