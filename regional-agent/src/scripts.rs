//! The agent's Redis contract: the one place that knows each Lua script of
//! `lua/*.lua` (loaded once, EVALSHA with a reload on NOSCRIPT done by
//! `redis::Script`), the order of its KEYS and ARGV and the shape of its
//! reply. The rest of the agent (and the bench) calls the typed functions
//! below; key names come from [`crate::keys`], and the scripts only append
//! fixed suffixes to the quota prefix they receive.
//!
//! The scripts that decide on a quota's state (spend, view) or add to it
//! (credit) check its incarnation first (see `lua/prelude.lua`). Their
//! answer is an [`Outcome`]: either the value, with the incarnation the
//! script ran on, or one [`Lost`] saying the state changed under the token
//! sent; the agent handles both in one place (`Quota::settle` in `quotas`).
//!
//! Every call is one round trip with a span of its own (level `debug`).

use crate::keys::{Keys, COUNTER_TTL_MS};
use crate::store::{Store, StoreError};
use redis::{FromRedisValue, Script, ScriptInvocation, Value};
use std::sync::LazyLock;
use std::time::Instant;

/// The prelude shared by the scripts (see `lua/prelude.lua`): lease scan,
/// incarnation and rollback check, fences, the region's fallback clock.
const PRELUDE: &str = include_str!("../lua/prelude.lua");

/// `lua/spend.lua`: the admission decisions of a batch of requests on one
/// or more quotas of one tenant (I5).
static SPEND: LazyLock<Script> =
    LazyLock::new(|| Script::new(&format!("{PRELUDE}\n{}", include_str!("../lua/spend.lua"))));
/// `lua/view.lua`: the renewer's view and the expiry sweep.
static VIEW: LazyLock<Script> =
    LazyLock::new(|| Script::new(&format!("{PRELUDE}\n{}", include_str!("../lua/view.lua"))));
/// `lua/credit.lua`: credits a lease, idempotent by lease id, epoch-fenced.
static CREDIT: LazyLock<Script> =
    LazyLock::new(|| Script::new(&format!("{PRELUDE}\n{}", include_str!("../lua/credit.lua"))));
/// `lua/cut.lua`: moves unreported counts into an outbox entry (I7).
static CUT: LazyLock<Script> =
    LazyLock::new(|| Script::new(&format!("{PRELUDE}\n{}", include_str!("../lua/cut.lua"))));
/// `lua/fence.lua`: raises an agent's epoch fence in one quota (I4).
static FENCE: LazyLock<Script> =
    LazyLock::new(|| Script::new(&format!("{PRELUDE}\n{}", include_str!("../lua/fence.lua"))));
/// `lua/unlock.lua`: releases the renew lock if still ours.
static UNLOCK: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("../lua/unlock.lua")));
/// `lua/legacy.lua`: refreshes the region's legacy gate (key layout upgrade).
static LEGACY: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("../lua/legacy.lua")));
/// `lua/shadow.lua`: counts a request a shadow-mode policy would have refused.
static SHADOW: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("../lua/shadow.lua")));

/// `lua/permit.lua`: the permits of a concurrency quota in the region.
static PERMIT: LazyLock<Script> =
    LazyLock::new(|| Script::new(&format!("{PRELUDE}\n{}", include_str!("../lua/permit.lua"))));

/// The quota a script runs on, as the agent knows it.
#[derive(Debug, Clone, Copy)]
pub struct On<'a> {
    /// The quota's key prefix ([`Keys::quota`]).
    pub prefix: &'a str,
    /// The incarnation token the agent last saw (`""` or `"?"` before the
    /// first touch, see `lua/prelude.lua`).
    pub token: &'a str,
}

/// The agent a script runs for.
#[derive(Debug, Clone, Copy)]
pub struct Caller<'a> {
    pub agent: &'a str,
    /// 0 before the first registration.
    pub epoch: i64,
}

/// What a script that checks the quota's incarnation came to.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome<T> {
    /// It ran on incarnation `token` (the one sent, or the one it installed
    /// on a first touch; empty when the script does not say).
    Ran { token: String, value: T },
    /// The state changed under the token sent; nothing was decided.
    Lost(Lost),
}

/// A changed incarnation: what the quota's state is now, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lost {
    /// Which quota of the run (its index in the run's list; 0 for the
    /// scripts that run on one quota).
    pub quota: usize,
    /// The incarnation now in force (empty when the script does not say).
    pub token: String,
    pub cause: LossCause,
}

