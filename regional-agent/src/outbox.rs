//! The durable outbox (I7). Counts of admits live in region-wide Redis
//! counters per quota and window; `lua/cut.lua` moves them atomically into
//! a report entry with a fresh report id in this agent's outbox list (in the
//! quota's slot), and releases of expired leases' unspent tokens are pushed
//! there by the scripts that retire the leases. This task sends each entry
//! to the allocator and removes it only once the allocator accepted it (or
//! refused it for good), so a crash at any point resends the same report id
//! or lease release, both idempotent at the allocator. Restarted agents
//! drain their predecessor's entries under their new epoch. The outbox is
//! bounded: no new report is cut while an agent's outbox holds
//! [`MAX_OUTBOX`] entries; the counts wait in their counters.

use crate::client::CallError;
use crate::quotas::Quota;
use crate::store::CUT;
use crate::AppState;
use chrono::{TimeZone, Utc};
use quota_shared::wire::{ReleaseRequest, ReportItem, ReportRequest};
use serde::Deserialize;
use std::time::{Duration, Instant};

/// Most entries one agent's outbox of one quota holds before cutting pauses.
pub const MAX_OUTBOX: i64 = 64;
/// Entries sent per quota per round.
const BATCH: isize = 32;

/// One outbox entry as `lua/*.lua` writes it.
#[derive(Debug, Deserialize)]
#[serde(tag = "k")]
enum Entry {
    /// A release: lease id and unspent tokens.
    #[serde(rename = "rel")]
    Release { id: String, u: i64 },
    /// A report: id and `[window_start, consumed, fallback_admitted]` items.
    #[serde(rename = "rep")]
    Report { rid: String, items: Vec<(i64, i64, i64)> },
}

/// Cuts and drains every `interval` until cancelled.
pub async fn run(app: AppState) {
    loop {
        tokio::select! {
            _ = app.cancel.cancelled() => return,
            _ = tokio::time::sleep(app.settings.outbox_interval) => {},
        }
        drain_all(&app).await;
    }
}

/// Repeats rounds until every outbox is empty or `deadline` passes (at
/// shutdown). Returns the entries left.
pub async fn final_drain(app: &AppState, deadline: Duration) -> i64 {
    let until = Instant::now() + deadline;
    loop {
        let left = drain_all(app).await;
        if left == 0 || Instant::now() >= until {
            return left;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// One round over every quota; returns the entries left (or 1 when a
/// quota could not be read, so a final drain keeps trying).
pub async fn drain_all(app: &AppState) -> i64 {
    let epoch = app.ident.epoch();
    if epoch == 0 {
        return 1;
    }
    let mut left = 0;
    for q in app.quotas.all() {
        left += drain_quota(app, &q, epoch).await.unwrap_or(1);
    }
    left += drain_local(app, epoch).await;
    app.metrics.set("agent_outbox_depth", &[], left as f64);
    // The agent's quota set lives as long as the agent does, plus the
    // counters' ttl: a set of an agent id that never comes back expires (F04).
    let set = app.keys.agent_quotas(&app.settings.region, &app.settings.agent);
    let _: Result<i64, _> =
        app.store.cmd(redis::cmd("PEXPIRE").arg(set).arg(crate::spend::COUNTER_TTL_MS)).await;
    left
}

async fn drain_quota(app: &AppState, q: &Quota, epoch: i64) -> Result<i64, crate::store::StoreError> {
    let agent = &app.settings.agent;
    let mut inv = CUT.prepare_invoke();
    inv.key(format!("{}inc", q.prefix))
        .arg(&q.prefix)
        .arg(agent)
        .arg(uuid::Uuid::new_v4().to_string())
        .arg(MAX_OUTBOX);
    let _: i64 = app.store.eval(&inv).await?;
    let ob = format!("{}ob:{agent}", q.prefix);
    let entries: Vec<String> = app.store.cmd(redis::cmd("LRANGE").arg(&ob).arg(0).arg(BATCH - 1)).await?;
    for raw in entries {
        let done = match serde_json::from_str::<Entry>(&raw) {
            Ok(e) => send(app, q, epoch, e).await,
            Err(e) => {
                tracing::error!(entry = %raw, error = %e, "dropping an unreadable outbox entry");
                true
            }
        };
        if !done {
            break;
        }
        let _: i64 = app.store.cmd(redis::cmd("LREM").arg(&ob).arg(1).arg(&raw)).await?;
    }
    app.store.cmd(redis::cmd("LLEN").arg(&ob)).await
}

/// Sends one entry; `true` when it may leave the outbox.
async fn send(app: &AppState, q: &Quota, epoch: i64, e: Entry) -> bool {
    let (what, result) = match e {
        Entry::Release { id, u } => {
            let r = app.alloc.release(&id, &ReleaseRequest { epoch, unspent: u }).await.map(|_| ());
            (format!("release {id} unspent {u}"), r)
        }
        Entry::Report { rid, items } => {
            let req = ReportRequest {
                region: app.settings.region.clone(),
                agent: app.settings.agent.clone(),
                epoch,
                report_id: rid.clone(),
                items: items
                    .iter()
                    .map(|(ws, c, f)| ReportItem {
                        tenant: q.tenant.clone(),
                        resource: q.resource.clone(),
                        window_start: Utc.timestamp_opt(*ws, 0).single().unwrap_or_default(),
                        consumed: *c,
                        fallback_admitted: *f,
                    })
                    .collect(),
            };
            (format!("report {rid}"), app.alloc.report(&req).await.map(|_| ()))
        }
    };
    outcome(app, q, &what, result)
}

fn outcome(app: &AppState, q: &Quota, what: &str, result: Result<(), CallError>) -> bool {
    match result {
        Ok(()) => {
            app.metrics.inc("agent_outbox_sent_total", &[]);
            true
        }
        Err(CallError::Unreachable(_)) => false,
        Err(e) if e.code() == Some("stale_epoch") => {
            app.ident.request_register();
            false
        }
        Err(e) => {
            // Refused for good (unknown lease or quota, mismatch): resending
            // cannot succeed, and keeping it would block the outbox.
            tracing::error!(tenant = %q.tenant, resource = %q.resource, what, error = %e, "allocator refused an outbox entry; dropped");
            app.metrics.inc("agent_outbox_dropped_total", &[]);
            true
        }
    }
}

async fn drain_local(app: &AppState, epoch: i64) -> i64 {
    let pending = app.local.pending();
    let mut left = 0;
    for p in pending {
        let req = ReportRequest {
            region: app.settings.region.clone(),
            agent: app.settings.agent.clone(),
            epoch,
            report_id: p.report_id.clone(),
            items: vec![ReportItem {
                tenant: p.tenant.clone(),
                resource: p.resource.clone(),
                window_start: Utc.timestamp_opt(p.window_start, 0).single().unwrap_or_default(),
                consumed: 0,
                fallback_admitted: p.admitted,
            }],
        };
        match app.alloc.report(&req).await {
            Ok(_) => app.local.sent(&p.report_id),
            Err(CallError::Unreachable(_)) => left += 1,
            Err(e) if e.code() == Some("stale_epoch") => {
                app.ident.request_register();
                left += 1;
            }
            Err(e) => {
                tracing::error!(report_id = %p.report_id, error = %e, "allocator refused a local fallback report; dropped");
                app.local.sent(&p.report_id);
            }
        }
    }
    left
}
