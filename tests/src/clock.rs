//! One shifted clock for every process of a test, so a test can have its
//! windows start when it wants instead of waiting for a real UTC boundary.
//!
//! Windows are `[k·W, (k+1)·W)` on the allocator's clock (the database's,
//! I8), and the agents follow it: leases carry their window and relative
//! deadlines; the region's fallback window is Redis `TIME` plus the offset
//! to the allocator's clock that every credited grant records (`clk`, see
//! the agent's `credit.lua`); the renewer's prefetch of the next window
//! reads the agent's own clock. So a [`TestClock`] shifts the in-process
//! allocator (its own clock and its database clock, [`TestClock::shared`])
//! and every agent (`AGENT_TEST_CLOCK_OFFSET_MS`, [`TestClock::agent_env`])
//! by one fixed offset; Redis' clock follows through `clk`. Time still
//! flows at its real pace; nothing jumps.
//!
//! The offset is never negative and below one window. Before a quota's
//! first credit there is no `clk` yet, and the fallback window is Redis'
//! own (the real one): the first touch of a region marks that window's
//! fallback as spent, and with a forward shift that real window is never
//! later than the shifted window the test is in, so the first shifted
//! window the test moves on to is never the one marked. (For the same
//! reason a Redis that restarts empty reads real windows until the next
//! credit; a test doing that must not assert on which window a fallback
//! admit lands in during that time.)

use chrono::{DateTime, Duration as ChronoDuration, Utc};
use quota_shared::clock::{Clock, OffsetClock};
use std::sync::Arc;
use std::time::Duration;

/// The agent's hidden flag, as an environment variable.
pub const AGENT_OFFSET_ENV: &str = "AGENT_TEST_CLOCK_OFFSET_MS";

/// A fixed shift of UTC shared by the allocator and the agents of a test.
#[derive(Clone)]
pub struct TestClock {
    offset_ms: i64,
    clock: Arc<OffsetClock>,
    /// The lead it was set up with, to say when a set-up outlasted it.
    lead: Option<Duration>,
}

impl TestClock {
    /// The real clock (no shift).
    pub fn real() -> TestClock {
        TestClock::shifted_ms(0)
    }

    /// A clock on which the next boundary of `secs`-second windows comes
    /// `lead` from now (the time the test needs to set up before it).
    pub fn boundary_in(secs: i64, lead: Duration) -> TestClock {
        TestClock { lead: Some(lead), ..TestClock::shifted_ms(offset_to_boundary(Utc::now(), secs, lead)) }
    }

    fn shifted_ms(offset_ms: i64) -> TestClock {
        let clock = Arc::new(OffsetClock::new(ChronoDuration::milliseconds(offset_ms)));
        TestClock { offset_ms, clock, lead: None }
    }

    /// The shift, ms.
    pub fn offset_ms(&self) -> i64 {
        self.offset_ms
    }

    /// Now, on this clock.
    pub fn now(&self) -> DateTime<Utc> {
        self.clock.now_utc()
    }

    /// The clock for the in-process allocator (`app::Options::clock`).
    pub fn shared(&self) -> Arc<dyn Clock> {
        self.clock.clone()
    }

    /// The environment variable that shifts an agent by this clock's
    /// offset plus `skew_ms` (a replica whose own clock is off).
    pub fn agent_env(&self, skew_ms: i64) -> (String, String) {
        (AGENT_OFFSET_ENV.to_string(), (self.offset_ms + skew_ms).to_string())
    }

    /// The start of the next `secs`-second window, Unix seconds.
    pub fn next_boundary(&self, secs: i64) -> i64 {
        (self.now().timestamp().div_euclid(secs) + 1) * secs
    }

    /// Sleeps until this clock reads `at` (a condition on time itself).
    pub async fn until(&self, at: DateTime<Utc>) {
        crate::wait::until_utc(at - ChronoDuration::milliseconds(self.offset_ms)).await;
    }

    /// Waits for the start of the next `secs`-second window plus `after`
    /// and returns that window's start (Unix seconds). Without a shift, or
    /// when the set-up outlasted its lead, this is up to a whole window.
    pub async fn next_window(&self, secs: i64, after: Duration) -> i64 {
        let start = self.next_boundary(secs);
        let at = DateTime::from_timestamp(start, 0).expect("window start in range");
        let wait = (at - self.now()).to_std().unwrap_or_default();
        if let Some(lead) = self.lead.filter(|lead| wait > *lead) {
            // Not an error: only slower, as without a shift.
            eprintln!("the set-up outlasted the clock's lead of {lead:?}: {wait:?} to the next boundary");
        }
        self.until(at + ChronoDuration::from_std(after).expect("short delay")).await;
        start
    }
}

/// The shift (ms, in `[0, secs·1000)`) that puts a boundary of
/// `secs`-second windows `lead` after `now`.
fn offset_to_boundary(now: DateTime<Utc>, secs: i64, lead: Duration) -> i64 {
    let window_ms = secs * 1000;
    let at_ms = now.timestamp_millis() + lead.as_millis() as i64;
    (window_ms - at_ms.rem_euclid(window_ms)) % window_ms
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(s).unwrap().with_timezone(&Utc)
    }

    #[test]
    fn the_shift_puts_a_boundary_lead_after_now() {
        for (now, secs, lead_ms) in [
            ("2026-12-05T08:00:00.000Z", 60, 4000),
            ("2026-12-05T08:00:59.999Z", 60, 4000),
            ("2026-12-05T08:00:13.250Z", 20, 0),
            ("2026-12-05T08:00:17.000Z", 45, 2500),
        ] {
            let now = at(now);
            let lead = Duration::from_millis(lead_ms);
            let off = offset_to_boundary(now, secs, lead);
            assert!((0..secs * 1000).contains(&off), "{now} {secs}: {off}");
            let shifted_at_lead = now.timestamp_millis() + lead_ms as i64 + off;
            assert_eq!(shifted_at_lead.rem_euclid(secs * 1000), 0, "{now} {secs}: {off}");
        }
    }

    #[test]
    fn a_boundary_already_at_the_lead_needs_no_shift() {
        assert_eq!(offset_to_boundary(at("2026-12-05T08:00:56Z"), 60, Duration::from_secs(4)), 0);
    }

    #[test]
    fn the_agent_gets_the_offset_plus_its_skew() {
        let c = TestClock::shifted_ms(1234);
        assert_eq!(c.agent_env(0), (AGENT_OFFSET_ENV.to_string(), "1234".to_string()));
        assert_eq!(c.agent_env(-30_000).1, "-28766");
        let drift = (c.now() - Utc::now()).num_milliseconds() - 1234;
        assert!(drift.abs() <= 5, "the clock reads real time plus the offset ({drift} ms off)");
    }
}