/// Why a script found the incarnation changed (the loss flag of
/// `lua/prelude.lua`, or a credit that found another incarnation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LossCause {
    /// Flag 1: the first touch of a quota in a region whose incarnation key
    /// was missing; the script installed a new state (fallback counted as
    /// spent); nothing to re-register for.
    Installed,
    /// Flag 2: the quota's state is gone or another incarnation's.
    Lost,
    /// Flag 3: the server's history changed (restart, restored snapshot,
    /// failover, eviction); the old state was stranded.
    RolledBack,
    /// A credit found another incarnation than the one it was sent for
    /// (the lease is stranded; the next round adopts the new state).
    Moved,
}

impl LossCause {
    /// The loss flag of `lua/prelude.lua` (1, 2 or 3).
    fn from_flag(flag: i64) -> LossCause {
        match flag {
            3 => LossCause::RolledBack,
            2 => LossCause::Lost,
            _ => LossCause::Installed,
        }
    }
}

/// What every decision of one spend run shares on one quota.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Common {
    /// The legacy gate (Redis clock, ms; 0 for none): no fallback before
    /// it (see `crate::legacy`).
    pub legacy_until_ms: i64,
    /// Whether the region's fallback allowance may be used.
    pub fallback: bool,
    /// The quota's window length (s): the script takes the fallback window
    /// from the region's one clock (I8), not from this agent's.
    pub window_secs: i64,
    /// Fallback allowance per window.
    pub allowance: i64,
    /// How long a request id is remembered (ms).
    pub rid_ttl_ms: i64,
    /// The policy's per-key bucket, if it has one.
    pub per_key: Option<Bucket>,
    /// What the legacy key layout's fallback counter holds for one window
    /// (`(window start, used)`), added to this layout's in that window;
    /// `None` when the legacy layout has nothing to add (see `crate::legacy`).
    pub legacy_fallback: Option<(i64, i64)>,
}

/// A per-key token bucket as the spend script takes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bucket {
    /// Refill rate, milli-tokens per second (≥ 1).
    pub rate_milli: i64,
    /// Size in tokens (≥ 1).
    pub burst: i64,
}

/// One request's part of a spend run.
#[derive(Debug, Clone)]
pub struct Ask {
    /// Its cost on each quota of the run, in the run's order (0: it does
    /// not spend that quota).
    pub costs: Vec<i64>,
    /// Request id key suffix ([`Keys::request_id_suffix`]), empty when the
    /// request carries none.
    pub rid: String,
    /// Whether this try counts toward demand (the first try of a request).
    pub count_demand: bool,
    /// The per-key bucket's suffix ([`Keys::per_key_suffix`]), empty when
    /// the request names no key (the buckets of the quotas whose policy has
    /// a per-key limit are checked).
    pub key: String,
    /// On each quota of the run, the tokens the request may not take: the
    /// reserves kept for more important priorities (0: none).
    pub held: Vec<i64>,
}

/// One quota of a spend run.
#[derive(Debug, Clone, Copy)]
pub struct Part<'a> {
    pub on: On<'a>,
    pub common: Common,
}

/// An admit on one quota.
#[derive(Debug, Clone, PartialEq)]
pub struct Admit {
    /// `lease` or `fallback`.
    pub source: String,
    pub window_start: i64,
    pub remaining: i64,
    /// Whole tokens left in the request's per-key bucket after this admit
    /// (`None` without a key, and for a repeated request id).
    pub key_remaining: Option<i64>,
}

/// What the spend script decided for one request. Quotas are named by
/// their index in the run.
#[derive(Debug, Clone, PartialEq)]
pub enum Spend {
    /// Every quota the request names was debited: one admit per quota, in
    /// the run's order.
    Admit(Vec<Admit>),
    /// Quota `quota` had no token (nothing was debited anywhere):
    /// `wait_ms` until a next-window lease opens (or -1), `exhausted_ms`
    /// > 0 while the allocator's "pool empty" mark holds.
    None { quota: usize, wait_ms: i64, exhausted_ms: i64 },
    /// The request's per-key bucket of quota `quota` holds less than its
    /// cost: `retry_ms` until it will hold enough; nothing was debited.
    KeyLimited {
        quota: usize,
        retry_ms: i64,
        /// Whole tokens in the bucket.
        remaining: i64,
    },
    /// Quota `quota` keeps what is left of its window for more important
    /// priorities than the request's: `available` in the region's balance,
    /// `room` in the pool as last heard; nothing was debited.
    Reserved { quota: usize, available: i64, room: i64 },
}

/// A spend run that decided: the incarnation of each quota, and the
/// decisions of the asks in order.
#[derive(Debug, Clone, PartialEq)]
pub struct Decided {
    pub tokens: Vec<String>,
    pub decisions: Vec<Spend>,
}

