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
//! sharing a gate only share its places. Nothing about the rules changes:
//! the statement is the same, and a grant still waits for the row lock
//! inside the server when several replicas send at once.

use std::hash::{Hash, Hasher};
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

    /// Waits for a place for a statement of `tenant/resource`; the place is
    /// given back when the permit drops.
    pub async fn enter(&self, tenant: &str, resource: &str) -> SemaphorePermit<'_> {
        // The semaphores are never closed, so acquiring cannot fail.
        self.gates[Self::index(tenant, resource)].acquire().await.expect("a gate is never closed")
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

    #[tokio::test]
    async fn at_most_the_places_of_a_quota_are_taken_at_once() {
        let gate = QuotaGate::new(2);
        let a = gate.enter("atlas", "search").await;
        let _b = gate.enter("atlas", "search").await;
        let third = gate.enter("atlas", "search");
        tokio::pin!(third);
        assert!(futures::poll!(third.as_mut()).is_pending(), "a third statement entered");
        drop(a);
        assert!(futures::poll!(third.as_mut()).is_ready(), "a place given back was not taken");
    }
}
