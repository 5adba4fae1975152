//! The scenario catalogue: every scenario's name and what it shows, in
//! the order they run. Its own module so that the figures' renderer (which
//! lists the scenarios in this order) needs no part of the runner, which
//! in turn publishes through the figures.

/// Every scenario, in the order they run, with what it shows.
pub const SCENARIOS: &[(&str, &str)] = &[
    ("partition-bounded", "a region cut off from the allocator for 2+ windows, bounded fallback"),
    ("partition-strict", "the same in strict mode: admitted <= G, 503 and never 429"),
    (
        "partition-heal-repaid",
        "demand above G, a region cut off within one window and healed mid-window: its fallback repaid, admitted <= G",
    ),
    ("lost-grant-replies", "grant replies swallowed, agents retry: replays, no double debit"),
    ("allocator-kill", "one of two allocator replicas SIGKILLed mid-traffic and restarted"),
    ("agent-restart", "an agent SIGKILLed and restarted: new epoch, old epoch refused"),
    ("redis-restart-empty", "a region's Redis restarted empty mid-window"),
    ("redis-rollback", "a region's Redis restarted from an older snapshot, demand above G, strict"),
    ("redis-failover", "eu's Redis primary killed, Sentinel promotes a replica that missed writes, strict"),
    ("redis-eviction", "eu's Redis switched to maxmemory-policy allkeys-lru for 1.5 windows and back"),
    ("postgres-restart", "PostgreSQL killed and restarted: agents serve from leases"),
    (
        "postgres-failover",
        "Patroni + HAProxy: the primary's host killed, Patroni promotes its synchronous standby: no grant lost",
    ),
    (
        "postgres-failover-async",
        "the same with an asynchronous replica that missed commits: lost grants and reports counted",
    ),
    ("postgres-switchover", "patronictl switchover (planned maintenance): nothing lost, the gap measured"),
    ("etcd-loss", "etcd killed past the leader key's ttl: Patroni demotes the primary, 503s, resumes"),
    ("clock-skew", "agents with wall clocks 30 s ahead and behind"),
    ("demand-skew", "DESIGN §4 skew and contention outcomes, rollover without a gap"),
    ("zombie", "an old agent incarnation keeps sending after its re-registration"),
    ("paused-agent", "an agent SIGSTOPped past its leases' life, then SIGCONTed"),
    (
        "export-concurrency",
        "F27: exports capped at 3 in flight across regions: load, a dead holder, a double release, a partition",
    ),
    (
        "policy-rollout",
        "F24/F25: a version 100x too tight rolled out to the canary halts by itself; then a roll forward",
    ),
    (
        "retry-wave",
        "F26: a synchronized wave of refused clients retries after Retry-After, with and without server jitter",
    ),
    ("bogus-principals", "F14/F15/F35: a flood of distinct bogus keys: Redis memory, evictions, TTLs, script rate"),
    (
        "key-namespace-shadow",
        "F34: a rolling change of the Redis key layout with the policy in shadow mode, decisions diffed",
    ),
    (
        "corrupted-telemetry",
        "F30: fleet statuses corrupted, replayed and duplicated: enforcement and ledger totals unchanged",
    ),
    ("retried-debit", "F11: debits retried after a timeout, with and without a request_id"),
    ("netns-partition", "a region cut off at the kernel level (network namespace)"),
];

/// The scenarios whose database is a Patroni cluster behind HAProxy.
pub const PATRONI_SCENARIOS: &[&str] =
    &["postgres-failover", "postgres-failover-async", "postgres-switchover", "etcd-loss"];