/// A fresh incarnation token, for a script to install when the quota's
/// incarnation key is missing.
fn fresh() -> String {
    uuid::Uuid::new_v4().simple().to_string()
}

fn flag(b: bool) -> &'static str {
    if b {
        "1"
    } else {
        "0"
    }
}

/// `lua/spend.lua`'s invocation deciding `asks` in order over `quotas`.
fn spend_invocation(by: Caller<'_>, quotas: &[Part<'_>], asks: &[Ask]) -> ScriptInvocation<'static> {
    let mut inv = SPEND.prepare_invoke();
    let first = quotas.first().map(|p| p.common);
    inv.arg(first.map_or(0, |c| c.rid_ttl_ms))
        .arg(COUNTER_TTL_MS)
        .arg(by.agent)
        .arg(by.epoch)
        .arg(first.map_or(0, |c| c.legacy_until_ms))
        .arg(quotas.len());
    for p in quotas {
        let c = p.common;
        inv.key(Keys::incarnation(p.on.prefix))
            .arg(p.on.prefix)
            .arg(p.on.token)
            .arg(fresh())
            .arg(flag(c.fallback))
            .arg(c.window_secs)
            .arg(c.allowance);
        match c.per_key {
            Some(b) => inv.arg(b.rate_milli).arg(b.burst),
            None => inv.arg(0).arg(0),
        };
        match c.legacy_fallback {
            Some((ws, used)) => inv.arg(ws).arg(used),
            None => inv.arg(-1).arg(0),
        };
    }
    for a in asks {
        inv.arg(&a.rid).arg(flag(a.count_demand)).arg(&a.key);
        for i in 0..quotas.len() {
            inv.arg(a.costs.get(i).copied().unwrap_or(0));
        }
        for i in 0..quotas.len() {
            inv.arg(a.held.get(i).copied().unwrap_or(0));
        }
    }
    inv
}

/// One run of the spend script: the decisions of `asks`, in order, over
/// `quotas` (all of one tenant: they share a Cluster slot).
#[tracing::instrument(level = "debug", skip_all, fields(quotas = quotas.len(), asks = asks.len()))]
pub async fn spend(
    store: &Store,
    by: Caller<'_>,
    quotas: &[Part<'_>],
    asks: &[Ask],
) -> Result<Outcome<Decided>, StoreError> {
    let r: Reply = store.eval(&spend_invocation(by, quotas, asks)).await?;
    read_spend(&r, asks.len())
}

/// The spend script's reply: `{'lost', i, token, flag}` or
/// `{'ok', {tokens}, d1, d2, ...}`.
fn read_spend(r: &Reply, asks: usize) -> Result<Outcome<Decided>, StoreError> {
    match r.str(0).as_str() {
        "lost" => Ok(Outcome::Lost(Lost {
            quota: index(r.int(1))?,
            token: r.str(2),
            cause: LossCause::from_flag(r.int(3)),
        })),
        "ok" => {
            let t = r.nested(1);
            let tokens = (0..t.0.len()).map(|i| t.str(i)).collect();
            let decisions = (0..asks).map(|i| decision(&r.nested(2 + i))).collect::<Result<_, _>>()?;
            Ok(Outcome::Ran { token: String::new(), value: Decided { tokens, decisions } })
        }
        other => Err(StoreError::Protocol(other.to_string())),
    }
}

fn short() -> StoreError {
    StoreError::Protocol("the spend script answered fewer decisions than requests".into())
}

/// A Lua quota index (from 1) as the run's index (from 0).
fn index(i: i64) -> Result<usize, StoreError> {
    usize::try_from(i - 1).map_err(|_| StoreError::Protocol(format!("quota index {i}")))
}

/// One decision of the spend script's answer.
fn decision(d: &Reply) -> Result<Spend, StoreError> {
    let code = d.str(0);
    Ok(match code.as_str() {
        "admit" => {
            let parts = d.nested(1);
            Spend::Admit(
                (0..parts.0.len())
                    .map(|i| {
                        let p = parts.nested(i);
                        Admit {
                            source: p.str(0),
                            window_start: p.int(1),
                            remaining: p.int(2),
                            key_remaining: Some(p.int(3)).filter(|k| *k >= 0),
                        }
                    })
                    .collect(),
            )
        }
        "dup" => {
            let recs = d.nested(1);
            Spend::Admit((0..recs.0.len()).map(|i| record(&recs.str(i))).collect())
        }
        "none" => Spend::None { quota: index(d.int(1))?, wait_ms: d.int(2), exhausted_ms: d.int(3) },
        "key" => Spend::KeyLimited { quota: index(d.int(1))?, retry_ms: d.int(2), remaining: d.int(3) },
        "reserve" => Spend::Reserved { quota: index(d.int(1))?, available: d.int(2), room: d.int(3) },
        "" => return Err(short()),
        other => return Err(StoreError::Protocol(other.to_string())),
    })
}

/// A request id's record `src:ws:remaining`: the first decision, repeated.
fn record(s: &str) -> Admit {
    let mut it = s.splitn(3, ':');
    let source = it.next().filter(|s| !s.is_empty()).unwrap_or("lease").to_string();
    let window_start = it.next().and_then(|v| v.parse().ok()).unwrap_or(0);
    let remaining = it.next().and_then(|v| v.parse().ok()).unwrap_or(0);
    Admit { source, window_start, remaining, key_remaining: None }
}

/// What the view script passes besides the quota and the caller.
#[derive(Debug, Clone, Copy)]
pub struct ViewArgs {
    /// The quota's window length (s), 1 while the policy is unknown.
    pub window_secs: i64,
    /// Fallback allowance per window (counted as spent after a loss).
    pub allowance: i64,
    /// Tokens count as lasting in leases with at least this long to live.
    pub lasting_ms: i64,
}

/// The renewer's look at a quota's region balance.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct View {
    /// Window start of the spendable leases, or -1.
    pub ws: i64,
    /// Tokens left in spendable leases.
    pub available: i64,
    /// Of those, the tokens in leases that live at least as long as the
    /// renewer asked (its horizon, or to the window's end).
    pub lasting: i64,
    /// Smallest remaining life of those leases (ms), -1 without lease.
    pub life_ms: i64,
    /// Tokens of next-window leases not yet spendable.
    pub pending: i64,
    /// Remaining life of the "pool exhausted" marker (ms), ≤ 0 when none.
    pub exhausted_ms: i64,
    /// When the view was taken.
    pub at: Option<Instant>,
}

