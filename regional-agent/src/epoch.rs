//! Registration and epochs (I4). The agent registers at start and again
//! when its Redis state was lost or the allocator says its epoch is stale;
//! a new epoch resets the grant sequence and raises the agent's fence in
//! every quota it knows, so leases of older epochs are retired and
//! released, and their late grant answers are never credited.

use crate::breaker::backoff;
use crate::scripts;
use crate::AppState;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Duration;
use tokio::sync::Notify;

/// The agent's incarnation at the allocator.
#[derive(Default)]
pub struct Identity {
    /// `(epoch, next seq)`; one lock so a grant never pairs a new epoch with
    /// an old sequence number (that would look like a replay, I3).
    state: Mutex<(i64, i64)>,
    need: AtomicBool,
    wake: Notify,
    /// Notified after each successful registration.
    pub registered: Notify,
}

impl Identity {
    /// The current epoch, 0 before the first registration.
    pub fn epoch(&self) -> i64 {
        self.state.lock().unwrap().0
    }

    /// The epoch and a fresh sequence number for a grant.
    pub fn next_seq(&self) -> (i64, i64) {
        let mut s = self.state.lock().unwrap();
        let seq = s.1;
        s.1 += 1;
        (s.0, seq)
    }

    /// Asks the registration task for a new epoch.
    pub fn request_register(&self) {
        self.need.store(true, Ordering::SeqCst);
        self.wake.notify_one();
    }
}

/// Registers at start and whenever asked, with capped backoff.
pub async fn run(app: AppState) {
    let mut failures = 0u32;
    loop {
        let due = app.ident.epoch() == 0 || app.ident.need.swap(false, Ordering::SeqCst);
        if due {
            match app.alloc.register(&app.settings.region, &app.settings.agent).await {
                Ok(r) => {
                    failures = 0;
                    *app.ident.state.lock().unwrap() = (r.epoch, 0);
                    app.metrics.set("agent_epoch", &[], r.epoch as f64);
                    tracing::info!(region = %app.settings.region, agent = %app.settings.agent, epoch = r.epoch, "registered");
                    fence_all(&app, r.epoch).await;
                    app.ident.registered.notify_waiters();
                }
                Err(e) => {
                    app.ident.need.store(true, Ordering::SeqCst);
                    failures += 1;
                    tracing::warn!(error = %e, "registration failed; retrying");
                    let d = backoff(failures, Duration::from_millis(100), Duration::from_secs(5));
                    tokio::select! {
                        _ = app.cancel.cancelled() => return,
                        _ = tokio::time::sleep(d) => {},
                    }
                    continue;
                }
            }
        }
        tokio::select! {
            _ = app.cancel.cancelled() => return,
            _ = app.ident.wake.notified() => {},
            _ = tokio::time::sleep(Duration::from_secs(1)) => {},
        }
    }
}

/// Raises this agent's fence to `epoch` in every known quota (a quota still
/// learning its policy has no lease to fence and may not exist: no key).
pub async fn fence_all(app: &AppState, epoch: i64) {
    for q in app.quotas.all().into_iter().filter(|q| q.policy().is_some()) {
        if let Err(e) = scripts::fence(&app.store, &q.prefix, &app.settings.agent, epoch).await {
            tracing::warn!(tenant = %q.tenant, resource = %q.resource, error = %e, "cannot raise the epoch fence");
        }
    }
}
