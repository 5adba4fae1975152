//! The renewer's rule (DESIGN §4), as pure arithmetic so it can be tested
//! without Redis or an allocator: from the region's balance (the view),
//! the measured demand, the waiting requests, the policy and the renew-ahead
//! horizon, whether to ask for the current window and the next one, and
//! how many tokens each grant asks for.
//!
//! * Only tokens that outlive the horizon count: renewing because the
//!   soonest lease is dying while a fresh one holds plenty would stack a
//!   new lease on every tick until the old one expired.
//! * A grant asks for two horizons of demand (at least 1 % of the limit),
//!   never more than the rest of the window will use (tokens parked at the
//!   boundary are stranded, and while demand is at the limit every
//!   stranded token is an admit another region was refused), never less
//!   than a waiting request needs, never more than the limit.
//! * The next window's lease is prefetched within a lead of two horizons
//!   (at least 500 ms, at most half the window) before the boundary.

use crate::scripts::View;

/// Demand below this (tokens/s) counts as none.
const IDLE_RATE: f64 = 0.05;

/// Everything one renew plan depends on.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PlanInput {
    /// The region's balance as the view script saw it.
    pub view: View,
    /// Region-wide demand, tokens per second.
    pub rate: f64,
    /// Whether `rate` comes from a reading span yet (0 before, whatever
    /// the demand).
    pub measured: bool,
    /// Whether a request waits for a renewal.
    pub waiting: bool,
    /// The largest cost a waiting request needs (≥ 1).
    pub need: i64,
    /// The policy's limit and window length (s).
    pub limit: i64,
    pub window_secs: i64,
    /// The renew-ahead horizon (ms), see [`horizon_ms`].
    pub horizon_ms: f64,
    /// ms until the current window ends.
    pub to_end_ms: i64,
    /// The next window was already prefetched, or the allocator said "too
    /// early" for it a moment ago.
    pub next_held: bool,
}

/// What to ask the allocator for: tokens for the current window and for
/// the next one, each `None` when not wanted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Plan {
    pub current: Option<i64>,
    pub next: Option<i64>,
}

/// The renew-ahead horizon (ms): the configured lead plus three grant round trips.
pub fn horizon_ms(renew_ahead_ms: f64, rtt_ms: f64) -> f64 {
    renew_ahead_ms + 3.0 * rtt_ms
}

/// How long a lease must live for its tokens to count as lasting: the
/// horizon, or to 150 ms before the window's end (a lease that ends with
/// its window lasts as long as it needs to; the next window's lease is the
/// prefetch's business).
pub fn lasting_ms(horizon_ms: f64, to_end_ms: i64) -> i64 {
    (horizon_ms as i64).min(to_end_ms - 150)
}

/// Whether the quota is renewed at all this round: demand, or a waiting request.
pub fn active(rate: f64, waiting: bool) -> bool {
    rate > IDLE_RATE || waiting
}

/// Whether the balance already serves the waiting requests (they are woken).
pub fn serves_waiters(view: &View, waiting: bool, need: i64) -> bool {
    waiting && view.available >= need
}

