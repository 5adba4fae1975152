//! The opt-in local allowance (`--local-fallback-per-agent N`): while Redis
//! is unreachable this agent alone may admit up to N tokens per quota and
//! window, counted in memory and reported straight to the allocator with a
//! report id fixed when the count is taken (so a retry is idempotent). It is
//! the `Σ_agents local_store_fallback` term of I6. These counts live in
//! memory only: an agent killed before it reports them loses them (the
//! region's Redis outbox is, by assumption, unreachable at that moment).
//!
//! The region-wide fallback of DESIGN §4 is not here: it is a Redis counter
//! inside `lua/spend.lua`, shared by the replicas, capped per window.

use std::collections::HashMap;
use std::sync::Mutex;

/// Most (quota, window) counters and unsent reports kept.
pub const MAX_ENTRIES: usize = 1024;

/// One unsent local admit count.
#[derive(Debug, Clone)]
pub struct Pending {
    pub report_id: String,
    pub tenant: String,
    pub resource: String,
    pub window_start: i64,
    pub admitted: i64,
}

/// Local counters and unsent reports.
#[derive(Default)]
pub struct LocalFallback {
    used: Mutex<HashMap<(String, String, i64), i64>>,
    pending: Mutex<Vec<Pending>>,
}

impl LocalFallback {
    /// Admits `cost` of quota `(tenant, resource)` in window `ws` if the
    /// allowance `n` covers it; returns what is left.
    pub fn try_admit(&self, tenant: &str, resource: &str, ws: i64, cost: i64, n: i64) -> Option<i64> {
        let mut used = self.used.lock().unwrap();
        // Old windows can never admit again; keep the map small.
        if used.len() >= MAX_ENTRIES {
            let newest = used.keys().map(|k| k.2).max().unwrap_or(ws);
            used.retain(|k, _| k.2 >= newest);
        }
        let mut pending = self.pending.lock().unwrap();
        if used.len() >= MAX_ENTRIES || pending.len() >= MAX_ENTRIES {
            return None;
        }
        let u = used.entry((tenant.to_string(), resource.to_string(), ws)).or_default();
        if *u + cost > n {
            return None;
        }
        *u += cost;
        pending.push(Pending {
            report_id: uuid::Uuid::new_v4().to_string(),
            tenant: tenant.to_string(),
            resource: resource.to_string(),
            window_start: ws,
            admitted: cost,
        });
        Some(n - *u)
    }

    /// The unsent reports.
    pub fn pending(&self) -> Vec<Pending> {
        self.pending.lock().unwrap().clone()
    }

    /// Forgets a report the allocator accepted.
    pub fn sent(&self, report_id: &str) {
        self.pending.lock().unwrap().retain(|p| p.report_id != report_id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn local_allowance_is_per_quota_and_window() {
        let l = LocalFallback::default();
        assert_eq!(l.try_admit("a", "r", 60, 2, 3), Some(1));
        assert_eq!(l.try_admit("a", "r", 60, 2, 3), None);
        assert_eq!(l.try_admit("a", "r", 120, 3, 3), Some(0));
        assert_eq!(l.try_admit("b", "r", 60, 1, 3), Some(2));
        assert_eq!(l.pending().len(), 3);
    }
}
