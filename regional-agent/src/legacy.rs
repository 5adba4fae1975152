//! The rolling upgrade from the legacy key layout (one Redis Cluster slot
//! per quota, `q:{<tenant>/<resource>}:`) to the tenant layout (one slot
//! per tenant, `q:{<tenant>}:<resource>:`, see [`crate::keys`]).
//!
//! During an upgrade old and new agents share the region's Redis but not
//! its keys. Leases are the allocator's and stay within the pool whoever
//! holds them; what could break the bound (F34) is the region's fallback
//! allowance, which each layout would count under its own keys, so a
//! partitioned region could admit it twice in one window. So a new agent:
//!
//! * takes no fallback before the region's *legacy gate*: the last
//!   instant a legacy agent may have been alive (its liveness key seen,
//!   plus that key's life). Every agent looks every second (a timer of its
//!   own); a look that sees one moves the gate (`lua/legacy.lua`), one that
//!   fails closes it until the next. The gate is sent to every spend run,
//!   which compares it with the region's one clock (Redis `TIME`);
//! * after the gate, adds what the legacy layout's fallback counter of the
//!   window holds (frozen: nobody writes it any more) to its own, read just
//!   before the spend run, on the fallback path only. The gate is sent
//!   [`READ_SLACK_MS`] later than it is, so a count read up to that long
//!   before the run (a run queued behind another) was read after it;
//! * reports and releases what the old layout holds: it cuts the legacy
//!   counters of its quotas into outboxes and sends them, retires expired
//!   legacy leases (their unspent tokens go back), and adopts the outboxes
//!   of gone agents under both layouts;
//! * stops sweeping a quota's legacy keys once they are empty and the gate
//!   passed a window ago (again when a legacy agent shows up); the frozen
//!   count is read on the fallback path while the region has a gate at all.
//!
//! Not covered: starting an older agent in a region already upgraded
//! (a downgrade) is seen at the next look of a new agent, not before;
//! per-key buckets and request-id records start afresh in the new layout
//! (while both layouts serve a region a key is judged by two buckets, up
//! to twice its rate plus one burst more; a retry that crosses the upgrade
//! may be decided again; both within the quota's bound).

use crate::commands;
use crate::keys::{Keys, Layout};
use crate::store::{Store, StoreError};
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// The liveness value of an agent of the tenant layout (a legacy agent
/// writes `1`).
pub const LIVE_TENANT: &str = "2";
/// The liveness value of an agent of the legacy layout.
pub const LIVE_LEGACY: &str = "1";
/// How much later than it is the gate is sent to spend runs: longer than a
/// spend run waits in its quota's queue (two Redis timeouts) after the
/// legacy count it carries was read.
pub const READ_SLACK_MS: i64 = 5_000;
/// Most legacy agents looked at per look; a larger legacy agent set counts
/// as one with a live agent (no sample may miss one).
const MAX_LOOKED_AT: i64 = 256;
/// How often the region is looked at: well within the gate's margin (the
/// liveness key's 10 s and [`READ_SLACK_MS`]), on a timer of its own so a
/// slow outbox round cannot hold it.
pub const LOOK_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

/// This agent's view of the region's legacy gate.
#[derive(Debug)]
pub struct Gate {
    /// Redis clock ms; no fallback before it. `i64::MAX` until the first
    /// look, and after a look that failed (no fallback).
    until_ms: AtomicI64,
    /// Whether the last look found a legacy agent alive.
    legacy_live: AtomicBool,
}

impl Gate {
    /// A gate that lets no fallback through until the first look.
    pub fn new(layout: Layout) -> Gate {
        // Agents of the legacy layout do as legacy agents did: no gate.
        let until = if layout == Layout::Legacy { 0 } else { i64::MAX };
        Gate { until_ms: AtomicI64::new(until), legacy_live: AtomicBool::new(true) }
    }

    /// The gate (Redis clock, ms).
    pub fn until_ms(&self) -> i64 {
        self.until_ms.load(Ordering::Relaxed)
    }

    /// The gate as sent to spend runs (see [`READ_SLACK_MS`]).
    pub fn for_spend_ms(&self) -> i64 {
        match self.until_ms() {
            0 => 0,
            t => t.saturating_add(READ_SLACK_MS),
        }
    }

    /// Whether the region ever had a legacy gate (a legacy agent seen in the
    /// gate key's life): then a spend run that may take fallback adds the
    /// legacy layout's count of the window.
    pub fn any(&self) -> bool {
        self.until_ms() != 0
    }

    /// Whether no legacy agent has written for `window_secs` and a second
    /// (none alive, gate passed that long ago): then a quota of that
    /// window length whose legacy keys are empty stays empty, and no
    /// legacy fallback counter of an open window holds anything.
    pub fn passed(&self, window_secs: i64) -> bool {
        let now = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as i64).unwrap_or(0);
        let since = window_secs.saturating_mul(1000).saturating_add(1000);
        !self.legacy_live.load(Ordering::Relaxed) && self.until_ms() < now.saturating_sub(since)
    }
}

