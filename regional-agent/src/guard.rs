//! The eviction policy guard (I5, I6): the agent admits only from a Redis
//! that never evicts. With any `maxmemory-policy` but `noeviction`, Redis may
//! drop a lease's balance (stranded, the safe side) but also a spent
//! counter, a request id or an epoch fence under memory pressure, and a
//! token could then be spent twice. So while the region's Redis runs with
//! another policy, `POST /v1/acquire` answers `503 store_unavailable` with a
//! message naming the policy and the fix, and `/readyz` answers 503.
//!
//! The check reads `INFO` (one round trip for `maxmemory_policy`,
//! `evicted_keys`, the server's `run_id` and role; it works where `CONFIG`
//! is renamed or disabled, as on managed services), and `CONFIG GET
//! maxmemory-policy` only when `INFO` lacks the field. It runs once before
//! the agent serves, then every `--redis-policy-check-ms` (5 s by default),
//! every 250 ms while no check has succeeded yet, and at once when a
//! Sentinel lookup found a new primary. On a Redis Cluster every primary is
//! read and the worst policy wins.
//!
//! **Before the first successful check the agent does not admit** (503
//! `store_unavailable`): it cannot tell a safe Redis from an evicting one.
//! A failed check (Redis unreachable) keeps the last verdict: the spend
//! path then fails on its own and answers as DESIGN §4 says.
//!
//! A rise of `evicted_keys` is logged as a possible loss of the region's
//! state; the spend script detects the loss of a quota's keys itself.

use crate::error::Error;
use crate::store::{Store, StoreError};
use quota_shared::prom::Registry;
use redis::Value;
use std::sync::Mutex;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// The one policy under which Redis never drops a key on its own.
pub const SAFE_POLICY: &str = "noeviction";

/// Period of the check until it first succeeds.
const UNVERIFIED_PERIOD: Duration = Duration::from_millis(250);

/// What a `maxmemory-policy` value means for admission.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PolicyClass {
    /// `noeviction`: writes fail when memory is full; nothing is dropped.
    Safe,
    /// Any other policy (`allkeys-*`, `volatile-*`): keys may disappear.
    Evicting(String),
}

/// Classifies a `maxmemory-policy` value (case and surrounding blanks do
/// not matter; an unknown value counts as evicting, the safe side).
pub fn classify(policy: &str) -> PolicyClass {
    let p = policy.trim().to_ascii_lowercase();
    if p == SAFE_POLICY {
        PolicyClass::Safe
    } else {
        PolicyClass::Evicting(p)
    }
}

/// The fields of one server's `INFO` answer the guard uses.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct InfoFields {
    /// `maxmemory_policy` (Memory section).
    pub maxmemory_policy: Option<String>,
    /// `evicted_keys` (Stats section): keys evicted since the server started.
    pub evicted_keys: Option<u64>,
    /// `run_id` (Server section): changes on a restart or another server.
    pub run_id: Option<String>,
    /// `role` (Replication section): `master` or `slave`.
    pub role: Option<String>,
}

/// Reads the fields of an `INFO` text (`name:value` lines, `#` headings).
pub fn parse_info(text: &str) -> InfoFields {
    let mut f = InfoFields::default();
    for line in text.lines() {
        let Some((k, v)) = line.trim().split_once(':') else { continue };
        let v = v.trim();
        match k {
            "maxmemory_policy" => f.maxmemory_policy = Some(v.to_string()),
            "evicted_keys" => f.evicted_keys = v.parse().ok(),
            "run_id" => f.run_id = Some(v.to_string()),
            "role" => f.role = Some(v.to_string()),
            _ => {}
        }
    }
    f
}

/// The guard's verdict.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// No check has succeeded yet: refuse.
    Unverified,
    /// The server's policy, classified.
    Checked(PolicyClass),
}

