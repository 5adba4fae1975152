//! The agent's incarnation at the allocator (I4): its epoch and the
//! sequence numbers of its grants, and the request for a new epoch that a
//! loss of Redis state or a stale-epoch answer makes. The registration
//! task that answers the request is the `epoch` module's.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use tokio::sync::Notify;

/// The agent's incarnation at the allocator.
#[derive(Default)]
pub struct Identity {
    /// `(epoch, next seq)`; one lock so a grant never pairs a new epoch with
    /// an old sequence number (that would look like a replay, I3).
    state: Mutex<(i64, i64)>,
    need: AtomicBool,
    wake: Notify,
    /// Notified after each successful registration.
    pub registered: Notify,
}

impl Identity {
    /// The current epoch, 0 before the first registration.
    pub fn epoch(&self) -> i64 {
        self.state.lock().unwrap().0
    }

    /// The epoch and a fresh sequence number for a grant.
    pub fn next_seq(&self) -> (i64, i64) {
        let mut s = self.state.lock().unwrap();
        let seq = s.1;
        s.1 += 1;
        (s.0, seq)
    }

    /// Asks the registration task for a new epoch.
    pub fn request_register(&self) {
        self.need.store(true, Ordering::SeqCst);
        self.wake.notify_one();
    }

    /// Whether a new epoch was asked for since the last call (the
    /// registration task takes the request).
    pub fn take_request(&self) -> bool {
        self.need.swap(false, Ordering::SeqCst)
    }

    /// Keeps the request for the next attempt (a registration failed),
    /// without waking the task.
    pub fn keep_request(&self) {
        self.need.store(true, Ordering::SeqCst);
    }

    /// Resolves when a new epoch is asked for.
    pub async fn requested(&self) {
        self.wake.notified().await
    }

    /// A registration answered `epoch`: the grant sequence starts again.
    pub fn registered_as(&self, epoch: i64) {
        *self.state.lock().unwrap() = (epoch, 0);
    }
}
