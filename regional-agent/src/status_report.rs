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
//! The per-window counts live in memory ([`crate::fleet_counts::FleetStatus`]): at most
//! [`crate::fleet_counts::MAX_COUNTED`] quotas, only quotas with a known policy (the request
//! path's unknown names never make an entry), and entries of quotas that
//! left the registry go at the next status.

use crate::app::{AllocatorClock, App};
use crate::client::{AllocatorClient, CallError};
use crate::config::Settings;
use crate::fleet_counts::{FleetStatus, WindowCounts};
use crate::identity::Identity;
use crate::keys::Keys;
use crate::quotas::Quotas;
use crate::store::Store;
use quota_shared::prom::Registry;
use quota_shared::window::Window;
use quota_shared::wire::{AgentQuotaStatus, AgentStatusReport, QuotaMode};
use std::collections::HashSet;
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

/// What the status task uses of the agent's state.
pub struct Reporter {
    pub settings: Arc<Settings>,
    pub keys: Keys,
    pub store: Store,
    pub alloc: Arc<AllocatorClient>,
    pub alloc_clock: Arc<AllocatorClock>,
    pub quotas: Arc<Quotas>,
    pub ident: Arc<Identity>,
    pub metrics: Arc<Registry>,
    pub fleet_status: Arc<FleetStatus>,
    pub cancel: CancellationToken,
}

impl Reporter {
    /// The status task's handles on `app`'s parts.
    pub fn of(app: &App) -> Reporter {
        Reporter {
            settings: app.settings.clone(),
            keys: app.keys.clone(),
            store: app.store.clone(),
            alloc: app.alloc.clone(),
            alloc_clock: app.alloc_clock.clone(),
            quotas: app.quotas.clone(),
            ident: app.ident.clone(),
            metrics: app.metrics.clone(),
            fleet_status: app.fleet_status.clone(),
            cancel: app.cancel.clone(),
        }
    }
}

/// Most quotas one status lists (the allocator's bound).
pub const MAX_QUOTAS: usize = 200;
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
pub async fn build(app: &Reporter) -> Option<AgentStatusReport> {
    let epoch = app.ident.epoch();
    if epoch == 0 {
        return None;
    }
    let reachable = app.alloc.breaker.reachable();
    let now = app.alloc_clock.now();
    let held = app.quotas.all();
    let mut keys = HashSet::new();
    let mut quotas = Vec::new();
    for q in &held {
        keys.insert(format!("{}/{}", q.tenant, q.resource));
        let Some(p) = q.policy() else { continue };
        let open = Window::containing(now, p.window_secs);
        let c = app
            .fleet_status
            .counts_of(&q.tenant, &q.resource)
            .filter(|c| c.window_start == open.start && c.version == p.version);
        let c =
            c.unwrap_or(WindowCounts { window_start: open.start, version: p.version, ..Default::default() });
        let m = crate::gauges::mode(reachable, Some(p), &q.view.lock().unwrap());
        quotas.push(AgentQuotaStatus {
            tenant: q.tenant.clone(),
            resource: q.resource.clone(),
            mode: mode(m),
            window_start: open.start_at(),
            quota_exhausted: c.quota_exhausted,
            unavailable: c.unavailable,
            per_key_limited: c.per_key_limited,
            admitted: c.admitted,
            policy_version: Some(c.version),
        });
    }
    app.fleet_status.retain(&keys);
    let dead_letters = crate::outbox::dead_letters(&app.store, &app.keys, &app.settings.region, 0)
        .await
        .ok()
        .map(|(n, _)| n);
    Some(AgentStatusReport {
        epoch,
        allocator_reachable: reachable,
        outbox_depth: app.fleet_status.outbox_depth(),
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
pub async fn run(app: Reporter, interval: std::time::Duration) {
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
    fn a_status_lists_refused_and_unleased_quotas_first_and_is_capped() {
        let q = |t: &str, mode, e| AgentQuotaStatus {
            tenant: t.into(),
            resource: "r".into(),
            mode,
            window_start: chrono::DateTime::from_timestamp(0, 0).unwrap(),
            quota_exhausted: e,
            unavailable: 0,
            per_key_limited: 0,
            admitted: 0,
            policy_version: Some(1),
        };
        let all =
            vec![q("a", QuotaMode::Leased, 0), q("b", QuotaMode::Leased, 2), q("c", QuotaMode::Fallback, 0)];
        let names: Vec<String> = pick(all, 2).into_iter().map(|q| q.tenant).collect();
        assert_eq!(names, ["b", "c"]);
    }
}
