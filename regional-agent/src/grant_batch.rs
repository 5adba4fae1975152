//! Renewals of many quotas in few requests. Each quota's renewer asks for
//! its own grant ([`Grants::grant`]); the grants asked for while
//! one request is on its way to the allocator wait and leave together, as
//! one `POST /v1/grants` with `items` (at most [`MAX_GRANT_BATCH`]), when
//! it comes back. A grant alone leaves at once in the single form, so
//! batching adds no wait: only grants that would have queued behind
//! another request's round trip share the next one.
//!
//! Each item keeps its own idempotency key and is answered as the single
//! form would be, so a renewer sees the same outcomes either way. An
//! allocator that refuses the batch form as a whole (one older than
//! batches answers 422) gets the items one by one from then on.
//!
//! The sending runs on a task of its own: a renewer that stops waiting
//! never leaves the grants queued behind it unsent.

use crate::client::{AllocatorClient, CallError};
use quota_shared::wire::{GrantBatchRequest, GrantItemAnswer, GrantRequest, GrantResponse, MAX_GRANT_BATCH};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::oneshot;

type Answer = Result<GrantResponse, CallError>;

/// The agent's grants: those waiting to be sent, whether a sender is
/// running, and the client that sends them (one per agent, shared by every
/// renewer).
pub struct Grants {
    client: Arc<AllocatorClient>,
    state: Mutex<Queue>,
    /// Set once the allocator refused the batch form as a whole.
    singles_only: AtomicBool,
}

#[derive(Default)]
struct Queue {
    waiting: Vec<(GrantRequest, oneshot::Sender<Answer>)>,
    sending: bool,
}

impl Grants {
    /// Grants sent through `client`.
    pub fn new(client: Arc<AllocatorClient>) -> Grants {
        Grants { client, state: Mutex::default(), singles_only: AtomicBool::new(false) }
    }

    /// Queues `req`; starts the sender when none runs.
    fn push(&self, req: GrantRequest, tx: oneshot::Sender<Answer>) -> bool {
        let mut q = self.state.lock().unwrap();
        q.waiting.push((req, tx));
        !std::mem::replace(&mut q.sending, true)
    }

    /// The next grants to send together; `None` (and the sender stops)
    /// when nothing waits.
    fn take(&self) -> Option<Vec<(GrantRequest, oneshot::Sender<Answer>)>> {
        let mut q = self.state.lock().unwrap();
        if q.waiting.is_empty() {
            q.sending = false;
            return None;
        }
        let n = q.waiting.len().min(MAX_GRANT_BATCH);
        Some(q.waiting.drain(..n).collect())
    }

    /// `POST /v1/grants` for one quota, sent alone or with the grants of
    /// other quotas asked for meanwhile (see the module docs).
    pub async fn grant(self: &Arc<Self>, req: &GrantRequest) -> Answer {
        let (tx, rx) = oneshot::channel();
        if self.push(req.clone(), tx) {
            let me = self.clone();
            tokio::spawn(async move {
                while let Some(batch) = me.take() {
                    me.send_grants(batch).await;
                }
            });
        }
        rx.await.unwrap_or_else(|_| Err(CallError::Unreachable("grant sender stopped".into())))
    }

    async fn send_grants(self: &Arc<Self>, batch: Vec<(GrantRequest, oneshot::Sender<Answer>)>) {
        if self.singles_only.load(Ordering::Relaxed) {
            self.send_singles(batch);
            return;
        }
        if let [(req, _)] = batch.as_slice() {
            // Alone: the single form, awaited, so what is asked for
            // meanwhile queues for the next request.
            let answer = self.client.grant_single(req).await;
            if let Some((_, tx)) = batch.into_iter().next() {
                let _ = tx.send(answer);
            }
            return;
        }
        let (reqs, txs): (Vec<_>, Vec<_>) = batch.into_iter().unzip();
        let body = GrantBatchRequest { items: reqs };
        let answer = self.client.post_grants(&body).await;
        match answer {
            Ok(r) if r.items.len() == txs.len() => {
                for (item, tx) in r.items.into_iter().zip(txs) {
                    let _ = tx.send(self.item_answer(item));
                }
            }
            // The allocator answered but not with the batch form: an older
            // one, or a batch it cannot take. The items go one by one.
            Ok(_) | Err(CallError::Refused { .. }) => {
                tracing::info!("the allocator refused a grant batch; renewals go one request per quota");
                self.singles_only.store(true, Ordering::Relaxed);
                self.send_singles(body.items.into_iter().zip(txs).collect());
            }
            Err(e @ CallError::Unreachable(_)) => {
                for tx in txs {
                    let _ = tx.send(Err(CallError::Unreachable(e.to_string())));
                }
            }
        }
    }

    /// Each grant in the single form, each on its own task, as renewers
    /// sent them before batches.
    fn send_singles(self: &Arc<Self>, batch: Vec<(GrantRequest, oneshot::Sender<Answer>)>) {
        for (req, tx) in batch {
            let me = self.clone();
            tokio::spawn(async move {
                let _ = tx.send(me.client.grant_single(&req).await);
            });
        }
    }

    /// One item's answer as the single form's call would have returned it.
    fn item_answer(&self, item: GrantItemAnswer) -> Answer {
        match (item.status, item.grant) {
            (200, Some(g)) => Ok(g),
            (status, _) => Err(self.client.item_error(status, item.error)),
        }
    }
}