/// Whether any of the liveness values read is a legacy agent's (alive and
/// not of the tenant layout).
pub fn legacy_alive(values: &[Option<String>]) -> bool {
    values.iter().flatten().any(|v| v != LIVE_TENANT)
}

/// One look at the region (by an agent of the tenant layout, every
/// [`LOOK_EVERY`]): are legacy agents alive, and where is the gate now. A
/// look that cannot read everything closes the gate until the next one.
pub async fn look(store: &Store, keys: &Keys, region: &str, me: &str, live_ttl_ms: i64, gate: &Gate) {
    if keys.layout() == Layout::Legacy {
        return;
    }
    match legacy_live(store, keys, region, me).await {
        Ok(live) => {
            let until_key = keys.region_legacy_until(region);
            match crate::scripts::legacy_gate(store, &until_key, live, live_ttl_ms).await {
                Ok(until) => {
                    if live && !gate.legacy_live.load(Ordering::Relaxed) {
                        tracing::warn!(region, "an agent of the legacy key layout is alive in the region: no fallback allowance in the tenant layout until it is gone");
                    }
                    gate.legacy_live.store(live, Ordering::Relaxed);
                    gate.until_ms.store(until, Ordering::Relaxed);
                    return;
                }
                Err(e) => tracing::debug!(error = %e, "legacy gate not refreshed"),
            }
        }
        Err(e) => tracing::debug!(error = %e, "legacy agents not looked at"),
    }
    gate.until_ms.store(i64::MAX, Ordering::Relaxed);
}

/// Whether an agent of the legacy layout is alive in the region: every id
/// of the legacy agent set (at most [`MAX_LOOKED_AT`]; a larger set counts
/// as yes) with its liveness value.
async fn legacy_live(store: &Store, keys: &Keys, region: &str, me: &str) -> Result<bool, StoreError> {
    let set = keys.legacy_region_agents(region);
    let n = commands::set_size(store, &set).await?;
    if n > MAX_LOOKED_AT {
        return Ok(true);
    }
    let agents = commands::members(store, &set).await?;
    let mut values = Vec::with_capacity(agents.len());
    for a in agents.iter().filter(|a| *a != me) {
        // One GET per agent: their keys sit in different Cluster slots.
        values.push(commands::liveness(store, &keys.agent_live(region, a)).await?);
    }
    Ok(legacy_alive(&values))
}

/// Looks at the region every [`LOOK_EVERY`] until `cancel`.
pub async fn run(
    store: Store,
    keys: Keys,
    region: String,
    me: String,
    live_ttl_ms: i64,
    gate: std::sync::Arc<Gate>,
    cancel: tokio_util::sync::CancellationToken,
) {
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(LOOK_EVERY) => {}
        }
        look(&store, &keys, &region, &me, live_ttl_ms, &gate).await;
    }
}

/// What the legacy layout's fallback counter of quota `(tenant, resource)`
/// holds for the window starting at `window_start`, for a spend run that
/// may take fallback (see `lua/spend.lua`); unreadable counts as all of
/// `allowance` used (the safe side).
pub async fn legacy_fallback(
    store: &Store,
    keys: &Keys,
    tenant: &str,
    resource: &str,
    window_start: i64,
    allowance: i64,
) -> (i64, i64) {
    let key = Keys::fallback_counter(&keys.legacy_quota(tenant, resource), window_start);
    match commands::fallback_used(store, &key).await {
        Ok(used) => (window_start, used.unwrap_or(0)),
        Err(_) => (window_start, allowance),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_live_agent_of_the_legacy_layout_counts() {
        let v = |s: &[Option<&str>]| s.iter().map(|o| o.map(str::to_string)).collect::<Vec<_>>();
        assert!(!legacy_alive(&v(&[])));
        assert!(!legacy_alive(&v(&[None, Some(LIVE_TENANT)])));
        assert!(legacy_alive(&v(&[None, Some(LIVE_LEGACY)])));
        // Any other value is an agent that does not say it is new.
        assert!(legacy_alive(&v(&[Some("x")])));
    }

    #[test]
    fn a_new_gate_admits_no_fallback_until_looked_and_the_legacy_layout_has_none() {
        let g = Gate::new(Layout::Tenant);
        assert_eq!(g.until_ms(), i64::MAX);
        assert!(!g.passed(1));
        assert_eq!(Gate::new(Layout::Legacy).until_ms(), 0);
        g.legacy_live.store(false, Ordering::Relaxed);
        g.until_ms.store(1, Ordering::Relaxed);
        assert!(g.passed(60));
        // A legacy agent seen alive holds the gate, whatever its value.
        g.legacy_live.store(true, Ordering::Relaxed);
        assert!(!g.passed(60));
    }
}
