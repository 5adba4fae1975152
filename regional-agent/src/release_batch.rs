//! Releases of many leases in one request. The outbox collects the
//! release entries it meets in one round, over every quota's list, and
//! sends them together as one `POST /v1/leases/release` with `items` (at
//! most [`MAX_RELEASE_BATCH`]); a release alone goes in the single form
//! (`POST /v1/leases/{lease_id}/release`). Each item is answered as the
//! single form would be, so the outbox classifies every answer exactly as
//! before (see [`crate::outbox::classify`]).
//!
//! An allocator older than the batch form has no such route (404 or 405
//! for the request as a whole): the releases go one by one from then on.
//! Any other refusal of the whole request (a token being rotated, a
//! proxy's 413) is every item's answer, and the outbox retries them.

use crate::client::{AllocatorClient, CallError};
use quota_shared::wire::{ReleaseBatchRequest, ReleaseItem, ReleaseItemAnswer, ReleaseRequest};
use std::sync::atomic::{AtomicBool, Ordering};

pub use quota_shared::wire::MAX_RELEASE_BATCH;

/// One release's answer, as the outbox reads it.
pub type Answer = Result<(), CallError>;

/// Whether the allocator takes the batch form.
#[derive(Default)]
pub struct Releases {
    /// Set once the allocator had no route for the batch form.
    singles_only: AtomicBool,
}

impl Releases {
    /// Sends `items` (at most [`MAX_RELEASE_BATCH`]) and answers each, in
    /// order.
    pub async fn send(&self, client: &AllocatorClient, items: &[ReleaseItem]) -> Vec<Answer> {
        if items.len() < 2 || self.singles_only.load(Ordering::Relaxed) {
            return singles(client, items).await;
        }
        let body = ReleaseBatchRequest { items: items.to_vec() };
        match client.post_releases(&body).await {
            Ok(r) if r.items.len() == items.len() => {
                r.items.into_iter().map(|a| item_answer(client, a)).collect()
            }
            Ok(_) => {
                tracing::warn!(
                    "the allocator answered a release batch with another number of items; sending one by one"
                );
                singles(client, items).await
            }
            Err(CallError::Refused { status: 404 | 405, .. }) => {
                tracing::info!("the allocator has no release batches; releases go one request per lease");
                self.singles_only.store(true, Ordering::Relaxed);
                singles(client, items).await
            }
            Err(CallError::Refused { status, code, message, item }) => items
                .iter()
                .map(|_| {
                    Err(CallError::Refused { status, code: code.clone(), message: message.clone(), item })
                })
                .collect(),
            Err(CallError::Unreachable(why)) => {
                items.iter().map(|_| Err(CallError::Unreachable(why.clone()))).collect()
            }
        }
    }
}

/// Each release in the single form, one after another (the outbox's pace
/// before batches).
async fn singles(client: &AllocatorClient, items: &[ReleaseItem]) -> Vec<Answer> {
    let mut answers = Vec::with_capacity(items.len());
    for i in items {
        let req = ReleaseRequest { epoch: i.epoch, unspent: i.unspent };
        answers.push(client.release(&i.lease_id.to_string(), &req).await.map(|_| ()));
    }
    answers
}

/// One item's answer as the single form's call would have returned it.
fn item_answer(client: &AllocatorClient, item: ReleaseItemAnswer) -> Answer {
    match item.status {
        200 => Ok(()),
        status => Err(client.item_error(status, item.error)),
    }
}