impl Verdict {
    /// Why the agent does not admit, or `None` when it may.
    pub fn refusal(&self) -> Option<String> {
        match self {
            Verdict::Checked(PolicyClass::Safe) => None,
            Verdict::Unverified => Some(
                "the region's Redis maxmemory-policy has not been read yet; the agent admits only \
                 from a Redis with maxmemory-policy noeviction"
                    .into(),
            ),
            Verdict::Checked(PolicyClass::Evicting(p)) => Some(format!(
                "the region's Redis runs with maxmemory-policy {p}, which may evict the agent's \
                 counters and admit a token twice; set maxmemory-policy noeviction (CONFIG SET \
                 maxmemory-policy noeviction and in redis.conf, or the provider's parameter group)"
            )),
        }
    }
}

/// The last check's result, shared by the acquire path, `/readyz` and the
/// checking task.
#[derive(Debug)]
pub struct Guard {
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    verdict: Verdict,
    evicted: Option<u64>,
    run_ids: Vec<String>,
    /// The last failure logged, so a failing check logs once per change.
    failure: Option<String>,
}

impl Default for Guard {
    fn default() -> Self {
        Guard {
            state: Mutex::new(State {
                verdict: Verdict::Unverified,
                evicted: None,
                run_ids: Vec::new(),
                failure: None,
            }),
        }
    }
}

impl Guard {
    /// The current verdict.
    pub fn verdict(&self) -> Verdict {
        self.state.lock().unwrap().verdict.clone()
    }

    /// `Ok` when the agent may admit from the region's Redis; otherwise the
    /// `503 store_unavailable` to answer.
    pub fn admit(&self) -> Result<(), Error> {
        match self.refusal() {
            None => Ok(()),
            Some(reason) => Err(Error::StoreNotSafe(reason)),
        }
    }

    /// Why the agent does not admit, or `None` when it may. Before the
    /// first successful check, a failed one names its reason (Redis
    /// unreachable, a TLS handshake refused), which says more than "not
    /// read yet".
    pub fn refusal(&self) -> Option<String> {
        let st = self.state.lock().unwrap();
        match (&st.verdict, &st.failure) {
            (Verdict::Unverified, Some(why)) => Some(format!(
                "the region's Redis cannot be used ({why}); the agent admits only after reading its \
                 maxmemory-policy"
            )),
            (v, _) => v.refusal(),
        }
    }

    /// Records a reading of every node, logging each change once.
    fn apply(&self, nodes: &[InfoFields], metrics: &Registry) {
        let class = nodes
            .iter()
            .map(|n| classify(n.maxmemory_policy.as_deref().unwrap_or_default()))
            .find(|c| *c != PolicyClass::Safe)
            .unwrap_or(PolicyClass::Safe);
        let evicted: Option<u64> = nodes.iter().map(|n| n.evicted_keys).sum();
        let run_ids: Vec<String> = nodes.iter().filter_map(|n| n.run_id.clone()).collect();
        let mut st = self.state.lock().unwrap();
        let verdict = Verdict::Checked(class);
        if st.verdict != verdict {
            match &verdict {
                Verdict::Checked(PolicyClass::Safe) => {
                    tracing::info!(policy = SAFE_POLICY, "Redis eviction policy is noeviction: admitting")
                }
                v => {
                    tracing::error!(reason = %v.refusal().unwrap_or_default(), "not admitting from the region's Redis")
                }
            }
        }
        if st.failure.take().is_some() {
            tracing::info!("Redis eviction policy check succeeds again");
        }
        let same_servers = st.run_ids == run_ids;
        match (st.evicted, evicted) {
            (Some(before), Some(now)) if same_servers && now > before => tracing::warn!(
                evicted = now - before,
                "Redis evicted keys since the last check: the region's leases, counters or fences may be lost \
                 (the spend script treats a quota's lost keys as data loss)"
            ),
            (None, Some(now)) if now > 0 => tracing::warn!(
                evicted_keys = now,
                "Redis has evicted keys since it started: the region's state may have been lost before"
            ),
            _ => {}
        }
        if !st.run_ids.is_empty() && !same_servers {
            tracing::warn!(
                "the region's Redis server changed (new run_id: a restart or a failover); its data may be older"
            );
        }
        metrics.set(
            "agent_redis_eviction_policy_ok",
            &[],
            if verdict == Verdict::Checked(PolicyClass::Safe) { 1.0 } else { 0.0 },
        );
        if let Some(n) = evicted {
            metrics.set("agent_redis_evicted_keys", &[], n as f64);
        }
        st.verdict = verdict;
        st.evicted = evicted;
        st.run_ids = run_ids;
    }

