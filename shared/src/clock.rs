//! The one clock the services ask for "now".
//!
//! Production uses [`SystemClock`]. Tests may use [`OffsetClock`] to stand
//! at a chosen instant (for example 1 ms before a window ends) while time
//! still flows, so nothing in the hot path is frozen.

use chrono::{DateTime, Duration, Utc};
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Instant;

/// UTC wall time for windows and timestamps, a monotonic clock for deadlines.
pub trait Clock: Send + Sync + 'static {
    /// Current UTC time (window boundaries, I8).
    fn now_utc(&self) -> DateTime<Utc>;
    /// Monotonic instant (lease deadlines, I2).
    fn monotonic(&self) -> Instant {
        Instant::now()
    }
}

/// The system's clocks.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_utc(&self) -> DateTime<Utc> {
        Utc::now()
    }
}

/// The system clock shifted by an adjustable offset (tests and clock-skew
/// scenarios). The monotonic clock is never shifted.
#[derive(Debug, Default)]
pub struct OffsetClock {
    offset_ms: AtomicI64,
}

impl OffsetClock {
    /// A clock shifted by `offset`.
    pub fn new(offset: Duration) -> Self {
        OffsetClock { offset_ms: AtomicI64::new(offset.num_milliseconds()) }
    }

    /// Shifts the clock so that "now" reads `at`.
    pub fn set_now(&self, at: DateTime<Utc>) {
        self.offset_ms.store((at - Utc::now()).num_milliseconds(), Ordering::SeqCst);
    }

    /// Moves the clock forward by `d`.
    pub fn advance(&self, d: Duration) {
        self.offset_ms.fetch_add(d.num_milliseconds(), Ordering::SeqCst);
    }
}

impl Clock for OffsetClock {
    fn now_utc(&self) -> DateTime<Utc> {
        Utc::now() + Duration::milliseconds(self.offset_ms.load(Ordering::SeqCst))
    }
}
