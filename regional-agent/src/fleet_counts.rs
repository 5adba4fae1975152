//! The agent's own count of the acquires it answered 429 and 503, per
//! quota and window, and the outbox depth of its last drain round: what the
//! status for the allocator's fleet pages carries beside the quota registry
//! (the allocator's reports carry admits only). Kept apart from the task
//! that sends it ([`crate::status_report`]) so the shared state holds it
//! without knowing that task.

use crate::quotas::PolicyInfo;
use chrono::{DateTime, Utc};
use quota_shared::window::Window;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Mutex;

/// Most quotas whose refusals are counted at once.
pub const MAX_COUNTED: usize = 10_000;

/// The 429 and 503 answers of one quota in one window.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WindowCounts {
    /// Unix seconds.
    pub window_start: i64,
    pub quota_exhausted: i64,
    pub unavailable: i64,
}

impl WindowCounts {
    /// The counts after an answer with error code `outcome` in the window
    /// starting at `window_start`: a new window starts from zero; answers
    /// that are neither 429 nor 503 change nothing but the window.
    pub fn record(self, window_start: i64, outcome: &str) -> WindowCounts {
        let mut c = if window_start == self.window_start {
            self
        } else {
            WindowCounts { window_start, ..Default::default() }
        };
        match outcome {
            "quota_exhausted" => c.quota_exhausted += 1,
            "allocator_unreachable" | "store_unavailable" | "policy_stale" => c.unavailable += 1,
            _ => {}
        }
        c
    }
}

/// What the status carries beside the quota registry.
#[derive(Default)]
pub struct FleetStatus {
    counts: Mutex<HashMap<(String, String), WindowCounts>>,
    /// Entries left after the last complete drain round (-1: none yet).
    outbox_depth: AtomicI64,
}

impl FleetStatus {
    /// Counts a refused acquire of `quota` ("tenant/resource") whose policy
    /// is known, in the window containing `now` (the allocator's clock).
    pub fn count(&self, quota: &str, policy: Option<PolicyInfo>, outcome: &str, now: DateTime<Utc>) {
        let (Some(p), Some((tenant, resource))) = (policy, quota.split_once('/')) else { return };
        if !matches!(
            outcome,
            "quota_exhausted" | "allocator_unreachable" | "store_unavailable" | "policy_stale"
        ) {
            return;
        }
        let start = Window::containing(now, p.window_secs).start;
        let mut counts = self.counts.lock().unwrap();
        let key = (tenant.to_string(), resource.to_string());
        if counts.len() >= MAX_COUNTED && !counts.contains_key(&key) {
            return;
        }
        let c = counts.entry(key).or_default();
        *c = c.record(start, outcome);
    }

    /// Entries left after the last complete drain round (0 before the first).
    pub fn outbox_depth(&self) -> i64 {
        self.outbox_depth.load(Ordering::Relaxed).max(0)
    }

    /// Records the outbox depth of a complete drain round.
    pub fn set_outbox_depth(&self, left: i64) {
        self.outbox_depth.store(left, Ordering::Relaxed);
    }

    pub fn counts_of(&self, tenant: &str, resource: &str) -> Option<WindowCounts> {
        self.counts.lock().unwrap().get(&(tenant.to_string(), resource.to_string())).copied()
    }

    /// Forgets the quotas not in `held`.
    pub fn retain(&self, held: &HashSet<(String, String)>) {
        self.counts.lock().unwrap().retain(|k, _| held.contains(k));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_restart_with_each_window_and_ignore_other_answers() {
        let c = WindowCounts::default().record(60, "quota_exhausted").record(60, "store_unavailable");
        assert_eq!(c, WindowCounts { window_start: 60, quota_exhausted: 1, unavailable: 1 });
        let c = c.record(60, "allocator_unreachable").record(60, "lease");
        assert_eq!((c.quota_exhausted, c.unavailable), (1, 2));
        assert_eq!(
            c.record(120, "quota_exhausted"),
            WindowCounts { window_start: 120, quota_exhausted: 1, unavailable: 0 }
        );
    }

    #[test]
    fn only_known_quotas_and_refusals_are_counted() {
        let s = FleetStatus::default();
        let p = PolicyInfo {
            limit: 10,
            window_secs: 60,
            fail_mode: quota_shared::wire::FailMode::Bounded,
            fallback_allowance: 0,
            version: 1,
            per_key: None,
            enforce: true,
            on_stale: Default::default(),
            held: [0; 5],
        };
        let now = DateTime::from_timestamp(1_800_000_030, 0).unwrap();
        s.count("atlas/read", Some(p), "quota_exhausted", now);
        s.count("atlas/read", Some(p), "lease", now);
        s.count("atlas/read", None, "quota_exhausted", now);
        s.count("nosuch/name", None, "allocator_unreachable", now);
        assert_eq!(
            s.counts_of("atlas", "read"),
            Some(WindowCounts { window_start: 1_800_000_000, quota_exhausted: 1, unavailable: 0 })
        );
        assert_eq!(s.counts_of("nosuch", "name"), None);
    }
}
