//! How many grant statements of one quota this replica runs at once.
//!
//! Every grant of a quota locks the same pool row, so PostgreSQL runs them
//! one after another however many arrive. Sent all at once (64 agents
//! renewing a hot quota, across two replicas' pools), they queue on the row
//! lock inside the server, each waiting backend holding a connection and
//! waking to find the lock taken again; measured, a second replica made a
//! hot quota slower (`grants.c64.hot.r2` below `r1`). The gate keeps the
//! queue in the replica instead: at most [`PER_QUOTA`] statements of a
//! quota are in flight from a replica, and the others wait for a place
//! without holding a connection.
//!
//! Quotas are mapped onto a fixed set of gates by a hash of their name, so
//! the gate's memory is bounded whatever the number of quotas; two quotas
//! sharing a gate only share its places. A grant waits for its place as
//! long as for a pool connection (`DB_ACQUIRE_TIMEOUT`), and is answered
//! the same `503` when none comes. Nothing about the rules changes:
//! the statement is the same, and a grant still waits for the row lock
//! inside the server when several replicas send at once.

use std::hash::{Hash, Hasher};
use std::time::Duration;
use tokio::sync::{Semaphore, SemaphorePermit};

/// Statements of one quota in flight from one replica at most.
pub const PER_QUOTA: usize = 4;
/// Gates the quotas are spread over.
const GATES: usize = 1024;

/// The gates of one replica.
pub struct QuotaGate {
    gates: Box<[Semaphore]>,
}

impl Default for QuotaGate {
    fn default() -> Self {
        QuotaGate::new(PER_QUOTA)
    }
}

impl QuotaGate {
    /// Gates with `places` statements each.
    pub fn new(places: usize) -> Self {
        QuotaGate { gates: (0..GATES).map(|_| Semaphore::new(places.max(1))).collect() }
    }

    /// The gate of `tenant/resource` (pure: the same name, the same gate).
    fn index(tenant: &str, resource: &str) -> usize {
        let mut h = std::hash::DefaultHasher::new();
        (tenant, resource).hash(&mut h);
        (h.finish() % GATES as u64) as usize
    }

    /// Waits up to `wait` for a place for a statement of `tenant/resource`
    /// (`None`: none came free in time); the place is given back when the
    /// permit drops.
    pub async fn enter(&self, tenant: &str, resource: &str, wait: Duration) -> Option<SemaphorePermit<'_>> {
        let gate = &self.gates[Self::index(tenant, resource)];
        // The semaphores are never closed, so acquiring fails only by time.
        tokio::time::timeout(wait, gate.acquire()).await.ok()?.ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_quota_always_maps_to_the_same_gate_and_quotas_spread() {
        assert_eq!(QuotaGate::index("atlas", "search"), QuotaGate::index("atlas", "search"));
        assert_ne!(QuotaGate::index("atlas", "search"), QuotaGate::index("search", "atlas"));
        let used: std::collections::HashSet<usize> =
            (0..10_000).map(|i| QuotaGate::index("t", &format!("q{i}"))).collect();
        assert!(used.len() > GATES * 9 / 10, "10,000 quotas used {} of {GATES} gates", used.len());
    }

    const WAIT: Duration = Duration::from_secs(3);

    #[tokio::test]
    async fn at_most_the_places_of_a_quota_are_taken_at_once() {
        let gate = QuotaGate::new(2);
        let a = gate.enter("atlas", "search", WAIT).await.expect("a first place");
        let _b = gate.enter("atlas", "search", WAIT).await.expect("a second place");
        let third = gate.enter("atlas", "search", WAIT);
        tokio::pin!(third);
        assert!(futures::poll!(third.as_mut()).is_pending(), "a third statement entered");
        drop(a);
        let entered = matches!(futures::poll!(third.as_mut()), std::task::Poll::Ready(Some(_)));
        assert!(entered, "a place given back was not taken");
    }

    #[tokio::test]
    async fn a_statement_waits_for_a_place_no_longer_than_it_is_told() {
        let gate = QuotaGate::new(1);
        let _held = gate.enter("atlas", "search", WAIT).await.expect("a first place");
        let wait = Duration::from_millis(50);
        let started = std::time::Instant::now();
        assert!(gate.enter("atlas", "search", wait).await.is_none(), "a second place while one is held");
        let waited = started.elapsed();
        assert!(waited >= wait && waited < WAIT, "waited {waited:?} for a place, told {wait:?}");
    }
}
