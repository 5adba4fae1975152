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

/// The answers of one quota in one window under one policy version: the
/// 429 and 503s (the fleet pages) and the admits (with the 429s, a staged
/// rollout's refusal rate per version, see the allocator's `rollout.rs`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WindowCounts {
    /// Unix seconds.
    pub window_start: i64,
    /// The policy version counted (0: none yet).
    pub version: i64,
    pub quota_exhausted: i64,
    /// 429 `per_key_limited`: a principal's bucket refused.
    pub per_key_limited: i64,
    pub unavailable: i64,
    /// Answered 200: from a lease, the fallback allowance, or a shadow
    /// policy's refusal (admitted all the same).
    pub admitted: i64,
}

impl WindowCounts {
    /// The counts after an answer with outcome `outcome` (an error code,
    /// or the admit's source) in the window starting at `window_start`
    /// under policy `version`: a new window or version starts from zero;
    /// answers that are neither admits, 429 nor 503 change nothing else.
    pub fn record(self, window_start: i64, version: i64, outcome: &str) -> WindowCounts {
        let mut c = if window_start == self.window_start && version == self.version {
            self
        } else {
            WindowCounts { window_start, version, ..Default::default() }
        };
        match outcome {
            "quota_exhausted" => c.quota_exhausted += 1,
            "per_key_limited" => c.per_key_limited += 1,
            "allocator_unreachable" | "store_unavailable" | "policy_stale" => c.unavailable += 1,
            "lease" | "fallback" | "shadow" => c.admitted += 1,
            _ => {}
        }
        c
    }
}

/// What the status carries beside the quota registry.
#[derive(Default)]
pub struct FleetStatus {
    /// By quota name ("tenant/resource"), so the decision path looks up
    /// without building a key.
    counts: Mutex<HashMap<String, WindowCounts>>,
    /// Entries left after the last complete drain round (-1: none yet).
    outbox_depth: AtomicI64,
}

impl FleetStatus {
    /// Counts an answer of `quota` ("tenant/resource") whose policy is
    /// known, in the window containing `now` (the allocator's clock).
    pub fn count(&self, quota: &str, policy: Option<PolicyInfo>, outcome: &str, now: DateTime<Utc>) {
        let Some(p) = policy else { return };
        if !matches!(
            outcome,
            "quota_exhausted"
                | "allocator_unreachable"
                | "store_unavailable"
                | "policy_stale"
                | "lease"
                | "fallback"
        ) {
            return;
        }
        let start = Window::containing(now, p.window_secs).start;
        let mut counts = self.counts.lock().unwrap();
        if let Some(c) = counts.get_mut(quota) {
            *c = c.record(start, p.version, outcome);
            return;
        }
        if counts.len() >= MAX_COUNTED || !quota.contains('/') {
            return;
        }
        counts.insert(quota.to_string(), WindowCounts::default().record(start, p.version, outcome));
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
        self.counts.lock().unwrap().get(&format!("{tenant}/{resource}")).copied()
    }

    /// Forgets the quotas not in `held` (names "tenant/resource").
    pub fn retain(&self, held: &HashSet<String>) {
        self.counts.lock().unwrap().retain(|k, _| held.contains(k));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_restart_with_each_window_and_version_and_ignore_other_answers() {
        let c = WindowCounts::default().record(60, 3, "quota_exhausted").record(60, 3, "store_unavailable");
        assert_eq!(
            c,
            WindowCounts {
                window_start: 60,
                version: 3,
                quota_exhausted: 1,
                unavailable: 1,
                ..Default::default()
            }
        );
        let c = c.record(60, 3, "allocator_unreachable").record(60, 3, "lease").record(60, 3, "shadow");
        let c = c.record(60, 3, "per_key_limited").record(60, 3, "not_found");
        assert_eq!((c.quota_exhausted, c.per_key_limited, c.unavailable, c.admitted), (1, 1, 2, 2));
        assert_eq!(
            c.record(120, 3, "quota_exhausted"),
            WindowCounts { window_start: 120, version: 3, quota_exhausted: 1, ..Default::default() }
        );
        // A new version (a rollout reaching this region) counts from zero.
        assert_eq!(
            c.record(60, 4, "fallback"),
            WindowCounts { window_start: 60, version: 4, admitted: 1, ..Default::default() }
        );
    }

    #[test]
    fn only_known_quotas_admits_and_refusals_are_counted() {
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
            Some(WindowCounts {
                window_start: 1_800_000_000,
                version: 1,
                quota_exhausted: 1,
                admitted: 1,
                ..Default::default()
            })
        );
        assert_eq!(s.counts_of("nosuch", "name"), None);
    }
}
