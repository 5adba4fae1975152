//! Registration and epochs (I4). The agent registers at start and again
//! when its Redis state was lost or the allocator says its epoch is stale;
//! a new epoch resets the grant sequence and raises the agent's fence in
//! every quota it knows, so leases of older epochs are retired and
//! released, and their late grant answers are never credited. The
//! agent's epoch itself is [`crate::identity`]'s.

use crate::app::App;
use crate::breaker::backoff;
use crate::client::AllocatorClient;
use crate::config::Settings;
use crate::identity::Identity;
use crate::quotas::Quotas;
use crate::scripts;
use crate::store::Store;
use quota_shared::prom::Registry;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// What the registration task uses of the agent's state.
pub struct Registrar {
    pub settings: Arc<Settings>,
    pub ident: Arc<Identity>,
    pub alloc: Arc<AllocatorClient>,
    pub store: Store,
    pub quotas: Arc<Quotas>,
    pub metrics: Arc<Registry>,
    pub cancel: CancellationToken,
}

impl Registrar {
    /// The registration's handles on `app`'s parts.
    pub fn of(app: &App) -> Registrar {
        Registrar {
            settings: app.settings.clone(),
            ident: app.ident.clone(),
            alloc: app.alloc.clone(),
            store: app.store.clone(),
            quotas: app.quotas.clone(),
            metrics: app.metrics.clone(),
            cancel: app.cancel.clone(),
        }
    }
}

/// Registers at start and whenever asked, with capped backoff.
pub async fn run(app: Registrar) {
    let mut failures = 0u32;
    loop {
        let due = app.ident.epoch() == 0 || app.ident.take_request();
        if due {
            match app.alloc.register(&app.settings.region, &app.settings.agent).await {
                Ok(r) => {
                    failures = 0;
                    app.ident.registered_as(r.epoch);
                    app.metrics.set("agent_epoch", &[], r.epoch as f64);
                    tracing::info!(region = %app.settings.region, agent = %app.settings.agent, epoch = r.epoch, "registered");
                    fence_all(&app.store, &app.quotas, &app.settings.agent, r.epoch).await;
                    app.ident.registered.notify_waiters();
                }
                Err(e) => {
                    app.ident.keep_request();
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
            _ = app.ident.requested() => {},
            _ = tokio::time::sleep(Duration::from_secs(1)) => {},
        }
    }
}

/// Raises this agent's fence to `epoch` in every known quota (a quota still
/// learning its policy has no lease to fence and may not exist: no key).
pub async fn fence_all(store: &Store, quotas: &Quotas, agent: &str, epoch: i64) {
    for q in quotas.all().into_iter().filter(|q| q.policy().is_some()) {
        if let Err(e) = scripts::fence(store, &q.prefix, agent, epoch).await {
            tracing::warn!(tenant = %q.tenant, resource = %q.resource, error = %e, "cannot raise the epoch fence");
        }
    }
}