/// The view script: sweeps expired leases, reads balance and demand.
/// The value is the view and the region's cumulative demand counter.
#[tracing::instrument(level = "debug", skip_all, fields(prefix = on.prefix))]
pub async fn view(
    store: &Store,
    on: On<'_>,
    by: Caller<'_>,
    a: ViewArgs,
) -> Result<Outcome<(View, i64)>, StoreError> {
    let mut inv = VIEW.prepare_invoke();
    inv.key(Keys::incarnation(on.prefix))
        .arg(on.prefix)
        .arg(on.token)
        .arg(fresh())
        .arg(a.window_secs)
        .arg(a.allowance)
        .arg(by.agent)
        .arg(by.epoch)
        .arg(COUNTER_TTL_MS)
        .arg(a.lasting_ms);
    let r: Reply = store.eval(&inv).await?;
    Ok(read_view(&r, Instant::now()))
}

/// `{code, token, ws|-1, available, life_ms, pending, wait_ms, demand_total,
/// exhausted_pttl, lasting}`; code `lost` carries the loss flag third.
fn read_view(r: &Reply, at: Instant) -> Outcome<(View, i64)> {
    let token = r.str(1);
    if r.str(0) == "lost" {
        return Outcome::Lost(Lost { quota: 0, token, cause: LossCause::from_flag(r.int(2)) });
    }
    let v = View {
        ws: r.int(2),
        available: r.int(3),
        lasting: r.int(9),
        life_ms: r.int(4),
        pending: r.int(5),
        exhausted_ms: r.int(8),
        at: Some(at),
    };
    Outcome::Ran { token, value: (v, r.int(7)) }
}

/// A granted lease to credit.
#[derive(Debug, Clone)]
pub struct Lease {
    pub id: String,
    /// The grant's epoch (fenced against the agent's fence, I4).
    pub epoch: i64,
    pub tokens: i64,
    pub window_start: i64,
    /// Remaining life (ms) from the instant the grant was sent (I2).
    pub life_ms: i64,
    /// ms until the lease's window opens (0 for the current window).
    pub nb_ms: i64,
    /// The allocator's clock now (Unix ms), for the region's one clock (I8).
    pub alloc_now_ms: i64,
    /// What the window's pool holds unleased after this grant (for
    /// reserves, see `lua/spend.lua`).
    pub pool_available: i64,
}

/// What a credit did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Credit {
    /// Credited.
    Credited,
    /// The lease id was credited before (a replayed grant).
    Replayed,
    /// Its life was over on arrival.
    Expired,
    /// Its epoch is below the agent's fence.
    Stale,
}