    /// Notes a failed check (logged once per distinct failure).
    fn failed(&self, why: String) {
        let mut st = self.state.lock().unwrap();
        if !st.failure.as_deref().is_some_and(|f| crate::store::same_reason(f, &why)) {
            tracing::warn!(error = %why, verdict = ?st.verdict, "Redis eviction policy check failed; keeping the last verdict");
        }
        st.failure = Some(why);
    }
}

/// Declares the guard's metric families.
pub fn describe(m: &Registry) {
    m.describe(
        "agent_redis_eviction_policy_ok",
        "gauge",
        "1 while the region's Redis runs with maxmemory-policy noeviction (the agent admits only then)",
    );
    m.describe(
        "agent_redis_evicted_keys",
        "gauge",
        "The region's Redis evicted_keys (INFO stats), summed over primaries",
    );
}

/// The `INFO` texts of an answer: one server's string, or a cluster's map
/// of node → string.
fn info_texts(v: Value) -> Result<Vec<String>, StoreError> {
    fn text(v: Value) -> Result<String, StoreError> {
        match v {
            Value::BulkString(b) => Ok(String::from_utf8_lossy(&b).into_owned()),
            Value::VerbatimString { text, .. } => Ok(text),
            Value::SimpleString(s) => Ok(s),
            Value::ServerError(e) => Err(StoreError::Protocol(format!("INFO on a node: {e:?}"))),
            other => Err(StoreError::Protocol(format!("INFO answered {other:?}"))),
        }
    }
    match v {
        Value::Map(nodes) => nodes.into_iter().map(|(_, v)| text(v)).collect(),
        other => Ok(vec![text(other)?]),
    }
}

/// `CONFIG GET maxmemory-policy` on one server (an array `[name, value]`,
/// or a map).
async fn config_policy(store: &Store) -> Result<Option<String>, StoreError> {
    let v = crate::commands::config_maxmemory_policy(store).await?;
    let s = |v: &Value| match v {
        Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
        Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    };
    Ok(match &v {
        Value::Array(items) => items.get(1).and_then(s),
        Value::Map(pairs) => pairs.first().and_then(|(_, v)| s(v)),
        _ => None,
    })
}

/// Reads every node's fields.
async fn read(store: &Store) -> Result<Vec<InfoFields>, StoreError> {
    let v = crate::commands::info(store).await?;
    let mut nodes: Vec<InfoFields> = info_texts(v)?.iter().map(|t| parse_info(t)).collect();
    for n in nodes.iter_mut().filter(|n| n.maxmemory_policy.is_none()) {
        // A cluster's CONFIG GET reaches one random node: of no use per node.
        if store.is_cluster() {
            return Err(StoreError::Protocol("INFO of a cluster node lacks maxmemory_policy".into()));
        }
        n.maxmemory_policy = config_policy(store).await?;
    }
    if nodes.is_empty() || nodes.iter().any(|n| n.maxmemory_policy.is_none()) {
        return Err(StoreError::Protocol("neither INFO nor CONFIG GET names the maxmemory-policy".into()));
    }
    Ok(nodes)
}

