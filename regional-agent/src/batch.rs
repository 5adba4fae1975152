//! Coalescing of concurrent decisions on one quota. While a run of the
//! spend script (`lua/spend.lua`) is in flight for a quota, the requests
//! that arrive for the same quota queue, and the next run decides all of
//! them, one after the other in arrival order: each decision still sees
//! every debit before it (I5), but the leases are scanned once and the
//! counters written once per run. At low load a run carries one request
//! and nothing waits; under load one Redis round trip serves many
//! decisions, and Redis, not the agent, is what bounds a busy quota.
//!
//! Bounds: a run carries at most [`MAX_BATCH`] requests, a quota's queue
//! holds at most [`MAX_QUEUED`] (a request beyond it runs on its own), and a
//! request waits for its answer at most two Redis timeouts.

use crate::keys::Keys;
use crate::quotas::Quota;
use crate::spend::Admit;
use crate::store::{Reply, StoreError, SPEND};
use crate::AppState;
use redis::ScriptInvocation;
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::oneshot;

/// Most requests decided by one run of the script.
pub const MAX_BATCH: usize = 64;
/// Most requests queued per quota behind the run in flight.
pub const MAX_QUEUED: usize = 1024;

/// What every decision of one run shares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Common {
    /// Whether the region's fallback allowance may be used.
    pub fallback: bool,
    /// The quota's window length (s): the script takes the fallback window
    /// from the region's one clock (I8), not from this agent's.
    pub window_secs: i64,
    /// Fallback allowance per window.
    pub allowance: i64,
    /// How long a request id is remembered (ms).
    pub rid_ttl_ms: i64,
}

/// One request's part of a run.
#[derive(Debug, Clone)]
pub struct Ask {
    pub cost: i64,
    /// Request id key suffix, empty when the request carries none.
    pub rid: String,
    /// Whether this try counts toward demand (the first try of a request).
    pub count_demand: bool,
}

/// What the script decided for one request.
#[derive(Debug, Clone, PartialEq)]
pub enum Spend {
    Admit(Admit),
    /// The quota's Redis state changed incarnation or went back in time
    /// (see `lua/prelude.lua`); the run already noted it
    /// ([`crate::quotas::note_loss`]).
    Lost,
    None {
        wait_ms: i64,
        exhausted_ms: i64,
    },
}

type Answer = Result<Spend, StoreError>;

struct Queued {
    common: Common,
    ask: Ask,
    tx: oneshot::Sender<Answer>,
}

/// A quota's queue of requests waiting for a run.
#[derive(Default)]
pub struct SpendQueue {
    queue: VecDeque<Queued>,
    /// Whether a drainer task runs for this quota.
    running: bool,
}

/// Decides one request, in a run shared with the requests queued beside it.
pub async fn spend(app: &AppState, q: &Arc<Quota>, common: Common, ask: Ask) -> Answer {
    let (tx, rx) = oneshot::channel();
    // The ask comes back only when the queue is full.
    let alone = {
        let mut sq = q.spends.lock().unwrap();
        if sq.queue.len() >= MAX_QUEUED {
            Some(ask)
        } else {
            sq.queue.push_back(Queued { common, ask, tx });
            if !sq.running {
                sq.running = true;
                tokio::spawn(drain(app.clone(), q.clone()));
            }
            None
        }
    };
    if let Some(ask) = alone {
        return run(app, q, common, std::slice::from_ref(&ask)).await?.pop().ok_or_else(short);
    }
    // The run ahead of this request's and its own, each bounded by the
    // Redis timeout.
    let bound = app.settings.redis_timeout * 2 + Duration::from_millis(50);
    match tokio::time::timeout(bound, rx).await {
        Ok(Ok(answer)) => answer,
        Ok(Err(_)) => Err(StoreError::Protocol("the quota's spend run stopped".into())),
        Err(_) => Err(StoreError::Timeout(bound)),
    }
}

fn short() -> StoreError {
    StoreError::Protocol("the spend script answered fewer decisions than requests".into())
}

/// Clears the quota's `running` flag if the drainer dies before it could
/// (a panic), so that the next request starts a new one.
struct Running<'a> {
    q: &'a Quota,
    armed: bool,
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        if self.armed {
            if let Ok(mut sq) = self.q.spends.lock() {
                sq.running = false;
            }
        }
    }
}