/// The plan of an active quota's round.
pub fn plan(i: &PlanInput) -> Plan {
    let v = &i.view;
    let need_tokens = i.rate * i.horizon_ms / 1000.0 + 1.0;
    let want_current = v.exhausted_ms <= 0
        && i.to_end_ms > 50
        && ((v.lasting as f64) < need_tokens || (i.waiting && v.available < i.need));
    let window_ms = i.window_secs * 1000;
    let lead_ms = (2.0 * i.horizon_ms).max(500.0).min(window_ms as f64 / 2.0);
    let want_next = i.rate > IDLE_RATE && (i.to_end_ms as f64) <= lead_ms && v.pending == 0 && !i.next_held;
    if !want_current && !want_next {
        return Plan::default();
    }
    let chunk_s = (2.0 * i.horizon_ms / 1000.0).max(1.0);
    let floor = (i.limit / 100).max(1);
    let chunk = ((i.rate * chunk_s).ceil() as i64).max(floor);
    // The 5 % covers the demand estimate's lag; the few extra grants a
    // small region makes near the end are the price. Before the first
    // reading the rate says 0 whatever the demand: the floor then, or a
    // cold burst is fed one token per grant and answered 429.
    let mut rest = (i.rate * (i.to_end_ms as f64 / 1000.0) * 1.05).ceil() as i64 + 1;
    if !i.measured {
        rest = rest.max(floor);
    }
    let current = chunk.min(rest).max(if i.waiting { i.need } else { 1 }).min(i.limit).max(1);
    let next = chunk.min(i.limit).max(1);
    Plan { current: want_current.then_some(current), next: want_next.then_some(next) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A quota of limit 1000 in a 60 s window, 30 s before its end, with a
    /// 500 ms horizon, no balance and a measured demand of 10/s.
    fn base() -> PlanInput {
        PlanInput {
            view: View { ws: -1, life_ms: -1, ..View::default() },
            rate: 10.0,
            measured: true,
            waiting: false,
            need: 1,
            limit: 1000,
            window_secs: 60,
            horizon_ms: 500.0,
            to_end_ms: 30_000,
            next_held: false,
        }
    }

    fn with(f: impl FnOnce(&mut PlanInput)) -> PlanInput {
        let mut i = base();
        f(&mut i);
        i
    }

    fn some(current: Option<i64>, next: Option<i64>) -> Plan {
        Plan { current, next }
    }

    #[test]
    fn the_plan_follows_balance_demand_waiters_and_the_window() {
        let cases: Vec<(&str, PlanInput, Plan)> = vec![
            // Two horizons of demand (10/s × 1 s) but at least 1 % of the limit.
            ("empty balance", base(), some(Some(10), None)),
            ("busier region: two horizons of demand", with(|i| i.rate = 200.0), some(Some(200), None)),
            (
                "enough lasting tokens: nothing",
                with(|i| {
                    i.view.available = 50;
                    i.view.lasting = 50;
                }),
                Plan::default(),
            ),
            (
                "plenty, but in a lease dying within the horizon: renew",
                with(|i| {
                    i.view.available = 50;
                    i.view.lasting = 0;
                }),
                some(Some(10), None),
            ),
            (
                "a waiter needs more than the balance: at least its cost",
                with(|i| {
                    i.view.available = 20;
                    i.view.lasting = 20;
                    i.waiting = true;
                    i.need = 40;
                }),
                some(Some(40), None),
            ),
            (
                "the pool is empty: no current grant until the mark expires",
                with(|i| i.view.exhausted_ms = 300),
                Plan::default(),
            ),
            (
                "the window ends within 50 ms: nothing for it",
                with(|i| i.to_end_ms = 50),
                some(None, Some(10)),
            ),
            (
                // ⌈200/s × 0.4 s × 1.05⌉ + 1, and the next window's chunk.
                "near the end: never more than the rest of the window uses",
                with(|i| {
                    i.rate = 200.0;
                    i.to_end_ms = 400;
                }),
                some(Some(85), Some(200)),
            ),
            (
                "cold burst before the first reading: the floor",
                with(|i| {
                    i.rate = 0.0;
                    i.measured = false;
                    i.waiting = true;
                }),
                some(Some(10), None),
            ),
            (
                "measured idle with a waiter: one token",
                with(|i| {
                    i.rate = 0.0;
                    i.waiting = true;
                }),
                some(Some(1), None),
            ),
            (
                "never above the limit, even for a waiter",
                with(|i| {
                    i.limit = 30;
                    i.waiting = true;
                    i.need = 40;
                    i.rate = 1000.0;
                }),
                some(Some(30), None),
            ),
            (
                "within the lead: prefetch the next window",
                with(|i| {
                    i.to_end_ms = 1000;
                    i.view.available = 50;
                    i.view.lasting = 50;
                }),
                some(None, Some(10)),
            ),
            (
                "next window already prefetched or refused as too early",
                with(|i| {
                    i.to_end_ms = 1000;
                    i.view.lasting = 50;
                    i.next_held = true;
                }),
                Plan::default(),
            ),
            (
                "next-window tokens pending: no second prefetch",
                with(|i| {
                    i.to_end_ms = 1000;
                    i.view.lasting = 50;
                    i.view.pending = 10;
                }),
                Plan::default(),
            ),
            (
                "no demand: no prefetch, whatever the lead",
                with(|i| {
                    i.rate = 0.0;
                    i.to_end_ms = 1000;
                    i.view.lasting = 50;
                }),
                Plan::default(),
            ),
            (
                "the lead is at most half a short window",
                with(|i| {
                    i.window_secs = 1;
                    i.to_end_ms = 600;
                    i.view.lasting = 50;
                }),
                Plan::default(),
            ),
        ];
        for (name, input, want) in cases {
            assert_eq!(plan(&input), want, "{name}");
        }
    }

    #[test]
    fn lasting_tokens_and_activity() {
        assert_eq!(horizon_ms(300.0, 20.0), 360.0);
        // The horizon, or up to 150 ms before the window's end.
        assert_eq!(lasting_ms(500.0, 30_000), 500);
        assert_eq!(lasting_ms(500.0, 400), 250);
        assert!(active(0.06, false) && active(0.0, true) && !active(0.05, false));
        let v = View { available: 3, ..View::default() };
        assert!(serves_waiters(&v, true, 3) && !serves_waiters(&v, true, 4) && !serves_waiters(&v, false, 1));
    }
}