/// The credit script: credits `lease` into the quota's balance, for the
/// incarnation `on.token` only.
#[tracing::instrument(level = "debug", skip_all, fields(prefix = on.prefix, lease_id = %lease.id))]
pub async fn credit(
    store: &Store,
    on: On<'_>,
    agent: &str,
    lease: &Lease,
) -> Result<Outcome<Credit>, StoreError> {
    let mut inv = CREDIT.prepare_invoke();
    inv.key(Keys::incarnation(on.prefix))
        .arg(on.prefix)
        .arg(on.token)
        .arg(lease.epoch)
        .arg(agent)
        .arg(&lease.id)
        .arg(lease.tokens)
        .arg(lease.window_start)
        .arg(lease.life_ms)
        .arg(lease.nb_ms)
        .arg(lease.life_ms.max(0) + lease.nb_ms + COUNTER_TTL_MS)
        .arg(lease.alloc_now_ms)
        .arg(lease.pool_available.max(0));
    let r: Reply = store.eval(&inv).await?;
    Ok(read_credit(&r))
}

/// `{'ok'} | {'dup'} | {'expired'} | {'stale', fence} | {'lost', token}`.
fn read_credit(r: &Reply) -> Outcome<Credit> {
    let value = match r.str(0).as_str() {
        "ok" => Credit::Credited,
        "dup" => Credit::Replayed,
        "expired" => Credit::Expired,
        "stale" => Credit::Stale,
        // `lost`, or anything else: the state is not the one the lease was
        // meant for; stranding it is the safe side.
        _ => return Outcome::Lost(Lost { quota: 0, token: r.str(1), cause: LossCause::Moved }),
    };
    Outcome::Ran { token: String::new(), value }
}

/// The cut script: moves the quota's unreported counts into one report
/// entry (id `report_id`) of `agent`'s outbox, unless it holds
/// `max_entries`. Returns the number of items cut.
#[tracing::instrument(level = "debug", skip_all, fields(prefix = prefix))]
pub async fn cut(
    store: &Store,
    prefix: &str,
    agent: &str,
    report_id: &str,
    max_entries: i64,
) -> Result<i64, StoreError> {
    let mut inv = CUT.prepare_invoke();
    inv.key(Keys::incarnation(prefix)).arg(prefix).arg(agent).arg(report_id).arg(max_entries);
    store.eval(&inv).await
}

/// The fence script: raises `agent`'s epoch fence in the quota to `epoch`.
/// Returns the fence in force.
#[tracing::instrument(level = "debug", skip_all, fields(prefix = prefix, epoch = epoch))]
pub async fn fence(store: &Store, prefix: &str, agent: &str, epoch: i64) -> Result<i64, StoreError> {
    let mut inv = FENCE.prepare_invoke();
    inv.key(Keys::incarnation(prefix)).arg(prefix).arg(agent).arg(epoch);
    store.eval(&inv).await
}

/// The unlock script: releases the quota's renew lock if `holder` still
/// holds it. Returns whether it did.
#[tracing::instrument(level = "debug", skip_all, fields(prefix = prefix))]
pub async fn unlock(store: &Store, prefix: &str, holder: &str) -> Result<bool, StoreError> {
    let mut inv = UNLOCK.prepare_invoke();
    inv.key(Keys::renew_lock(prefix)).arg(holder);
    Ok(store.eval::<i64>(&inv).await? == 1)
}

/// Counts one request the quota's shadow-mode policy would have refused
/// in the window starting at `window_start` (reported by the outbox).
#[tracing::instrument(level = "debug", skip_all, fields(prefix = prefix))]
pub async fn shadow(store: &Store, prefix: &str, window_start: i64) -> Result<(), StoreError> {
    let mut inv = SHADOW.prepare_invoke();
    inv.key(Keys::incarnation(prefix)).arg(prefix).arg(window_start).arg(COUNTER_TTL_MS);
    store.eval::<i64>(&inv).await.map(|_| ())
}

/// The legacy gate script: moves the region's gate forward when
/// `legacy_live`. Returns the gate (Redis clock, ms; 0 for none).
#[tracing::instrument(level = "debug", skip_all, fields(legacy_live))]
pub async fn legacy_gate(
    store: &Store,
    gate: &str,
    legacy_live: bool,
    live_ttl_ms: i64,
) -> Result<i64, StoreError> {
    let mut inv = LEGACY.prepare_invoke();
    inv.key(gate).arg(flag(legacy_live)).arg(live_ttl_ms).arg(COUNTER_TTL_MS);
    store.eval(&inv).await
}

/// A script's array answer, read field by field.
struct Reply(Vec<Value>);

impl FromRedisValue for Reply {
    fn from_redis_value(v: Value) -> Result<Self, redis::ParsingError> {
        match v {
            Value::Array(items) => Ok(Reply(items)),
            other => Ok(Reply(vec![other])),
        }
    }
}

