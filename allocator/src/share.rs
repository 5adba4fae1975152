//! The demand-weighted share (DESIGN §4), as pure arithmetic so it can be
//! tested without a database.
//!
//! * While the pool can cover every outstanding want (this request's and the
//!   latest want of every other active region), a request gets its want.
//! * Under contention each region is entitled to `limit × its demand / Σ
//!   demand` of the window (proportional share, as in Doorman); a request
//!   gets what is left of its region's entitlement, never below
//!   `min(want, chunk_min)` while tokens remain.
//! * Never above `chunk_max` nor above what is available.
//! * A region with no demand gets at most `chunk_min`, so idle regions park
//!   little.

/// Another region active in the same pool.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OtherRegion {
    /// Its latest stated demand, tokens per second.
    pub demand_per_sec: f64,
    /// Its latest want.
    pub last_want: i64,
}

/// Everything one share decision depends on.
#[derive(Debug, Clone, PartialEq)]
pub struct ShareInput<'a> {
    pub want: i64,
    pub demand_per_sec: f64,
    pub chunk_min: i64,
    pub chunk_max: i64,
    /// The pool's limit in force.
    pub limit: i64,
    /// What the pool can still grant, see [`available`].
    pub available: i64,
    /// This region's `granted − returned` in the window so far.
    pub region_holding: i64,
    pub others: &'a [OtherRegion],
}

/// What a pool can still grant: its limit less the tokens out in leases
/// (`granted − returned`) and the fallback admits reported while the window
/// was open (`fallback_owed`), which were spent from the same limit. Never
/// below 0 (a lowered limit, or a pool spent before the fallback report).
pub fn available(limit: i64, granted: i64, returned: i64, fallback_owed: i64) -> i64 {
    (limit - (granted - returned) - fallback_owed).max(0)
}

/// How much of `fallback_owed` the pool covered: what was left of the limit
/// besides the tokens out in leases. The rest is the overshoot that fallback
/// caused, which I6 bounds by the regions' allowances.
pub fn fallback_repaid(limit: i64, granted: i64, returned: i64, fallback_owed: i64) -> i64 {
    fallback_owed.min((limit - (granted - returned)).max(0))
}

/// Tokens to put into the lease.
pub fn tokens(i: &ShareInput<'_>) -> i64 {
    if i.available <= 0 || i.want <= 0 {
        return 0;
    }
    let want = i.want.min(i.chunk_max);
    let floor = want.min(i.chunk_min);
    let want = if i.demand_per_sec > 0.0 { want } else { floor };
    let outstanding = i.others.iter().fold(want, |acc, o| acc.saturating_add(o.last_want.max(0)));
    let share = if outstanding <= i.available {
        want
    } else {
        let total_demand: f64 =
            i.demand_per_sec + i.others.iter().map(|o| o.demand_per_sec.max(0.0)).sum::<f64>();
        let entitlement = if total_demand > 0.0 {
            (i.limit as f64 * (i.demand_per_sec.max(0.0) / total_demand)).floor() as i64
        } else {
            i.limit / (i.others.len() as i64 + 1)
        };
        let room = (entitlement - i.region_holding).max(0);
        want.min(room).max(floor)
    };
    share.clamp(0, i.available)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input(want: i64, demand: f64, available: i64, holding: i64, others: &[OtherRegion]) -> ShareInput<'_> {
        ShareInput {
            want,
            demand_per_sec: demand,
            chunk_min: 10,
            chunk_max: 500,
            limit: 1000,
            available,
            region_holding: holding,
            others,
        }
    }

    #[test]
    fn fallback_reported_while_open_is_taken_from_the_pool() {
        // 1000, 300 out in leases, 200 admitted from fallback: 500 left.
        assert_eq!(available(1000, 400, 100, 200), 500);
        assert_eq!(fallback_repaid(1000, 400, 100, 200), 200);
        // The pool was spent before the report: nothing left, nothing repaid.
        assert_eq!(available(1000, 1000, 0, 200), 0);
        assert_eq!(fallback_repaid(1000, 1000, 0, 200), 0);
        // Partly spent: the pool covers what it had left.
        assert_eq!(available(1000, 900, 0, 200), 0);
        assert_eq!(fallback_repaid(1000, 900, 0, 200), 100);
        // A lowered limit below what is out: never negative.
        assert_eq!(available(500, 800, 0, 0), 0);
        assert_eq!(fallback_repaid(500, 800, 0, 50), 0);
    }

    #[test]
    fn uncontended_requests_get_their_want_up_to_chunk_max() {
        assert_eq!(tokens(&input(120, 5.0, 1000, 0, &[])), 120);
        assert_eq!(tokens(&input(900, 5.0, 1000, 0, &[])), 500);
    }

    #[test]
    fn never_above_available_and_zero_when_empty() {
        assert_eq!(tokens(&input(120, 5.0, 30, 0, &[])), 30);
        assert_eq!(tokens(&input(120, 5.0, 0, 0, &[])), 0);
        assert_eq!(tokens(&input(120, 5.0, -40, 0, &[])), 0);
    }

    #[test]
    fn contention_shares_the_limit_by_demand() {
        let us = [OtherRegion { demand_per_sec: 500.0, last_want: 150 }];
        // EU (demand 2000 vs 500) is entitled to 800; it holds 600.
        assert_eq!(tokens(&input(500, 2000.0, 250, 600, &us)), 200);
        let eu = [OtherRegion { demand_per_sec: 2000.0, last_want: 500 }];
        // US is entitled to 200 and holds 150.
        assert_eq!(tokens(&input(150, 500.0, 50, 150, &eu)), 50);
    }

    #[test]
    fn contention_never_below_chunk_min_while_tokens_remain() {
        let others = [OtherRegion { demand_per_sec: 1000.0, last_want: 500 }];
        assert_eq!(tokens(&input(100, 1.0, 200, 900, &others)), 10);
        assert_eq!(tokens(&input(5, 1.0, 200, 900, &others)), 5);
    }

    #[test]
    fn idle_region_gets_at_most_chunk_min() {
        assert_eq!(tokens(&input(300, 0.0, 1000, 0, &[])), 10);
    }
}
