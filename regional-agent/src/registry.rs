//! The agent's quotas and their renewers: the one place a quota is created,
//! and where its renewer starts with it. The request path asks the registry
//! for a quota ([`Registry::quota`]) and gets it whole, so a decision never
//! reaches into the renewer or the task list; the root installs what starts
//! a renewer ([`Registry::on_create`]) before the first quota can exist.

use crate::keys::Keys;
use crate::quotas::{Quota, Quotas};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

/// What starts a new quota's renewer.
type Start = Box<dyn Fn(Arc<Quota>) + Send + Sync>;

/// The quotas the agent knows, created on first use.
pub struct Registry {
    quotas: Arc<Quotas>,
    keys: Keys,
    /// The region's incarnation key was missing at start (see the crate
    /// doc): new quotas then begin on an unknown incarnation (`?`).
    region_fresh: AtomicBool,
    start: OnceLock<Start>,
}

impl Registry {
    pub fn new(quotas: Arc<Quotas>, keys: Keys) -> Registry {
        Registry { quotas, keys, region_fresh: AtomicBool::new(false), start: OnceLock::new() }
    }

    /// Installs what starts the renewer of each quota created from now on
    /// (once; a second call is ignored).
    pub fn on_create(&self, start: impl Fn(Arc<Quota>) + Send + Sync + 'static) {
        let _ = self.start.set(Box::new(start));
    }

    /// Records that the region's Redis is new or lost its data.
    pub fn mark_region_fresh(&self) {
        self.region_fresh.store(true, Ordering::SeqCst);
    }

    /// The quota, created (with its renewer) on first use; `None` when
    /// [`crate::quotas::MAX_LEARNING`] quotas are still learning their policy.
    pub fn quota(&self, tenant: &str, resource: &str) -> Option<Arc<Quota>> {
        self.quota_of(tenant, resource, false)
    }

    /// [`Registry::quota`]; `known` for a quota of the agent's quota set
    /// (see [`Quotas::get_or_create`]).
    pub fn quota_of(&self, tenant: &str, resource: &str, known: bool) -> Option<Arc<Quota>> {
        let first = if self.region_fresh.load(Ordering::SeqCst) { "?" } else { "" };
        let (q, created) = self.quotas.get_or_create(
            tenant,
            resource,
            || self.keys.quota(tenant, resource),
            first,
            known,
        )?;
        if created {
            match self.start.get() {
                Some(start) => start(q.clone()),
                None => {
                    tracing::error!(%tenant, %resource, "a quota was created before renewers could start")
                }
            }
        }
        Some(q)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    #[test]
    fn a_renewer_starts_once_per_created_quota() {
        let r = Registry::new(Arc::default(), Keys::new("t:"));
        let started = Arc::new(Mutex::new(Vec::new()));
        let s = started.clone();
        r.on_create(move |q| s.lock().unwrap().push(q.resource.clone()));
        let a = r.quota("t", "a").unwrap();
        let again = r.quota("t", "a").unwrap();
        assert!(Arc::ptr_eq(&a, &again));
        r.quota("t", "b").unwrap();
        assert_eq!(*started.lock().unwrap(), ["a", "b"]);
    }

    #[test]
    fn a_fresh_region_starts_new_quotas_on_an_unknown_incarnation() {
        let r = Registry::new(Arc::default(), Keys::new("t:"));
        r.on_create(|_| {});
        let before = r.quota("t", "a").unwrap();
        r.mark_region_fresh();
        let after = r.quota("t", "b").unwrap();
        assert_eq!((before.token().as_str(), after.token().as_str()), ("", "?"));
    }
}
