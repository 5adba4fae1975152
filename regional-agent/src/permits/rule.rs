//! The pure rules of a region's permits (see the module above): how many
//! to ask the allocator for, how long a lease may be trusted here, and how
//! long hand-outs stop after the region's Redis forgot its permits.

use quota_shared::wire::PERMIT_LEASE_SLACK_SECS;
use std::time::Duration;

/// What a lease call is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Goal {
    /// One more permit than the region holds (an acquire found them all
    /// handed out, or the lease too short for one more).
    Grow,
    /// Give back what is not handed out, and renew the lease if it is due.
    Tidy,
}

/// How often the lease of a quota with permits out is renewed: well
/// within [`PERMIT_LEASE_SLACK_SECS`], so that a permit handed out or
/// renewed while the allocator answers always gets its full TTL.
pub const RENEW_EVERY: Duration = Duration::from_secs(10);

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
            let due = lease_in_ms < lease_len_ms(ttl_ms) - RENEW_EVERY.as_millis() as i64;
            if cap > live || (cap > 0 && due) {
                Some(live)
            } else {
                None
            }
        }
    }
}

/// The full length of a permit lease (as the allocator grants it).
pub fn lease_len_ms(ttl_ms: i64) -> i64 {
    ttl_ms + PERMIT_LEASE_SLACK_SECS * 1000
}

/// How long the region may use a lease the allocator said lasts
/// `lease_ms`, answered `elapsed` after the request left: less the time on
/// the way (the allocator's clock started no earlier than the request),
/// one second, and 1 % for clocks that run at different rates.
pub fn trusted_ms(lease_ms: i64, elapsed: Duration) -> i64 {
    let elapsed = i64::try_from(elapsed.as_millis()).unwrap_or(i64::MAX);
    (lease_ms - elapsed - 1000 - lease_ms / 100).max(0)
}

/// How long hand-outs stop after the region's permit state was lost while
/// the allocator still held `held` permits for it: a permit the lost state
/// knew may be held for up to its TTL (renewals included, each at most a
/// TTL from when it was made), so nothing is handed out until then.
pub fn block_ms(held: i64, ttl_ms: i64) -> i64 {
    if held > 0 {
        ttl_ms + 1000
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
        let fresh = lease_len_ms(ttl) - 1000;
        let due = lease_len_ms(ttl) - RENEW_EVERY.as_millis() as i64 - 1;
        assert_eq!(want(Goal::Tidy, 3, 1, fresh, ttl), Some(1));
        assert_eq!(want(Goal::Tidy, 2, 2, fresh, ttl), None);
        assert_eq!(want(Goal::Tidy, 2, 2, due, ttl), Some(2));
        // Nothing held: nothing to renew, nothing to give back.
        assert_eq!(want(Goal::Tidy, 0, 0, 0, ttl), None);
    }

    #[test]
    fn a_lease_is_trusted_for_less_than_the_allocator_said() {
        assert_eq!(trusted_ms(90_000, Duration::from_millis(200)), 90_000 - 200 - 1000 - 900);
        assert_eq!(trusted_ms(500, Duration::from_millis(600)), 0);
    }

    #[test]
    fn a_lost_state_blocks_for_a_ttl_only_when_permits_were_held() {
        assert_eq!(block_ms(0, 60_000), 0);
        assert_eq!(block_ms(2, 60_000), 61_000);
    }
}