/// Runs the quota's queue until it is empty.
async fn drain(app: AppState, q: Arc<Quota>) {
    let mut guard = Running { q: &q, armed: true };
    loop {
        let (common, batch) = {
            let mut sq = q.spends.lock().unwrap();
            // A request that stopped waiting (timeout) is not decided: its
            // client already has another answer.
            while sq.queue.front().is_some_and(|e| e.tx.is_closed()) {
                sq.queue.pop_front();
            }
            let Some(common) = sq.queue.front().map(|e| e.common) else {
                sq.running = false;
                guard.armed = false;
                return;
            };
            let mut batch = Vec::new();
            while batch.len() < MAX_BATCH && sq.queue.front().is_some_and(|e| e.common == common) {
                if let Some(e) = sq.queue.pop_front() {
                    if !e.tx.is_closed() {
                        batch.push(e);
                    }
                }
            }
            (common, batch)
        };
        let asks: Vec<Ask> = batch.iter().map(|e| e.ask.clone()).collect();
        match run(&app, &q, common, &asks).await {
            Ok(decisions) if decisions.len() == batch.len() => {
                for (e, d) in batch.into_iter().zip(decisions) {
                    let _ = e.tx.send(Ok(d));
                }
            }
            Ok(_) => {
                for e in batch {
                    let _ = e.tx.send(Err(short()));
                }
            }
            Err(err) => {
                for e in batch {
                    let _ = e.tx.send(Err(err.clone()));
                }
            }
        }
    }
}

/// The one place that knows `lua/spend.lua`'s KEYS and ARGV order (the
/// bench calls it too): an invocation deciding `asks` in order.
pub fn spend_invocation(
    prefix: &str,
    token: &str,
    fresh: &str,
    common: Common,
    agent: &str,
    epoch: i64,
    asks: &[Ask],
) -> ScriptInvocation<'static> {
    let mut inv = SPEND.prepare_invoke();
    inv.key(Keys::incarnation(prefix))
        .arg(prefix)
        .arg(token)
        .arg(fresh)
        .arg(common.rid_ttl_ms)
        .arg(if common.fallback { "1" } else { "0" })
        .arg(common.window_secs)
        .arg(common.allowance)
        .arg(crate::spend::COUNTER_TTL_MS)
        .arg(agent)
        .arg(epoch);
    for a in asks {
        inv.arg(a.cost).arg(&a.rid).arg(if a.count_demand { "1" } else { "0" });
    }
    inv
}

/// One run of the spend script for `asks`, in order.
async fn run(app: &AppState, q: &Quota, common: Common, asks: &[Ask]) -> Result<Vec<Spend>, StoreError> {
    let fresh = uuid::Uuid::new_v4().simple().to_string();
    let inv =
        spend_invocation(&q.prefix, &q.token(), &fresh, common, &app.settings.agent, app.ident.epoch(), asks);
    app.metrics.inc("agent_spend_runs_total", &[]);
    let r: Reply = app.store.eval(&inv).await?;
    let token = r.str(1);
    if !token.is_empty() {
        let mut t = q.token.lock().unwrap();
        if *t != token {
            *t = token;
        }
    }
    match r.str(0).as_str() {
        "lost" => {
            let flag = r.int(2);
            crate::quotas::note_loss(app, q, flag);
            Ok(asks.iter().map(|_| Spend::Lost).collect())
        }
        "ok" => (0..asks.len()).map(|i| decision(&r.nested(2 + i))).collect(),
        other => Err(StoreError::Protocol(other.to_string())),
    }
}

/// One decision of the script's answer.
fn decision(d: &Reply) -> Result<Spend, StoreError> {
    let code = d.str(0);
    Ok(match code.as_str() {
        "lease" | "fallback" => {
            Spend::Admit(Admit { source: code, window_start: d.int(1), remaining: d.int(2) })
        }
        "dup" => {
            let s = d.str(1);
            let mut it = s.splitn(3, ':');
            let source = it.next().unwrap_or("lease").to_string();
            let ws = it.next().and_then(|v| v.parse().ok()).unwrap_or(0);
            let remaining = it.next().and_then(|v| v.parse().ok()).unwrap_or(0);
            Spend::Admit(Admit { source, window_start: ws, remaining })
        }
        "none" => Spend::None { wait_ms: d.int(1), exhausted_ms: d.int(2) },
        "" => return Err(short()),
        other => return Err(StoreError::Protocol(other.to_string())),
    })
}
