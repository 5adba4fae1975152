//! Shedding by priority (seed 001, issue 30): when this agent's own
//! decisions in flight, or the spend script's recent latency, cross a
//! configured line, the least important requests are answered `503 shed`
//! before any work is done (nothing is charged, nothing reaches Redis or
//! the ledger): priority 4 first, then 3, then 2; 0 and 1 are never shed.
//! Refusing for quota stays a 429; shedding is about this agent's capacity,
//! not the tenant's pool.
//!
//! The rule ([`load`], [`sheds`]) is pure; [`Shedder`] holds the two
//! signals: a count of decisions in flight (exact) and a moving average of
//! the spend script's latency that is only believed while fresh, so that a
//! store that recovered while only sheddable traffic came is probed again
//! instead of being shed forever.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// The most important priority (never shed).
pub const MIN_PRIORITY: u8 = 0;
/// The least important priority (shed first).
pub const MAX_PRIORITY: u8 = 4;
/// A request's priority when it names none.
pub const DEFAULT_PRIORITY: u8 = 2;

/// How old the latency average may be and still count: one second without
/// an observation and the latency signal is ignored until the next one.
const LATENCY_FRESH: Duration = Duration::from_secs(1);

/// The load that sheds each priority: 4 at the line, 3 at a quarter above
/// it, 2 at half above it; 0 and 1 never (`None`).
pub fn shed_from(priority: u8) -> Option<f64> {
    match priority {
        0 | 1 => None,
        2 => Some(1.5),
        3 => Some(1.25),
        _ => Some(1.0),
    }
}

/// The metric label of a priority.
pub fn label(priority: u8) -> &'static str {
    ["0", "1", "2", "3", "4"].get(usize::from(priority)).copied().unwrap_or("4")
}

/// Whether a request of `priority` is shed at `load`.
pub fn sheds(priority: u8, load: f64) -> bool {
    shed_from(priority).is_some_and(|from| load >= from)
}

/// The agent's load as a multiple of its lines: the larger of in-flight
/// decisions over their line and the store latency over its line. A line
/// of 0 is off.
pub fn load(in_flight: usize, in_flight_line: usize, latency_us: Option<u64>, latency_line_us: u64) -> f64 {
    let by_count = if in_flight_line == 0 { 0.0 } else { in_flight as f64 / in_flight_line as f64 };
    let by_latency = match latency_us {
        Some(l) if latency_line_us > 0 => l as f64 / latency_line_us as f64,
        _ => 0.0,
    };
    by_count.max(by_latency)
}

/// The next latency average: an eighth of the new observation.
pub fn ewma_us(prev_us: u64, observed_us: u64) -> u64 {
    if prev_us == 0 {
        observed_us
    } else {
        (prev_us * 7 + observed_us) / 8
    }
}

/// The lines and the live signals of one agent.
pub struct Shedder {
    in_flight_line: usize,
    latency_line_us: u64,
    in_flight: AtomicUsize,
    latency_us: AtomicU64,
    /// When the latency was last observed, ms since `origin` (0: never).
    latency_at_ms: AtomicU64,
    origin: Instant,
}

/// One decision in flight; the count drops when it does.
pub struct InFlight<'a>(&'a Shedder);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Shedder {
    /// Lines of `in_flight_line` decisions and `latency_line` of spend
    /// latency (0 / zero: that signal is off).
    pub fn new(in_flight_line: usize, latency_line: Duration) -> Shedder {
        Shedder {
            in_flight_line,
            latency_line_us: latency_line.as_micros().min(u128::from(u64::MAX)) as u64,
            in_flight: AtomicUsize::new(0),
            latency_us: AtomicU64::new(0),
            latency_at_ms: AtomicU64::new(0),
            origin: Instant::now(),
        }
    }

    fn now_ms(&self) -> u64 {
        self.origin.elapsed().as_millis() as u64 + 1
    }

    /// The latency average if observed within [`LATENCY_FRESH`] of `now_ms`.
    fn latency_at(&self, now_ms: u64) -> Option<u64> {
        let at = self.latency_at_ms.load(Ordering::Relaxed);
        (at > 0 && now_ms.saturating_sub(at) <= LATENCY_FRESH.as_millis() as u64)
            .then(|| self.latency_us.load(Ordering::Relaxed))
    }

    /// The latency average if fresh; `None` also while the latency line is
    /// off (nothing is measured then).
    fn fresh_latency_us(&self) -> Option<u64> {
        if self.latency_line_us == 0 {
            return None;
        }
        self.latency_at(self.now_ms())
    }

    /// The load now (see [`load`]).
    pub fn load(&self) -> f64 {
        load(
            self.in_flight.load(Ordering::Relaxed),
            self.in_flight_line,
            self.fresh_latency_us(),
            self.latency_line_us,
        )
    }

