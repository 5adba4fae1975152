//! Concurrency quotas (issue 30, seed 002 F27): a global semaphore of
//! `max_in_flight` permits. The allocator leases permits to regions like
//! tokens, except that they come back when released rather than at a
//! window end; the agent hands one out on `POST /v1/acquire` (the answer
//! carries `permit_id`), takes it back on `POST /v1/permits/{id}/release`,
//! extends it on `/renew`, and lets it expire after `permit_ttl_secs`.
//!
//! The bound (never more than `max_in_flight` live permits across regions,
//! no fallback allowance in any mode) rests on three rules, one per party:
//! the allocator never holds more for all live region leases than
//! `max_in_flight`; a region never has more live permits than its lease
//! holds (`lua/permit.lua` lowers its cap before telling the allocator,
//! and raises it only after the allocator granted); and no permit outlives
//! its region's lease, so when a lease expires (a region cut off, or gone)
//! every permit handed out under it has expired too, and the allocator may
//! give them to another region. A region whose Redis forgot its permits
//! (restart, failover, restored snapshot, eviction) hands out none for a
//! TTL. Lease calls carry the sequence number of the lease the region
//! applied and are compare-and-set on both sides, so replicas of a region
//! and answers that arrive late cannot undo each other.
//!
//! Parts: [`rule`] (pure), [`lease`] (the calls and the maintenance task);
//! the routes are `crate::permit_routes`'s, above the app state.

pub mod lease;
pub mod rule;

use crate::client::AllocatorClient;
use crate::identity::Identity;
use crate::keys::Keys;
use crate::store::Store;
use quota_shared::prom::Registry as Metrics;
use quota_shared::wire::{FailMode, PermitLease};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Most concurrency quotas one agent keeps in memory.
pub const MAX_QUOTAS: usize = 10_000;

/// Most concurrency quotas `GET /v1/status` lists (one Redis call each).
pub const STATUS_MAX: usize = 100;

/// How long a quota with no permit out and none held stays in memory.
const IDLE: Duration = Duration::from_secs(600);

/// A concurrency policy as the last lease answer showed it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PermitPolicy {
    pub max_in_flight: i64,
    pub ttl_ms: i64,
    pub fail_mode: FailMode,
    pub version: i64,
}

impl PermitPolicy {
    fn of(l: &PermitLease) -> PermitPolicy {
        PermitPolicy {
            max_in_flight: l.max_in_flight,
            ttl_ms: l.permit_ttl_secs.saturating_mul(1000),
            fail_mode: l.fail_mode,
            version: l.version,
        }
    }
}

/// One concurrency quota this agent knows.
pub struct PermitQuota {
    pub tenant: String,
    pub resource: String,
    /// The quota's key prefix ([`Keys::permit_quota`]).
    pub prefix: String,
    policy: Mutex<Option<PermitPolicy>>,
    last_used: Mutex<Instant>,
    /// One lease call of this replica at a time (the others of the region
    /// are fenced by the lease's sequence number).
    calling: tokio::sync::Mutex<()>,
}

impl PermitQuota {
    /// The policy, once a lease answer showed it.
    pub fn policy(&self) -> Option<PermitPolicy> {
        *self.policy.lock().unwrap()
    }

    fn learn(&self, l: &PermitLease) {
        let p = PermitPolicy::of(l);
        let mut cur = self.policy.lock().unwrap();
        if cur.is_none_or(|c| c.version <= p.version) {
            *cur = Some(p);
        }
    }
}

/// The concurrency quotas of this agent and what their calls need.
pub struct Permits {
    pub store: Store,
    pub keys: Keys,
    pub alloc: Arc<AllocatorClient>,
    pub ident: Arc<Identity>,
    pub metrics: Arc<Metrics>,
    pub region: String,
    pub agent: String,
    quotas: Mutex<HashMap<(String, String), Arc<PermitQuota>>>,
}

