//! Coalescing of concurrent decisions on one quota. A quota has at most
//! [`MAX_RUNS_IN_FLIGHT`] runs of the spend script (`lua/spend.lua`) in
//! flight at once, pipelined on the multiplexed Redis connection; the
//! requests that arrive while all of them are busy queue, and the next run
//! decides a batch of them, one after the other in arrival order. Each run
//! is one script, so it checks and debits atomically whatever runs beside
//! it: each decision still sees every debit made before it (I5), and a run
//! scans the leases once and writes the counters once for its batch. At low
//! load a run carries one request and nothing waits; under load a request
//! waits for a free run instead of the one run in flight, and Redis, not
//! the agent, is what bounds a busy quota.
//!
//! Why two: with one run in flight, a request arriving just after a run
//! started waited for it to come back and then for its own. Why not more:
//! each run costs Redis a lease scan and the server stamp, so more runs
//! with smaller batches spend Redis CPU, which the agent and Redis share
//! on a small host, on the same decisions. Measured in paired runs of
//! `cargo lab bench --quick --only acquire` (16 clients on one quota): 2
//! in flight against 1 decided about 1 % more over HTTP and 7 % more over
//! RLS (3.8 decisions per run instead of 5.9); 4 in flight decided about
//! 15 % fewer (2.4 per run).
//!
//! Bounds: at most [`MAX_RUNS_IN_FLIGHT`] runs per quota, each carrying at
//! most [`MAX_BATCH`] requests; a quota's queue holds at most
//! [`MAX_QUEUED`] (a request beyond it runs on its own), and a request
//! waits for its answer at most two Redis timeouts.

use crate::scripts::{Ask, Common, Outcome, Spend};
use crate::store::StoreError;
use std::collections::VecDeque;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::oneshot;

/// Most requests decided by one run of the script.
pub const MAX_BATCH: usize = 64;
/// Most requests queued per quota behind the runs in flight.
pub const MAX_QUEUED: usize = 1024;
/// Most runs of one quota's batches in flight at once.
pub const MAX_RUNS_IN_FLIGHT: usize = 2;

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
    /// Drainer tasks running for this quota, each with at most one run in
    /// flight: at most [`MAX_RUNS_IN_FLIGHT`].
    running: usize,
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
            if sq.running < MAX_RUNS_IN_FLIGHT {
                sq.running += 1;
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

/// Counts the drainer out of the queue's `running` if it dies before it
/// could (a panic), so that the next request starts a new one.
struct Running<'a> {
    q: &'a SpendQueue,
    armed: bool,
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        if self.armed {
            if let Ok(mut sq) = self.q.inner.lock() {
                sq.running = sq.running.saturating_sub(1);
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
                sq.running = sq.running.saturating_sub(1);
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
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn common() -> Common {
        Common {
            legacy_until_ms: 0,
            fallback: false,
            window_secs: 60,
            allowance: 0,
            rid_ttl_ms: 0,
            per_key: None,
            legacy_fallback: None,
        }
    }

    fn ask() -> Ask {
        Ask { costs: vec![1], rid: String::new(), count_demand: true, key: String::new(), held: vec![0] }
    }

    /// Counts the runs in flight (and the most ever seen) and holds each
    /// until the test lets it go.
    #[derive(Clone)]
    struct Held {
        now: Arc<AtomicUsize>,
        most: Arc<AtomicUsize>,
        runs: Arc<AtomicUsize>,
        taken: Arc<AtomicUsize>,
        decided: Arc<AtomicUsize>,
        go: Arc<tokio::sync::Semaphore>,
    }

    impl Held {
        fn new() -> Held {
            let z = || Arc::new(AtomicUsize::new(0));
            Held {
                now: z(),
                most: z(),
                runs: z(),
                taken: z(),
                decided: z(),
                go: Arc::new(tokio::sync::Semaphore::new(0)),
            }
        }
    }

    impl Runner for Held {
        async fn run(&self, _: Common, asks: Vec<Ask>) -> RunAnswer {
            let n = self.now.fetch_add(1, Ordering::SeqCst) + 1;
            self.most.fetch_max(n, Ordering::SeqCst);
            self.runs.fetch_add(1, Ordering::SeqCst);
            self.taken.fetch_add(asks.len(), Ordering::SeqCst);
            self.go.acquire().await.unwrap().forget();
            self.now.fetch_sub(1, Ordering::SeqCst);
            self.decided.fetch_add(asks.len(), Ordering::SeqCst);
            let admit = Admit { source: "lease".into(), window_start: 0, remaining: 0, key_remaining: None };
            Ok(Outcome::Ran {
                token: "t".into(),
                value: asks.iter().map(|_| Spend::Admit(vec![admit.clone()])).collect(),
            })
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_busy_quota_pipelines_a_few_runs_and_batches_the_rest() {
        let q = Arc::new(SpendQueue::default());
        let r = Held::new();
        let n = 200;
        let mut waiting = Vec::new();
        for _ in 0..n {
            let (q, r) = (q.clone(), r.clone());
            waiting.push(tokio::spawn(
                async move { spend(&q, Duration::from_secs(5), common(), ask(), r).await },
            ));
        }
        // Every request has arrived and the first runs are held: exactly the
        // bound is in flight, the rest queue.
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while (r.now.load(Ordering::SeqCst) < MAX_RUNS_IN_FLIGHT
            || r.taken.load(Ordering::SeqCst) + q.inner.lock().unwrap().queue.len() < n)
            && std::time::Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        assert_eq!(r.now.load(Ordering::SeqCst), MAX_RUNS_IN_FLIGHT);
        r.go.add_permits(10_000);
        for w in waiting {
            assert!(matches!(w.await.unwrap(), Ok(Outcome::Ran { value: Spend::Admit(_), .. })));
        }
        assert_eq!(r.most.load(Ordering::SeqCst), MAX_RUNS_IN_FLIGHT);
        assert_eq!(r.decided.load(Ordering::SeqCst), n);
        // The queue behind the held runs was decided in batches, not one run each.
        let runs = r.runs.load(Ordering::SeqCst);
        assert!(runs < n / 4, "{runs} runs for {n} requests");
        assert_eq!(q.inner.lock().unwrap().running, 0, "every drainer left");
    }

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
