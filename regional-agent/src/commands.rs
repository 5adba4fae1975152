//! The agent's plain Redis commands: everything that is not one of the Lua
//! scripts of [`crate::scripts`]. Like the scripts, each command has one
//! typed function here with a span of its own (level `debug`, named
//! `redis.<what>`), so a trace shows which round trip a request waited on
//! and a reader finds every key the agent touches outside the scripts in
//! one file. Key names come from [`crate::keys`]; callers decide what an
//! error means (most of these are best effort, see each caller).
//!
//! The test `no_plain_command_outside_its_owner` keeps `redis::cmd` out of
//! the other modules (this one and the connection's own `PING` in
//! [`crate::store`] are the owners).

use crate::keys::{Keys, COUNTER_TTL_MS};
use crate::store::{Store, StoreError};
use redis::Value;
use std::collections::HashMap;

type Result<T> = std::result::Result<T, StoreError>;

// --- request ids -----------------------------------------------------

/// Claims `key` for a request id with `value` (the request's fingerprint)
/// unless it is claimed: `SET NX GET PX`. Returns the value it already
/// held (`None`: the claim is ours).
#[tracing::instrument(level = "debug", name = "redis.claim_request_id", skip_all)]
pub async fn claim_request_id(store: &Store, key: &str, value: &str, ttl_ms: i64) -> Result<Option<String>> {
    store.cmd(redis::cmd("SET").arg(key).arg(value).arg("NX").arg("GET").arg("PX").arg(ttl_ms)).await
}

/// Gives up a request id's claim (the request was not charged, so a retry
/// with another cost must not be called a mismatch).
#[tracing::instrument(level = "debug", name = "redis.forget_request_id", skip_all)]
pub async fn forget_request_id(store: &Store, key: &str) -> Result<i64> {
    store.cmd(redis::cmd("DEL").arg(key)).await
}

// --- the region and its agents -----------------------------------------

/// Sets the region's incarnation key to `token` unless it exists. Returns
/// whether it was missing (a new region, or a Redis that lost its data).
#[tracing::instrument(level = "debug", name = "redis.claim_region_incarnation", skip_all)]
pub async fn claim_region_incarnation(store: &Store, key: &str, token: &str) -> Result<bool> {
    let set: Option<String> = store.cmd(redis::cmd("SET").arg(key).arg(token).arg("NX")).await?;
    Ok(set.is_some())
}

/// The members of a set of names (an agent's quotas, a region's agents).
#[tracing::instrument(level = "debug", name = "redis.members", skip_all)]
pub async fn members(store: &Store, set: &str) -> Result<Vec<String>> {
    store.cmd(redis::cmd("SMEMBERS").arg(set)).await
}

/// How many members a set holds.
#[tracing::instrument(level = "debug", name = "redis.set_size", skip_all)]
pub async fn set_size(store: &Store, set: &str) -> Result<i64> {
    store.cmd(redis::cmd("SCARD").arg(set)).await
}

/// Up to `n` random members of a set (adoption looks at a few each round).
#[tracing::instrument(level = "debug", name = "redis.sample", skip_all)]
pub async fn sample(store: &Store, set: &str, n: usize) -> Result<Vec<String>> {
    store.cmd(redis::cmd("SRANDMEMBER").arg(set).arg(n)).await
}

/// Adds `member` to `set`.
#[tracing::instrument(level = "debug", name = "redis.join", skip_all)]
pub async fn join(store: &Store, set: &str, member: &str) -> Result<i64> {
    store.cmd(redis::cmd("SADD").arg(set).arg(member)).await
}

/// Takes `member` out of `set`.
#[tracing::instrument(level = "debug", name = "redis.leave", skip_all)]
pub async fn leave(store: &Store, set: &str, member: &str) -> Result<i64> {
    store.cmd(redis::cmd("SREM").arg(set).arg(member)).await
}

/// Keeps a region-wide key for [`COUNTER_TTL_MS`] more: a region nobody
/// runs in any more leaves nothing behind (F04).
#[tracing::instrument(level = "debug", name = "redis.keep", skip_all)]
pub async fn keep(store: &Store, key: &str) -> Result<i64> {
    store.cmd(redis::cmd("PEXPIRE").arg(key).arg(COUNTER_TTL_MS)).await
}