impl Reply {
    /// Field `i` as text (`""` when absent or nil).
    fn str(&self, i: usize) -> String {
        match self.0.get(i) {
            Some(Value::BulkString(b)) => String::from_utf8_lossy(b).into_owned(),
            Some(Value::SimpleString(s)) => s.clone(),
            Some(Value::Int(n)) => n.to_string(),
            Some(Value::Okay) => "OK".into(),
            _ => String::new(),
        }
    }

    /// Field `i`, itself an array (empty when absent or not an array).
    fn nested(&self, i: usize) -> Reply {
        match self.0.get(i) {
            Some(Value::Array(items)) => Reply(items.clone()),
            _ => Reply(Vec::new()),
        }
    }

    /// Field `i` as an integer (0 when absent or not a number).
    fn int(&self, i: usize) -> i64 {
        match self.0.get(i) {
            Some(Value::Int(n)) => *n,
            Some(Value::BulkString(b)) => {
                std::str::from_utf8(b).ok().and_then(|s| s.parse().ok()).unwrap_or(0)
            }
            _ => 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bulk(s: &str) -> Value {
        Value::BulkString(s.as_bytes().to_vec())
    }

    fn reply(items: Vec<Value>) -> Reply {
        Reply(items)
    }

    #[test]
    fn spend_invocation_sends_a_key_per_quota_six_arguments_ten_per_quota_then_three_plus_two_per_quota_per_ask(
    ) {
        let per_key = Some(Bucket { rate_milli: 8000, burst: 8 });
        let common = Common {
            legacy_until_ms: 0,
            fallback: true,
            window_secs: 60,
            allowance: 7,
            rid_ttl_ms: 1234,
            per_key,
            legacy_fallback: Some((60, 2)),
        };
        let asks = [
            Ask {
                costs: vec![3, 1],
                rid: "3:r-1".into(),
                count_demand: true,
                key: "5:alice".into(),
                held: vec![10, 0],
            },
            Ask {
                costs: vec![1, 0],
                rid: String::new(),
                count_demand: false,
                key: String::new(),
                held: vec![0, 0],
            },
        ];
        let quotas = [
            Part { on: On { prefix: "q:{1:a}:1:b:", token: "tok" }, common },
            Part { on: On { prefix: "q:{1:a}:1:c:", token: "" }, common: Common { per_key: None, ..common } },
        ];
        let inv = spend_invocation(Caller { agent: "eu-1", epoch: 9 }, &quotas, &asks);
        // (the arguments themselves are not shown by the redis crate)
        let shown = format!("{inv:?}");
        assert!(shown.contains("args: 40") && shown.contains("keys: 2"), "{shown}");
    }

    #[test]
    fn spend_replies_are_read_per_request() {
        let arr = Value::Array;
        let part =
            |src: &str, ws, rem, key| arr(vec![bulk(src), Value::Int(ws), Value::Int(rem), Value::Int(key)]);
        let ok = reply(vec![
            bulk("ok"),
            arr(vec![bulk("tok"), bulk("tok2")]),
            arr(vec![bulk("admit"), arr(vec![part("lease", 60, 4, -1)])]),
            arr(vec![bulk("dup"), arr(vec![bulk("fallback:120:2"), bulk("lease:120:9")])]),
            arr(vec![bulk("none"), Value::Int(2), Value::Int(-1), Value::Int(700), Value::Int(0)]),
            arr(vec![bulk("admit"), arr(vec![part("fallback", 120, 1, 5), part("lease", 120, 0, -1)])]),
            arr(vec![bulk("key"), Value::Int(1), Value::Int(125), Value::Int(0)]),
            arr(vec![bulk("reserve"), Value::Int(1), Value::Int(4), Value::Int(20)]),
        ]);
        let got = read_spend(&ok, 6).unwrap();
        let admit = |source: &str, window_start, remaining, key_remaining| Admit {
            source: source.into(),
            window_start,
            remaining,
            key_remaining,
        };
        let want = vec![
            Spend::Admit(vec![admit("lease", 60, 4, None)]),
            Spend::Admit(vec![admit("fallback", 120, 2, None), admit("lease", 120, 9, None)]),
            Spend::None { quota: 1, wait_ms: -1, exhausted_ms: 700 },
            Spend::Admit(vec![admit("fallback", 120, 1, Some(5)), admit("lease", 120, 0, None)]),
            Spend::KeyLimited { quota: 0, retry_ms: 125, remaining: 0 },
            Spend::Reserved { quota: 0, available: 4, room: 20 },
        ];
        let tokens = vec!["tok".to_string(), "tok2".to_string()];
        assert_eq!(got, Outcome::Ran { token: String::new(), value: Decided { tokens, decisions: want } });
        // Fewer decisions than requests is a protocol error, not a refusal.
        assert!(matches!(read_spend(&ok, 7), Err(StoreError::Protocol(_))));
    }

    #[test]
    fn loss_flags_map_to_one_cause_each() {
        for (flag, cause) in [(1, LossCause::Installed), (2, LossCause::Lost), (3, LossCause::RolledBack)] {
            let lost = reply(vec![bulk("lost"), Value::Int(2), bulk("new"), Value::Int(flag)]);
            assert_eq!(
                read_spend(&lost, 2).unwrap(),
                Outcome::Lost(Lost { quota: 1, token: "new".into(), cause }),
                "spend flag {flag}"
            );
            let lost = reply(vec![bulk("lost"), bulk("new"), Value::Int(flag)]);
            assert_eq!(
                read_view(&lost, Instant::now()),
                Outcome::Lost(Lost { quota: 0, token: "new".into(), cause }),
                "view flag {flag}"
            );
        }
        let moved = reply(vec![bulk("lost"), bulk("other")]);
        assert_eq!(
            read_credit(&moved),
            Outcome::Lost(Lost { quota: 0, token: "other".into(), cause: LossCause::Moved })
        );
    }

    #[test]
    fn view_and_credit_replies_are_read_by_position() {
        let at = Instant::now();
        let r = reply(
            [bulk("ok"), bulk("tok")]
                .into_iter()
                .chain([60, 10, 900, 5, -1, 77, -2, 8].map(Value::Int))
                .collect(),
        );
        let want = View {
            ws: 60,
            available: 10,
            lasting: 8,
            life_ms: 900,
            pending: 5,
            exhausted_ms: -2,
            at: Some(at),
        };
        assert_eq!(read_view(&r, at), Outcome::Ran { token: "tok".into(), value: (want, 77) });
        for (code, credit) in [
            ("ok", Credit::Credited),
            ("dup", Credit::Replayed),
            ("expired", Credit::Expired),
            ("stale", Credit::Stale),
        ] {
            assert_eq!(
                read_credit(&reply(vec![bulk(code)])),
                Outcome::Ran { token: String::new(), value: credit }
            );
        }
    }
}

/// What `lua/permit.lua` says of a hand-out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PermitTake {
    /// Handed out (`dup`: the same id was handed out before to the same
    /// holder, by a retried request): expires in `expires_in_ms`; `left`
    /// more may be handed out under the region's current lease.
    Taken { expires_in_ms: i64, left: i64, dup: bool },
    /// The id (from the request id) was handed out to another holder.
    Mismatch,
    /// The region's permit state is missing or was written on another
    /// server history: sync with the allocator first.
    Lost,
    /// Nothing is handed out for `ms` more (permits a lost state forgot may
    /// still be held).
    Blocked { ms: i64 },
    /// The lease ends before a permit handed out now would.
    Lease { live: i64, cap: i64 },
    /// Every permit the region holds is handed out.
    Full { live: i64, cap: i64 },
}

/// What `lua/permit.lua` says of a release or a renewal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PermitReturn {
    Released,
    /// Renewed; expires in this many ms.
    Renewed {
        expires_in_ms: i64,
    },
    /// Not live: released before, expired, never handed out here, or (for
    /// a renewal) in a state this Redis cannot vouch for.
    Gone,
    /// Handed out to another holder (`key`).
    NotHolder,
}