/// Runs one check and records its result in `guard`; `true` when it succeeded.
pub async fn check(store: &Store, guard: &Guard, metrics: &Registry) -> bool {
    match read(store).await {
        Ok(nodes) => {
            if store.is_sentinel() && nodes.iter().any(|n| n.role.as_deref() == Some("slave")) {
                // A demoted primary still answers reads; writes would fail
                // with READONLY, reads would see a replica's view.
                store.forget_primary("the server is a replica now");
            }
            guard.apply(&nodes, metrics);
            true
        }
        Err(e) => {
            guard.failed(e.to_string());
            false
        }
    }
}

/// The checking task: every `period` (`--redis-policy-check-ms`), faster
/// until the first success, and at once after a Sentinel failover.
pub async fn run(
    store: &Store,
    guard: &Guard,
    metrics: &Registry,
    period: Duration,
    cancel: &CancellationToken,
) {
    let mut ok = guard.verdict() != Verdict::Unverified;
    loop {
        let period = if ok { period } else { UNVERIFIED_PERIOD };
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(period) => {}
            _ = store.primary_changed() => {}
        }
        ok = check(store, guard, metrics).await || ok;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_noeviction_is_safe() {
        assert_eq!(classify("noeviction"), PolicyClass::Safe);
        assert_eq!(classify(" NoEviction\r"), PolicyClass::Safe);
        for p in [
            "allkeys-lru",
            "allkeys-lfu",
            "allkeys-random",
            "volatile-lru",
            "volatile-lfu",
            "volatile-random",
            "volatile-ttl",
        ] {
            assert_eq!(classify(p), PolicyClass::Evicting(p.into()), "{p}");
        }
    }

    #[test]
    fn an_unknown_or_empty_policy_counts_as_evicting() {
        assert_eq!(classify("some-future-policy"), PolicyClass::Evicting("some-future-policy".into()));
        assert_eq!(classify(""), PolicyClass::Evicting(String::new()));
    }

    #[test]
    fn info_text_yields_policy_evictions_run_id_and_role() {
        let text = "# Server\r\nredis_version:7.0.15\r\nrun_id:abc123\r\n\r\n# Memory\r\n\
                    maxmemory:0\r\nmaxmemory_policy:allkeys-lru\r\n# Stats\r\nevicted_keys:42\r\n\
                    # Replication\r\nrole:master\r\n";
        assert_eq!(
            parse_info(text),
            InfoFields {
                maxmemory_policy: Some("allkeys-lru".into()),
                evicted_keys: Some(42),
                run_id: Some("abc123".into()),
                role: Some("master".into()),
            }
        );
        assert_eq!(parse_info("# Server\r\nfoo:bar\r\n"), InfoFields::default());
    }

    #[test]
    fn the_refusal_names_the_policy_and_the_fix() {
        let r = Verdict::Checked(classify("volatile-lru")).refusal().expect("refused");
        assert!(r.contains("volatile-lru") && r.contains("set maxmemory-policy noeviction"), "{r}");
        assert!(Verdict::Unverified.refusal().is_some());
        assert_eq!(Verdict::Checked(PolicyClass::Safe).refusal(), None);
    }

    #[test]
    fn the_worst_node_decides_and_evictions_add_up() {
        let g = Guard::default();
        let m = Registry::default();
        let node = |p: &str, e| InfoFields {
            maxmemory_policy: Some(p.into()),
            evicted_keys: Some(e),
            run_id: Some(p.into()),
            role: None,
        };
        g.apply(&[node("noeviction", 1), node("allkeys-lru", 2)], &m);
        assert_eq!(g.verdict(), Verdict::Checked(PolicyClass::Evicting("allkeys-lru".into())));
        assert!(matches!(g.admit(), Err(Error::StoreNotSafe(_))));
        assert_eq!(g.state.lock().unwrap().evicted, Some(3));
        g.apply(&[node("noeviction", 0)], &m);
        assert!(g.admit().is_ok());
    }
}
