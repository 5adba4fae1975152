//! The agent's status for the allocator's fleet pages: every
//! `--status-interval-ms` (2 s) a `PUT /v1/agents/{region}/{agent}/status`
//! with the epoch, whether the breaker counts the allocator as reachable,
//! the outbox depth of the last drain round, the region's dead letters and,
//! per quota, its mode and the acquires answered 429 and 503 in the quota's
//! open window (the allocator's reports carry admits only).
//!
//! Operators' data only: the call goes around the circuit breaker (see
//! [`crate::client::AllocatorClient::put_status`]), has the allocator
//! timeout, and a failure is logged (once per change of reason) and counted
//! (`agent_status_reports_total{result}`), never retried at once; nothing
//! on the request path waits for it. A `409 stale_epoch` asks for a new
//! registration, like any fenced call.
//!
//! The per-window counts live in memory ([`FleetStatus`]): at most
//! [`MAX_COUNTED`] quotas, only quotas with a known policy (the request
//! path's unknown names never make an entry), and entries of quotas that
//! left the registry go at the next status.

use crate::client::CallError;
use crate::quotas::PolicyInfo;
use crate::AppState;
use chrono::{DateTime, Utc};
use quota_shared::prom::Registry;
use quota_shared::window::Window;
use quota_shared::wire::{AgentQuotaStatus, AgentStatusReport, QuotaMode};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Mutex;

/// Most quotas one status lists (the allocator's bound).
pub const MAX_QUOTAS: usize = 200;
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
            "allocator_unreachable" | "store_unavailable" => c.unavailable += 1,
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
        if !matches!(outcome, "quota_exhausted" | "allocator_unreachable" | "store_unavailable") {
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

    /// Records the outbox depth of a complete drain round.
    pub fn set_outbox_depth(&self, left: i64) {
        self.outbox_depth.store(left, Ordering::Relaxed);
    }

    fn counts_of(&self, tenant: &str, resource: &str) -> Option<WindowCounts> {
        self.counts.lock().unwrap().get(&(tenant.to_string(), resource.to_string())).copied()
    }

    /// Forgets the quotas not in `held`.
    fn retain(&self, held: &HashSet<(String, String)>) {
        self.counts.lock().unwrap().retain(|k, _| held.contains(k));
    }
}

/// The quotas a status lists: at most `max`, those refused in their window
/// or not leased first, then by name.
pub fn pick(mut quotas: Vec<AgentQuotaStatus>, max: usize) -> Vec<AgentQuotaStatus> {
    quotas.sort_by_key(|q| {
        let quiet = q.quota_exhausted == 0 && q.unavailable == 0 && q.mode == QuotaMode::Leased;
        (quiet, q.tenant.clone(), q.resource.clone())
    });
    quotas.truncate(max);
    quotas
}

fn mode(name: &str) -> QuotaMode {
    match name {
        "fallback" => QuotaMode::Fallback,
        "strict" => QuotaMode::Strict,
        "exhausted" => QuotaMode::Exhausted,
        _ => QuotaMode::Leased,
    }
}

/// The status as of now; `None` before the first registration.
pub async fn build(app: &AppState) -> Option<AgentStatusReport> {
    let epoch = app.ident.epoch();
    if epoch == 0 {
        return None;
    }
    let reachable = app.allocator_reachable();
    let now = app.allocator_now();
    let held = app.quotas.all();
    let mut keys = HashSet::new();
    let mut quotas = Vec::new();
    for q in &held {
        keys.insert((q.tenant.clone(), q.resource.clone()));
        let Some(p) = q.policy() else { continue };
        let open = Window::containing(now, p.window_secs);
        let c = app.fleet_status.counts_of(&q.tenant, &q.resource).filter(|c| c.window_start == open.start);
        let c = c.unwrap_or(WindowCounts { window_start: open.start, ..Default::default() });
        let m = crate::gauges::mode(reachable, Some(p), &q.view.lock().unwrap());
        quotas.push(AgentQuotaStatus {
            tenant: q.tenant.clone(),
            resource: q.resource.clone(),
            mode: mode(m),
            window_start: open.start_at(),
            quota_exhausted: c.quota_exhausted,
            unavailable: c.unavailable,
        });
    }
    app.fleet_status.retain(&keys);
    let dead_letters = crate::outbox::dead_letters(app, 0).await.ok().map(|(n, _)| n);
    Some(AgentStatusReport {
        epoch,
        allocator_reachable: reachable,
        outbox_depth: app.fleet_status.outbox_depth.load(Ordering::Relaxed).max(0),
        dead_letters,
        quotas_total: held.len() as i64,
        quotas: pick(quotas, MAX_QUOTAS),
    })
}

/// Declares the family of this module.
pub fn describe(m: &Registry) {
    m.describe(
        "agent_status_reports_total",
        "counter",
        "Statuses sent to the allocator's fleet pages, by result (ok, refused, unreachable)",
    );
}

/// Sends the status every `interval` until cancelled.
pub async fn run(app: AppState, interval: std::time::Duration) {
    let mut last_error: Option<String> = None;
    loop {
        tokio::select! {
            _ = app.cancel.cancelled() => return,
            _ = tokio::time::sleep(interval) => {},
        }
        let Some(body) = build(&app).await else { continue };
        let result = app.alloc.put_status(&app.settings.region, &app.settings.agent, &body).await;
        let (label, error) = match &result {
            Ok(()) => ("ok", None),
            Err(e @ CallError::Refused { code, .. }) => {
                if code == "stale_epoch" {
                    app.ident.request_register();
                }
                ("refused", Some(e.to_string()))
            }
            Err(e @ CallError::Unreachable(_)) => ("unreachable", Some(e.to_string())),
        };
        app.metrics.inc("agent_status_reports_total", &[("result", label)]);
        if error != last_error {
            match &error {
                Some(e) => tracing::warn!(error = %e, "status not sent to the allocator"),
                None => tracing::info!("status sent to the allocator again"),
            }
            last_error = error;
        }
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

    #[test]
    fn a_status_lists_refused_and_unleased_quotas_first_and_is_capped() {
        let q = |t: &str, mode, e| AgentQuotaStatus {
            tenant: t.into(),
            resource: "r".into(),
            mode,
            window_start: DateTime::from_timestamp(0, 0).unwrap(),
            quota_exhausted: e,
            unavailable: 0,
        };
        let all =
            vec![q("a", QuotaMode::Leased, 0), q("b", QuotaMode::Leased, 2), q("c", QuotaMode::Fallback, 0)];
        let names: Vec<String> = pick(all, 2).into_iter().map(|q| q.tenant).collect();
        assert_eq!(names, ["b", "c"]);
    }
}