/// The region's permit state of a quota, as `plan` and `lower` read it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PermitState {
    /// The lease's sequence number the region applied.
    pub seq: i64,
    /// Permits the allocator holds for the region (as last applied).
    pub cap: i64,
    /// Live permits.
    pub live: i64,
    /// ms until the lease ends (≤ 0: ended).
    pub lease_in_ms: i64,
    /// ms until hand-outs resume (≤ 0: not blocked).
    pub blocked_in_ms: i64,
}

/// [`PermitState`] (`None`: lost or never written) and the server's clock
/// when it was read (ms): the origin of the lease's end a lease call sets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PermitPlan {
    pub state: Option<PermitState>,
    pub now_ms: i64,
}

fn permit_invocation(prefix: &str, op: &str) -> ScriptInvocation<'static> {
    let mut inv = PERMIT.prepare_invoke();
    inv.key(Keys::incarnation(prefix)).arg(prefix).arg(op);
    inv
}

/// Hands out permit `id` for `ttl_ms` to `holder` (`""`: none).
#[tracing::instrument(level = "debug", skip_all)]
pub async fn permit_take(
    store: &Store,
    prefix: &str,
    id: &str,
    ttl_ms: i64,
    holder: &str,
) -> Result<PermitTake, StoreError> {
    let mut inv = permit_invocation(prefix, "acquire");
    inv.arg(id).arg(ttl_ms).arg(holder);
    let r: Reply = store.eval(&inv).await?;
    Ok(match r.str(0).as_str() {
        "ok" => PermitTake::Taken { expires_in_ms: r.int(1), left: r.int(2), dup: false },
        "dup" => PermitTake::Taken { expires_in_ms: r.int(1), left: r.int(2), dup: true },
        "mismatch" => PermitTake::Mismatch,
        "blocked" => PermitTake::Blocked { ms: r.int(1) },
        "lease" => PermitTake::Lease { live: r.int(1), cap: r.int(2) },
        "full" => PermitTake::Full { live: r.int(1), cap: r.int(2) },
        _ => PermitTake::Lost,
    })
}