impl Permits {
    pub fn new(
        store: Store,
        keys: Keys,
        alloc: Arc<AllocatorClient>,
        ident: Arc<Identity>,
        metrics: Arc<Metrics>,
        region: &str,
        agent: &str,
    ) -> Permits {
        Permits {
            store,
            keys,
            alloc,
            ident,
            metrics,
            region: region.into(),
            agent: agent.into(),
            quotas: Mutex::default(),
        }
    }

    /// The quota, if it is known to be a concurrency quota.
    pub fn get(&self, tenant: &str, resource: &str) -> Option<Arc<PermitQuota>> {
        let q = self.quotas.lock().unwrap().get(&(tenant.to_string(), resource.to_string())).cloned()?;
        *q.last_used.lock().unwrap() = Instant::now();
        Some(q)
    }

    /// Records that the allocator said the quota is a concurrency one (a
    /// grant answered `concurrency_policy`; nothing a client sends can).
    /// `None` when [`MAX_QUOTAS`] are known and none is idle.
    pub fn mark(&self, tenant: &str, resource: &str) -> Option<Arc<PermitQuota>> {
        let mut m = self.quotas.lock().unwrap();
        let k = (tenant.to_string(), resource.to_string());
        if let Some(q) = m.get(&k) {
            *q.last_used.lock().unwrap() = Instant::now();
            return Some(q.clone());
        }
        if m.len() >= MAX_QUOTAS {
            let now = Instant::now();
            m.retain(|_, q| now.duration_since(*q.last_used.lock().unwrap()) < IDLE);
            if m.len() >= MAX_QUOTAS {
                return None;
            }
        }
        let q = Arc::new(PermitQuota {
            tenant: tenant.into(),
            resource: resource.into(),
            prefix: self.keys.permit_quota(tenant, resource),
            policy: Mutex::default(),
            last_used: Mutex::new(Instant::now()),
            calling: tokio::sync::Mutex::default(),
        });
        m.insert(k, q.clone());
        Some(q)
    }

    /// Whether the quota is known to be a concurrency one.
    pub fn is_concurrency(&self, tenant: &str, resource: &str) -> bool {
        self.quotas.lock().unwrap().contains_key(&(tenant.to_string(), resource.to_string()))
    }

    /// Every known quota (for the maintenance task).
    fn all(&self) -> Vec<Arc<PermitQuota>> {
        self.quotas.lock().unwrap().values().cloned().collect()
    }

    /// The status of at most `max` known quotas (by name), as the region's
    /// Redis holds their permits.
    pub async fn status(&self, max: usize) -> Vec<serde_json::Value> {
        let mut qs = self.all();
        qs.sort_by(|a, b| (&a.tenant, &a.resource).cmp(&(&b.tenant, &b.resource)));
        let mut out = Vec::new();
        for q in qs.into_iter().take(max) {
            let p = q.policy();
            let plan = crate::scripts::permit_plan(&self.store, &q.prefix, None).await.ok();
            let s = plan.and_then(|p| p.state);
            out.push(serde_json::json!({
                "tenant": q.tenant,
                "resource": q.resource,
                "max_in_flight": p.map(|p| p.max_in_flight),
                "permit_ttl_secs": p.map(|p| p.ttl_ms / 1000),
                "policy_version": p.map(|p| p.version),
                "live": s.map(|s| s.live),
                "cap": s.map(|s| s.cap),
                "lease_in_ms": s.map(|s| s.lease_in_ms.max(0)),
                "blocked_in_ms": s.map(|s| s.blocked_in_ms.max(0)),
                "lost": p.is_some() && plan.is_some() && s.is_none(),
            }));
        }
        out
    }

    /// Forgets a quota idle for [`IDLE`] that holds nothing.
    fn forget_if_idle(&self, q: &PermitQuota) {
        if q.last_used.lock().unwrap().elapsed() >= IDLE {
            self.quotas.lock().unwrap().remove(&(q.tenant.clone(), q.resource.clone()));
        }
    }
}