/// An agent's heartbeat: its liveness key (`value`, expiring after
/// `ttl_ms`) and its membership of the region's agent set.
#[tracing::instrument(level = "debug", name = "redis.heartbeat", skip_all)]
pub async fn heartbeat(store: &Store, live_key: &str, value: &str, ttl_ms: u64, set: &str, agent: &str) {
    let _: Result<()> = store.cmd(redis::cmd("SET").arg(live_key).arg(value).arg("PX").arg(ttl_ms)).await;
    let _ = join(store, set, agent).await;
    let _ = keep(store, set).await;
}

/// Whether an agent's liveness key exists.
#[tracing::instrument(level = "debug", name = "redis.is_live", skip_all)]
pub async fn is_live(store: &Store, live_key: &str) -> Result<bool> {
    let n: i64 = store.cmd(redis::cmd("EXISTS").arg(live_key)).await?;
    Ok(n > 0)
}

/// The value of a liveness key (an old agent's, during a layout upgrade).
#[tracing::instrument(level = "debug", name = "redis.liveness", skip_all)]
pub async fn liveness(store: &Store, live_key: &str) -> Result<Option<String>> {
    store.cmd(redis::cmd("GET").arg(live_key)).await
}

// --- a quota's keys ----------------------------------------------------

/// The quota's cached policy fields (empty when none is cached).
#[tracing::instrument(level = "debug", name = "redis.policy_read", skip_all)]
pub async fn policy_read(store: &Store, quota_prefix: &str) -> Result<HashMap<String, String>> {
    store.cmd(redis::cmd("HGETALL").arg(Keys::policy(quota_prefix))).await
}

/// Caches the quota's policy fields for the region's replicas.
#[tracing::instrument(level = "debug", name = "redis.policy_write", skip_all)]
pub async fn policy_write(store: &Store, quota_prefix: &str, fields: &[(&str, String)]) -> Result<i64> {
    let mut cmd = redis::cmd("HSET");
    cmd.arg(Keys::policy(quota_prefix));
    for (k, v) in fields {
        cmd.arg(*k).arg(v);
    }
    store.cmd(&cmd).await
}

/// Records that the pool of the window starting at `ws` holds nothing
/// unleased (a grant answered 0 tokens); the least value is 0, so a plain
/// `SET` keeps credit.lua's "least any answer said".
#[tracing::instrument(level = "debug", name = "redis.pool_room_empty", skip_all)]
pub async fn pool_room_empty(store: &Store, quota_prefix: &str, ws: i64, ttl_ms: i64) -> Result<()> {
    store.cmd(redis::cmd("SET").arg(Keys::pool_room(quota_prefix, ws)).arg(0).arg("PX").arg(ttl_ms)).await
}

/// Takes the quota's renew lock for `holder` unless another holds it.
#[tracing::instrument(level = "debug", name = "redis.renew_lock", skip_all)]
pub async fn take_renew_lock(store: &Store, quota_prefix: &str, holder: &str, ttl_ms: u64) -> Result<bool> {
    let got: Option<String> = store
        .cmd(
            redis::cmd("SET").arg(Keys::renew_lock(quota_prefix)).arg(holder).arg("NX").arg("PX").arg(ttl_ms),
        )
        .await?;
    Ok(got.is_some())
}

/// Marks the quota's pool as empty for `ttl_ms` (`retry_ms`: the
/// allocator's hint of when to ask again).
#[tracing::instrument(level = "debug", name = "redis.mark_exhausted", skip_all)]
pub async fn mark_exhausted(store: &Store, quota_prefix: &str, retry_ms: i64, ttl_ms: i64) -> Result<()> {
    store.cmd(redis::cmd("SET").arg(Keys::exhausted(quota_prefix)).arg(retry_ms).arg("PX").arg(ttl_ms)).await
}

/// How many of the quota's windows hold counts not yet cut into a report.
#[tracing::instrument(level = "debug", name = "redis.uncut_windows", skip_all)]
pub async fn uncut_windows(store: &Store, quota_prefix: &str) -> Result<i64> {
    set_size(store, &Keys::dirty(quota_prefix)).await
}

/// How many leases of the quota are live in the region.
#[tracing::instrument(level = "debug", name = "redis.live_leases", skip_all)]
pub async fn live_leases(store: &Store, quota_prefix: &str) -> Result<i64> {
    store.cmd(redis::cmd("ZCARD").arg(Keys::lease_index(quota_prefix))).await
}