/// Releases permit `id`, or (`renew`) extends it by the TTL the region's
/// state keeps, never past the lease.
#[tracing::instrument(level = "debug", skip_all)]
pub async fn permit_return(
    store: &Store,
    prefix: &str,
    id: &str,
    renew: bool,
    holder: &str,
) -> Result<PermitReturn, StoreError> {
    let mut inv = permit_invocation(prefix, if renew { "renew" } else { "release" });
    inv.arg(id).arg(holder);
    let r: Reply = store.eval(&inv).await?;
    Ok(match r.str(0).as_str() {
        "released" => PermitReturn::Released,
        "renewed" => PermitReturn::Renewed { expires_in_ms: r.int(1) },
        "not_holder" => PermitReturn::NotHolder,
        _ => PermitReturn::Gone,
    })
}

/// The region's permit state and the server's clock; with `lower_to`,
/// first lowers the region's cap to it (never below the live permits)
/// before the allocator is told.
#[tracing::instrument(level = "debug", skip_all)]
pub async fn permit_plan(
    store: &Store,
    prefix: &str,
    lower_to: Option<i64>,
) -> Result<PermitPlan, StoreError> {
    let inv = match lower_to {
        None => permit_invocation(prefix, "plan"),
        Some(target) => {
            let mut inv = permit_invocation(prefix, "lower");
            inv.arg(target);
            inv
        }
    };
    let r: Reply = store.eval(&inv).await?;
    Ok(match r.str(0).as_str() {
        "state" => PermitPlan {
            state: Some(PermitState {
                seq: r.int(1),
                cap: r.int(2),
                live: r.int(3),
                lease_in_ms: r.int(4),
                blocked_in_ms: r.int(5),
            }),
            now_ms: r.int(6),
        },
        _ => PermitPlan { state: None, now_ms: r.int(1) },
    })
}

/// Applies an allocator answer to the request sent at `seq`: the lease
/// ends at `exp_ms` (server clock); `false` when the state moved on
/// meanwhile (another replica applied a newer one).
#[tracing::instrument(level = "debug", skip_all)]
pub async fn permit_apply(
    store: &Store,
    prefix: &str,
    seq: i64,
    new_seq: i64,
    held: i64,
    exp_ms: i64,
    ttl_ms: i64,
) -> Result<bool, StoreError> {
    let mut inv = permit_invocation(prefix, "apply");
    inv.arg(seq).arg(new_seq).arg(held).arg(exp_ms).arg(ttl_ms);
    let r: Reply = store.eval(&inv).await?;
    Ok(r.str(0) == "applied")
}

/// What `sync` did with a conflict's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PermitSynced {
    /// Taken.
    Synced,
    /// Taken on a lost state, with a block of hand-outs.
    Blocked,
    /// Not taken: the state already applied a newer sequence number.
    Stale,
}

/// Takes the allocator's lease as it is (a conflict's answer, or the first
/// answer after a lost state); if the state is lost at that moment,
/// hand-outs stop for `block_ms` from then.
#[tracing::instrument(level = "debug", skip_all)]
#[allow(clippy::too_many_arguments)]
pub async fn permit_sync(
    store: &Store,
    prefix: &str,
    seq: i64,
    held: i64,
    exp_ms: i64,
    block_ms: i64,
    ttl_ms: i64,
    force: bool,
) -> Result<PermitSynced, StoreError> {
    let mut inv = permit_invocation(prefix, "sync");
    inv.arg(seq).arg(held).arg(exp_ms).arg(block_ms).arg(ttl_ms).arg(flag(force));
    let r: Reply = store.eval(&inv).await?;
    Ok(match r.str(0).as_str() {
        "synced" => PermitSynced::Synced,
        "blocked" => PermitSynced::Blocked,
        _ => PermitSynced::Stale,
    })
}
