//! UTC window math (I8). A window of `W` seconds is `[k·W, (k+1)·W)` in Unix
//! seconds; `W` divides 86,400 so windows align with UTC days. No local time
//! zone is involved anywhere.

use chrono::{DateTime, TimeZone, Utc};

/// Seconds in a UTC day; every window length must divide it.
pub const DAY_SECS: i64 = 86_400;

/// Whether `window_secs` is a legal window length.
pub fn valid_window_secs(window_secs: i64) -> bool {
    window_secs > 0 && DAY_SECS % window_secs == 0
}

/// One UTC window.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Window {
    /// Start, Unix seconds, a multiple of `secs`.
    pub start: i64,
    /// Length in seconds.
    pub secs: i64,
}

impl Window {
    /// The window of length `secs` that contains `at`.
    pub fn containing(at: DateTime<Utc>, secs: i64) -> Window {
        debug_assert!(valid_window_secs(secs));
        Window { start: at.timestamp().div_euclid(secs) * secs, secs }
    }

    /// The window that follows this one.
    pub fn next(self) -> Window {
        Window { start: self.start + self.secs, secs: self.secs }
    }

    /// Exclusive end, Unix seconds.
    pub fn end(self) -> i64 {
        self.start + self.secs
    }

    /// Start as a UTC instant.
    pub fn start_at(self) -> DateTime<Utc> {
        Utc.timestamp_opt(self.start, 0).single().expect("window start in range")
    }

    /// End as a UTC instant.
    pub fn end_at(self) -> DateTime<Utc> {
        Utc.timestamp_opt(self.end(), 0).single().expect("window end in range")
    }

    /// Whether `at` lies in `[start, end)`.
    pub fn contains(self, at: DateTime<Utc>) -> bool {
        let t = at.timestamp();
        self.start <= t && t < self.end()
    }

    /// Milliseconds from `at` to the end of the window (0 once it has ended).
    pub fn ms_until_end(self, at: DateTime<Utc>) -> i64 {
        (self.end_at() - at).num_milliseconds().max(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(s).unwrap().with_timezone(&Utc)
    }

    #[test]
    fn window_lengths_must_divide_a_day() {
        for ok in [1, 2, 10, 60, 3600, 86_400] {
            assert!(valid_window_secs(ok), "{ok}");
        }
        for bad in [0, -60, 7, 86_401, 172_800] {
            assert!(!valid_window_secs(bad), "{bad}");
        }
    }

    #[test]
    fn minute_windows_align_with_utc_minutes() {
        let w = Window::containing(at("2026-12-02T16:51:59.999Z"), 60);
        assert_eq!(w.start_at(), at("2026-12-02T16:51:00Z"));
        assert_eq!(w.end_at(), at("2026-12-02T16:52:00Z"));
        assert!(w.contains(at("2026-12-02T16:51:00Z")));
        assert!(!w.contains(at("2026-12-02T16:52:00Z")));
        assert_eq!(w.next().start_at(), at("2026-12-02T16:52:00Z"));
    }

    #[test]
    fn day_window_is_the_utc_day_whatever_the_offset_of_the_input() {
        let w = Window::containing(at("2026-12-02T23:30:00-05:00"), 86_400);
        assert_eq!(w.start_at(), at("2026-12-03T00:00:00Z"));
        assert_eq!(w.end_at(), at("2026-12-04T00:00:00Z"));
        assert_eq!(w.ms_until_end(at("2026-12-03T23:59:59Z")), 1000);
    }

    #[test]
    fn instants_before_the_epoch_still_floor() {
        let w = Window::containing(at("1969-12-31T23:59:30Z"), 60);
        assert_eq!(w.start, -60);
    }
}
