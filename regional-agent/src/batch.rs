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

use crate::scripts::{Ask, Common, Outcome, Spend};
use crate::store::StoreError;
use std::collections::VecDeque;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::oneshot;

/// Most requests decided by one run of the script.
pub const MAX_BATCH: usize = 64;
/// Most requests queued per quota behind the run in flight.
pub const MAX_QUEUED: usize = 1024;

/// One request's answer: its decision, or the changed incarnation the run
/// found (already handled by the runner: the request decides again).
pub type Answer = Result<Outcome<Spend>, StoreError>;

/// What a run of the spend script for a batch of asks answers.
pub type RunAnswer = Result<Outcome<Vec<Spend>>, StoreError>;

struct Queued {
    common: Common,
    ask: Ask,
    tx: oneshot::Sender<Answer>,
}

/// A quota's queue of requests waiting for a run.
#[derive(Default)]
pub struct SpendQueue {
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    queue: VecDeque<Queued>,
    /// Whether a drainer task runs for this quota.
    running: bool,
}

/// Makes one run of the spend script for a batch of asks: the caller's
/// (it knows the quota, the store and what a loss means). A trait rather
/// than a closure so that the implementation lives below this module
/// (`crate::spend_run`) and each run's future stays unboxed.
pub trait Runner: Send + Sync + 'static {
    /// One run for `asks`, all sharing `common`.
    fn run(&self, common: Common, asks: Vec<Ask>) -> impl Future<Output = RunAnswer> + Send;
}

/// Decides one request, in a run shared with the requests queued beside
/// it. `runner` makes the runs; `redis_timeout` bounds each run.
pub async fn spend<R: Runner>(
    queue: &Arc<SpendQueue>,
    redis_timeout: Duration,
    common: Common,
    ask: Ask,
    runner: R,
) -> Answer {
    let (tx, rx) = oneshot::channel();
    // The ask comes back only when the queue is full.
    let alone = {
        let mut sq = queue.inner.lock().unwrap();
        if sq.queue.len() >= MAX_QUEUED {
            Some((ask, runner))
        } else {
            sq.queue.push_back(Queued { common, ask, tx });
            if !sq.running {
                sq.running = true;
                tokio::spawn(drain(queue.clone(), runner));
            }
            None
        }
    };
    if let Some((ask, runner)) = alone {
        return first(runner.run(common, vec![ask]).await);
    }
    // The run ahead of this request's and its own, each bounded by the
    // Redis timeout.
    let bound = redis_timeout * 2 + Duration::from_millis(50);
    match tokio::time::timeout(bound, rx).await {
        Ok(Ok(answer)) => answer,
        Ok(Err(_)) => Err(StoreError::Protocol("the quota's spend run stopped".into())),
        Err(_) => Err(StoreError::Timeout(bound)),
    }
}

fn short() -> StoreError {
    StoreError::Protocol("the spend script answered fewer decisions than requests".into())
}

/// A run's answer for one request.
pub fn first(r: RunAnswer) -> Answer {
    split(r, 1).pop().unwrap_or_else(|| Err(short()))
}

/// A run's answer as `n` requests' answers.
fn split(r: RunAnswer, n: usize) -> Vec<Answer> {
    match r {
        Ok(Outcome::Ran { token, value }) if value.len() == n => {
            value.into_iter().map(|d| Ok(Outcome::Ran { token: token.clone(), value: d })).collect()
        }
        Ok(Outcome::Ran { .. }) => (0..n).map(|_| Err(short())).collect(),
        Ok(Outcome::Lost(l)) => (0..n).map(|_| Ok(Outcome::Lost(l.clone()))).collect(),
        Err(e) => (0..n).map(|_| Err(e.clone())).collect(),
    }
}

/// Clears the queue's `running` flag if the drainer dies before it could
/// (a panic), so that the next request starts a new one.
struct Running<'a> {
    q: &'a SpendQueue,
    armed: bool,
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        if self.armed {
            if let Ok(mut sq) = self.q.inner.lock() {
                sq.running = false;
            }
        }
    }
}

/// Runs the queue until it is empty.
async fn drain<R: Runner>(q: Arc<SpendQueue>, runner: R) {
    let mut guard = Running { q: &q, armed: true };
    loop {
        let (common, batch) = {
            let mut sq = q.inner.lock().unwrap();
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
        let answers = split(runner.run(common, asks).await, batch.len());
        for (e, a) in batch.into_iter().zip(answers) {
            let _ = e.tx.send(a);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scripts::{Admit, LossCause, Lost};

    #[test]
    fn a_runs_answer_reaches_each_request_of_the_batch() {
        let admit = |r| {
            Spend::Admit(vec![Admit {
                source: "lease".into(),
                window_start: 0,
                remaining: r,
                key_remaining: None,
            }])
        };
        let ran = Ok(Outcome::Ran { token: "t".into(), value: vec![admit(2), admit(1)] });
        let got: Vec<_> = split(ran, 2).into_iter().map(|a| a.unwrap()).collect();
        assert_eq!(
            got,
            [
                Outcome::Ran { token: "t".into(), value: admit(2) },
                Outcome::Ran { token: "t".into(), value: admit(1) }
            ]
        );
        // A loss is every request's; a short answer an error for each.
        let lost = Lost { quota: 0, token: "n".into(), cause: LossCause::Lost };
        let got: Vec<_> = split(Ok(Outcome::Lost(lost.clone())), 3).into_iter().map(|a| a.unwrap()).collect();
        assert_eq!(got, vec![Outcome::Lost(lost); 3]);
        let short_run = Ok(Outcome::Ran { token: "t".into(), value: vec![admit(1)] });
        assert!(split(short_run, 2).iter().all(|a| matches!(a, Err(StoreError::Protocol(_)))));
    }
}