    /// Admits a decision of `priority` into the count, or answers that it
    /// is shed (and then it is not counted).
    pub fn enter(&self, priority: u8) -> Result<InFlight<'_>, Shed> {
        if sheds(priority, self.load()) {
            return Err(Shed { priority });
        }
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        Ok(InFlight(self))
    }

    /// One spend script's time as a decision waited for it; nothing (not
    /// even a clock read) while the latency line is off, as by default:
    /// this runs on every decision.
    pub fn observe_store(&self, waited: Duration) {
        if self.latency_line_us == 0 {
            return;
        }
        let us = waited.as_micros().min(u128::from(u64::MAX)) as u64;
        let now = self.now_ms();
        // A lost update between two observers only skips one sample.
        let prev = self.latency_at(now).unwrap_or(0);
        self.latency_us.store(ewma_us(prev, us), Ordering::Relaxed);
        self.latency_at_ms.store(now, Ordering::Relaxed);
    }

    /// Decisions in flight now.
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// What `/v1/status` shows: the lines, the signals, the load and the
    /// priorities it sheds now (a line of 0 is off).
    pub fn status(&self) -> serde_json::Value {
        let load = self.load();
        let shedding: Vec<u8> = (MIN_PRIORITY..=MAX_PRIORITY).filter(|&p| sheds(p, load)).collect();
        serde_json::json!({
            "in_flight": self.in_flight(),
            "in_flight_line": self.in_flight_line,
            "store_latency_ms": self.fresh_latency_us().map(|us| us as f64 / 1000.0),
            "store_latency_line_ms": self.latency_line_us as f64 / 1000.0,
            "load": load,
            "shedding": shedding,
        })
    }
}

/// A shed request's priority.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shed {
    pub priority: u8,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn priorities_are_shed_from_the_least_important_and_never_0_or_1() {
        // (load, the priorities shed at it)
        let table: [(f64, &[u8]); 6] =
            [(0.0, &[]), (0.99, &[]), (1.0, &[4]), (1.25, &[3, 4]), (1.5, &[2, 3, 4]), (1000.0, &[2, 3, 4])];
        for (l, shed) in table {
            let got: Vec<u8> = (MIN_PRIORITY..=MAX_PRIORITY).filter(|&p| sheds(p, l)).collect();
            assert_eq!(got, shed, "load {l}");
        }
    }

    #[test]
    fn the_load_is_the_larger_signal_and_a_zero_line_is_off() {
        assert_eq!(load(50, 100, None, 0), 0.5);
        assert_eq!(load(50, 100, Some(300), 100), 3.0);
        assert_eq!(load(500, 0, Some(300), 0), 0.0);
        assert_eq!(load(200, 100, Some(50), 100), 2.0);
        assert_eq!(load(0, 100, None, 100), 0.0);
    }

    #[test]
    fn the_latency_average_moves_an_eighth_of_the_way() {
        assert_eq!(ewma_us(0, 800), 800);
        assert_eq!(ewma_us(800, 1600), 900);
        assert_eq!(ewma_us(800, 0), 700);
    }

    #[test]
    fn in_flight_decisions_are_counted_until_dropped_and_shed_ones_never() {
        let s = Shedder::new(2, Duration::ZERO);
        let a = s.enter(4).unwrap();
        let b = s.enter(4).unwrap();
        assert_eq!(s.in_flight(), 2);
        assert_eq!(s.enter(4).err(), Some(Shed { priority: 4 }));
        assert_eq!(s.in_flight(), 2, "a shed request is not counted");
        // 1 is never shed, also at 1.5x the line, where 2 is.
        let c = s.enter(1).unwrap();
        assert_eq!(s.in_flight(), 3);
        assert!(s.enter(2).is_err() && s.enter(3).is_err());
        assert!(s.enter(0).is_ok(), "0 is never shed");
        drop((a, b, c));
        assert_eq!(s.in_flight(), 0);
        assert!(s.enter(4).is_ok());
    }

    #[test]
    fn the_status_names_the_lines_the_load_and_what_is_shed() {
        let s = Shedder::new(2, Duration::from_millis(50));
        let idle = s.status();
        assert_eq!(idle["in_flight_line"], 2);
        assert_eq!(idle["store_latency_line_ms"], 50.0);
        assert!(idle["store_latency_ms"].is_null());
        assert_eq!(idle["shedding"], serde_json::json!([]));
        let (_a, _b, _c) = (s.enter(0).unwrap(), s.enter(0).unwrap(), s.enter(0).unwrap());
        let busy = s.status();
        assert_eq!((busy["in_flight"].as_u64(), busy["load"].as_f64()), (Some(3), Some(1.5)));
        assert_eq!(busy["shedding"], serde_json::json!([2, 3, 4]));
    }

    #[test]
    fn with_the_latency_line_off_nothing_is_measured() {
        let s = Shedder::new(2, Duration::ZERO);
        s.observe_store(Duration::from_secs(1));
        assert_eq!(s.latency_at_ms.load(Ordering::Relaxed), 0, "no observation kept");
        assert!(s.status()["store_latency_ms"].is_null());
        assert_eq!(s.load(), 0.0);
        assert!(s.enter(4).is_ok());
    }

    #[test]
    fn a_slow_store_sheds_until_its_latency_is_stale() {
        let s = Shedder::new(0, Duration::from_millis(10));
        s.observe_store(Duration::from_millis(25));
        assert_eq!(s.enter(2).err(), Some(Shed { priority: 2 }));
        assert!(s.enter(1).is_ok());
        // An average older than LATENCY_FRESH is not believed.
        s.latency_at_ms.store(1, Ordering::Relaxed);
        let s2 = Shedder { origin: Instant::now() - Duration::from_secs(5), ..s };
        assert!(s2.enter(4).is_ok());
    }
}