/// Declares the permit metrics, every series from 0 (so that `increase()`
/// and the dashboard see the first event).
pub fn describe(m: &Metrics) {
    m.counter_from_zero(
        "agent_permit_decisions_total",
        "Permit hand-outs and returns by outcome (granted, replayed, refused, blocked, released, renewed, gone, not_holder, or the error code)",
        "outcome",
        &["granted", "replayed", "refused", "blocked", "released", "renewed", "gone", "not_holder"],
    );
    m.counter_from_zero(
        "agent_permit_lease_calls_total",
        "Permit lease calls to the allocator by outcome (applied, conflict, failed)",
        "outcome",
        &["applied", "conflict", "failed"],
    );
    m.describe(
        "agent_permit_state_lost_total",
        "counter",
        "Times the region's permit state was found lost while the allocator held permits for it (hand-outs stop for a permit TTL)",
    );
    m.inc_by("agent_permit_state_lost_total", &[], 0.0);
    m.describe(
        "agent_permits_live",
        "gauge",
        "Live permits of the concurrency quotas this agent knows, in its region",
    );
    m.set("agent_permits_live", &[], 0.0);
}

/// Separates the parts of a permit id; not in the id alphabet, and left
/// as it is in a URL path.
const SEP: char = '~';

/// A new permit id: `<tenant>~<resource>~<32 hex>`. The quota is in the id
/// so that a release or renewal reaches the quota's keys in one step, on
/// any replica of the region. With a request id the hex part is derived
/// from it, so a retried acquire finds the permit it was given before.
pub fn new_id(tenant: &str, resource: &str, request_id: Option<&str>) -> String {
    let tail = match request_id {
        None => uuid::Uuid::new_v4().simple().to_string(),
        Some(r) => {
            // Two FNV-1a hashes of (tenant, resource, request id) with
            // different offsets: the same inputs give the same id on every
            // replica and every build (the id outlives a rolling upgrade).
            let h = |offset: u64| {
                let mut h = offset;
                for b in tenant.bytes().chain([0]).chain(resource.bytes()).chain([0]).chain(r.bytes()) {
                    h ^= u64::from(b);
                    h = h.wrapping_mul(0x0100_0000_01b3);
                }
                h
            };
            format!("{:016x}{:016x}", h(0xcbf2_9ce4_8422_2325), h(0x6c62_272e_07bb_0142))
        }
    };
    format!("{tenant}{SEP}{resource}{SEP}{tail}")
}

/// The quota a permit id names, if it is one this agent could have made.
pub fn parse_id(id: &str) -> Option<(&str, &str)> {
    let mut parts = id.split(SEP);
    let (tenant, resource, tail) = (parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some()
        || quota_shared::ids::validate_id(tenant).is_err()
        || quota_shared::ids::validate_id(resource).is_err()
        || tail.len() != 32
        || !tail.bytes().all(|b| b.is_ascii_hexdigit())
    {
        return None;
    }
    Some((tenant, resource))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_id_names_its_quota_and_a_request_id_gives_the_same_id() {
        let a = new_id("acme", "export", None);
        assert_eq!(parse_id(&a), Some(("acme", "export")));
        assert_ne!(a, new_id("acme", "export", None));
        let r = new_id("acme", "export", Some("job-7"));
        assert_eq!(r, new_id("acme", "export", Some("job-7")));
        assert_ne!(r, new_id("acme", "export", Some("job-8")));
        assert_ne!(r, new_id("acme", "exports", Some("job-7")));
        assert_eq!(parse_id(&r), Some(("acme", "export")));
    }

    #[test]
    fn a_malformed_id_names_no_quota() {
        for bad in [
            "",
            "acme~export",
            "acme~export~xyz",
            "acme~export~0123456789abcdef0123456789abcdeg",
            "acme~ex port~0123456789abcdef0123456789abcdef",
            "acme~export~0123456789abcdef0123456789abcdef~x",
        ] {
            assert_eq!(parse_id(bad), None, "{bad}");
        }
    }
}