/// Adds `n` tokens of demand the spend script did not see (refusals
/// answered from the negative cache) to the quota's demand counter.
#[tracing::instrument(level = "debug", name = "redis.add_demand", skip_all)]
pub async fn add_demand(store: &Store, quota_prefix: &str, n: i64) -> Result<()> {
    let key = Keys::demand(quota_prefix);
    let _: i64 = store.cmd(redis::cmd("INCRBY").arg(&key).arg(n)).await?;
    // The scripts refresh its TTL with the quota's other keys; written
    // from here it gets one too, so no key outlives its quota (F04).
    let _ = keep(store, &key).await;
    Ok(())
}

/// A quota's fallback counter (`None`: nothing admitted from fallback).
#[tracing::instrument(level = "debug", name = "redis.fallback_used", skip_all)]
pub async fn fallback_used(store: &Store, key: &str) -> Result<Option<i64>> {
    store.cmd(redis::cmd("GET").arg(key)).await
}

// --- outboxes and dead letters -----------------------------------------

/// The first `n` entries of an outbox list (or of the dead letters).
#[tracing::instrument(level = "debug", name = "redis.list_page", skip_all)]
pub async fn list_page(store: &Store, list: &str, n: isize) -> Result<Vec<String>> {
    store.cmd(redis::cmd("LRANGE").arg(list).arg(0).arg(n - 1)).await
}

/// How many entries a list holds.
#[tracing::instrument(level = "debug", name = "redis.list_len", skip_all)]
pub async fn list_len(store: &Store, list: &str) -> Result<i64> {
    store.cmd(redis::cmd("LLEN").arg(list)).await
}

/// Takes one entry equal to `raw` out of an outbox (sent, or dead).
#[tracing::instrument(level = "debug", name = "redis.outbox_remove", skip_all)]
pub async fn outbox_remove(store: &Store, outbox: &str, raw: &str) -> Result<i64> {
    store.cmd(redis::cmd("LREM").arg(outbox).arg(1).arg(raw)).await
}

/// Puts an entry at the front of an outbox (what is left of a split report).
#[tracing::instrument(level = "debug", name = "redis.outbox_push_front", skip_all)]
pub async fn outbox_push_front(store: &Store, outbox: &str, raw: &str) -> Result<i64> {
    store.cmd(redis::cmd("LPUSH").arg(outbox).arg(raw)).await
}

/// Adds a dead letter to the region's capped list (newest first, at most
/// `max` kept). Best effort: a letter that cannot be stored is logged by
/// the caller already.
#[tracing::instrument(level = "debug", name = "redis.dead_letter", skip_all)]
pub async fn dead_letter(store: &Store, list: &str, letter: &str, max: isize) {
    let _: Result<i64> = store.cmd(redis::cmd("LPUSH").arg(list).arg(letter)).await;
    let _: Result<()> = store.cmd(redis::cmd("LTRIM").arg(list).arg(0).arg(max - 1)).await;
    let _ = keep(store, list).await;
}

// --- the store's health --------------------------------------------------

/// `CONFIG GET maxmemory-policy` on one server.
#[tracing::instrument(level = "debug", name = "redis.config_maxmemory_policy", skip_all)]
pub async fn config_maxmemory_policy(store: &Store) -> Result<Value> {
    store.cmd(redis::cmd("CONFIG").arg("GET").arg("maxmemory-policy")).await
}

/// `INFO` (of every node, on a Cluster).
#[tracing::instrument(level = "debug", name = "redis.info", skip_all)]
pub async fn info(store: &Store) -> Result<Value> {
    store.cmd(&redis::cmd("INFO")).await
}

#[cfg(test)]
mod tests {
    /// `redis::cmd` appears in this module and in `store.rs` only.
    #[test]
    fn no_plain_command_outside_its_owner() {
        let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut stack = vec![src.clone()];
        let mut offenders = Vec::new();
        while let Some(dir) = stack.pop() {
            for e in std::fs::read_dir(&dir).unwrap() {
                let path = e.unwrap().path();
                if path.is_dir() {
                    stack.push(path);
                    continue;
                }
                let name = path.strip_prefix(&src).unwrap().to_string_lossy().into_owned();
                if name == "commands.rs" || name == "store.rs" {
                    continue;
                }
                let text = std::fs::read_to_string(&path).unwrap();
                if text.contains(concat!("redis::", "cmd(")) {
                    offenders.push(name);
                }
            }
        }
        assert!(offenders.is_empty(), "plain Redis commands outside commands.rs: {offenders:?}");
    }
}
