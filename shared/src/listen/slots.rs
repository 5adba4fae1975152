//! The connection bound: which connections are open, which of them have a
//! request in progress, and whom to evict at the bound (see the module
//! documentation of [`super`]).

use super::{Limits, ListenerMetrics, Reason};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::Notify;

/// Evicted connections whose task has not closed them yet; past this many
/// the accept loop waits (see [`Slots::room_to_evict`]) and, after that
/// wait, refuses, so descriptors stay within the bound plus this.
const CLOSING_MAX: usize = 64;

/// One open connection's state, shared by its task, its I/O and its
/// service wrappers.
#[derive(Debug)]
pub struct Conn {
    id: u64,
    /// Served probes only (taken from the reserved share).
    pub probes_only: bool,
    started: Instant,
    /// Requests whose answer is not built yet.
    busy: AtomicUsize,
    /// No request answered yet on this connection.
    fresh: AtomicBool,
    /// A byte of the next request arrived while none was in progress.
    reading: AtomicBool,
    /// Start of the current phase (accept, last answer, first byte of the
    /// next request), in ms since `started`.
    mark_ms: AtomicU64,
    evicted: AtomicBool,
    /// Its closing was counted (a stream may report a timeout twice).
    closed_counted: AtomicBool,
    /// Wakes the connection's task: a phase changed, or it was evicted.
    pub(crate) changed: Notify,
}

impl Conn {
    fn new(id: u64, probes_only: bool) -> Conn {
        Conn {
            id,
            probes_only,
            started: Instant::now(),
            busy: AtomicUsize::new(0),
            fresh: AtomicBool::new(true),
            reading: AtomicBool::new(false),
            mark_ms: AtomicU64::new(0),
            evicted: AtomicBool::new(false),
            closed_counted: AtomicBool::new(false),
            changed: Notify::new(),
        }
    }

    fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    fn mark(&self) -> Instant {
        self.started + Duration::from_millis(self.mark_ms.load(Ordering::Acquire))
    }

    /// Whether a request is in progress.
    pub fn busy(&self) -> bool {
        self.busy.load(Ordering::Acquire) > 0
    }

    /// Whether it was evicted to make room.
    pub fn evicted(&self) -> bool {
        self.evicted.load(Ordering::Acquire)
    }

    /// Resolves once the connection is evicted (for a phase nothing else
    /// watches, such as a TLS handshake: an evicted connection must give
    /// its descriptor back at once, not at the header timeout).
    pub async fn until_evicted(&self) {
        while !self.evicted() {
            self.changed.notified().await;
        }
    }

    /// Bytes arrived: the first of a request on an idle keep-alive
    /// connection starts its header timeout.
    pub fn on_read(&self) {
        if !self.busy() && !self.fresh.load(Ordering::Acquire) && !self.reading.swap(true, Ordering::AcqRel) {
            self.mark_ms.store(self.now_ms(), Ordering::Release);
            self.changed.notify_one();
        }
    }

    /// Counts the connection's closing once (a stream may report a
    /// timeout twice).
    pub fn count_closed(&self, metrics: &ListenerMetrics, reason: Reason) {
        if !self.closed_counted.swap(true, Ordering::AcqRel) {
            metrics.closed(reason);
        }
    }

    /// A request's headers were read: it is in progress until the guard drops.
    pub fn start_request(self: &Arc<Self>) -> Busy {
        self.busy.fetch_add(1, Ordering::AcqRel);
        Busy(self.clone())
    }

    /// When and why the connection is to be closed if nothing happens
    /// before; `None` while a request is in progress.
    pub fn deadline(&self, limits: &Limits) -> Option<(Instant, Reason)> {
        if self.busy() {
            return None;
        }
        let mark = self.mark();
        if self.fresh.load(Ordering::Acquire) || self.reading.load(Ordering::Acquire) {
            Some((mark + limits.header_read_timeout, Reason::HeaderTimeout))
        } else {
            Some((mark + limits.idle_timeout, Reason::Idle))
        }
    }
}

/// A request in progress on its connection.
pub struct Busy(Arc<Conn>);

impl Drop for Busy {
    fn drop(&mut self) {
        let c = &self.0;
        // The next phase (idle) starts now.
        c.mark_ms.store(c.now_ms(), Ordering::Release);
        c.fresh.store(false, Ordering::Release);
        c.reading.store(false, Ordering::Release);
        c.busy.fetch_sub(1, Ordering::AcqRel);
        c.changed.notify_one();
    }
}

#[derive(Default)]
struct Open {
    next: u64,
    conns: HashMap<u64, Arc<Conn>>,
    /// Not evicted, by class.
    general: usize,
    probes: usize,
    closing: usize,
}

/// The open connections of one listener.
pub struct Slots {
    max: usize,
    reserve: usize,
    /// Idle connections may be evicted (HTTP/1, whose requests are seen);
    /// otherwise a full bound refuses.
    evict_idle: bool,
    open: Mutex<Open>,
    /// An evicted connection was closed (room under [`CLOSING_MAX`]).
    closed_evicted: Notify,
    metrics: ListenerMetrics,
}

/// What a new connection gets.
pub enum Admit {
    /// Served normally.
    Serve(Slot),
    /// Served `/healthz` and `/readyz` only.
    ProbesOnly(Slot),
    /// Closed at once.
    Refuse,
}

/// A connection's place in the bound, given back when dropped.
pub struct Slot {
    pub conn: Arc<Conn>,
    slots: Arc<Slots>,
}

impl Slot {
    /// Counts the connection as closed by a timeout (it is closed by
    /// whoever owns it; the slot is given back when this drops).
    pub fn conn_closed(&mut self, reason: Reason) {
        self.conn.count_closed(&self.slots.metrics, reason);
    }

    /// The listener's metrics.
    pub fn metrics(&self) -> &ListenerMetrics {
        &self.slots.metrics
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.slots.release(&self.conn);
    }
}

impl Slots {
    /// The bound of an HTTP/1 listener: idle connections are evicted at the
    /// bound, a reserved share serves probes.
    pub fn http(limits: &Limits, metrics: ListenerMetrics) -> Arc<Slots> {
        Arc::new(Slots {
            max: limits.max_connections,
            reserve: limits.probe_reserve().min(limits.max_connections - 1),
            evict_idle: true,
            open: Mutex::new(Open::default()),
            closed_evicted: Notify::new(),
            metrics,
        })
    }

    /// A plain bound: at `max` new connections are refused.
    pub fn plain(max: usize, metrics: ListenerMetrics) -> Arc<Slots> {
        Arc::new(Slots {
            max,
            reserve: 0,
            evict_idle: false,
            open: Mutex::new(Open::default()),
            closed_evicted: Notify::new(),
            metrics,
        })
    }

    /// The listener's metrics.
    pub fn metrics(&self) -> &ListenerMetrics {
        &self.metrics
    }

    /// Returns once fewer than [`CLOSING_MAX`] evicted connections are
    /// still closing, or at `deadline`. The accept loop calls it before
    /// accepting: a flood of connections then waits in the kernel's accept
    /// queue while the evicted ones close, instead of being accepted and
    /// refused, and so does a probe that arrives in the flood (refused, it
    /// would count as a failed probe).
    pub async fn room_to_evict(&self, deadline: tokio::time::Instant) {
        loop {
            let closed = self.closed_evicted.notified();
            tokio::pin!(closed);
            closed.as_mut().enable();
            if self.open.lock().unwrap().closing < CLOSING_MAX {
                return;
            }
            if tokio::time::timeout_at(deadline, closed).await.is_err() {
                return;
            }
        }
    }

    /// Decides about a new connection.
    pub fn admit(self: &Arc<Self>) -> Admit {
        let mut o = self.open.lock().unwrap();
        let admit = if o.general < self.max - self.reserve || self.evict(&mut o, false) {
            o.general += 1;
            Some(false)
        } else if self.reserve > 0 && (o.probes < self.reserve || self.evict(&mut o, true)) {
            o.probes += 1;
            Some(true)
        } else {
            None
        };
        let Some(probes_only) = admit else {
            drop(o);
            self.metrics.closed(Reason::Bound);
            return Admit::Refuse;
        };
        o.next += 1;
        let conn = Arc::new(Conn::new(o.next, probes_only));
        o.conns.insert(conn.id, conn.clone());
        let n = o.conns.len();
        drop(o);
        self.metrics.open(n);
        let slot = Slot { conn, slots: self.clone() };
        if probes_only {
            Admit::ProbesOnly(slot)
        } else {
            Admit::Serve(slot)
        }
    }

    /// Evicts the longest-idle connection of the class, if any is idle.
    fn evict(&self, o: &mut Open, probes: bool) -> bool {
        if !self.evict_idle || o.closing >= CLOSING_MAX {
            return false;
        }
        let victim = o
            .conns
            .values()
            .filter(|c| c.probes_only == probes && !c.evicted() && !c.busy())
            .min_by_key(|c| c.mark())
            .cloned();
        let Some(v) = victim else { return false };
        v.evicted.store(true, Ordering::Release);
        v.changed.notify_one();
        if probes {
            o.probes -= 1;
        } else {
            o.general -= 1;
        }
        o.closing += 1;
        self.metrics.closed(Reason::Bound);
        true
    }

    fn release(&self, c: &Conn) {
        let mut o = self.open.lock().unwrap();
        if o.conns.remove(&c.id).is_none() {
            return;
        }
        if c.evicted() {
            o.closing -= 1;
            self.closed_evicted.notify_waiters();
        } else if c.probes_only {
            o.probes -= 1;
        } else {
            o.general -= 1;
        }
        let n = o.conns.len();
        drop(o);
        self.metrics.open(n);
    }

    /// Connections open now (evicted ones until closed included).
    pub fn open(&self) -> usize {
        self.open.lock().unwrap().conns.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prom::Registry;

    fn slots(max: usize) -> Arc<Slots> {
        let limits = Limits { max_connections: max, ..Limits::default() };
        let metrics = ListenerMetrics {
            registry: Arc::new(Registry::default()),
            open: "o",
            closed: "c",
            listener: "t",
        };
        Slots::http(&limits, metrics)
    }

    #[test]
    fn at_the_bound_the_longest_idle_is_evicted_and_busy_ones_are_kept() {
        let s = slots(8); // 7 general, 1 reserved
        let mut held = Vec::new();
        for _ in 0..7 {
            match s.admit() {
                Admit::Serve(slot) => held.push(slot),
                _ => panic!("under the bound"),
            }
        }
        // All busy: the reserve serves probes, then refusal.
        let busy: Vec<_> = held.iter().map(|s| s.conn.start_request()).collect();
        assert!(matches!(s.admit(), Admit::ProbesOnly(_)));
        let probe = match s.admit() {
            Admit::ProbesOnly(p) => p,
            _ => panic!("the reserved slot was free again"),
        };
        let _busy_probe = probe.conn.start_request();
        assert!(matches!(s.admit(), Admit::Refuse));
        // Every general connection but the first gets busy again: the
        // first, idle, is evicted for the newcomer.
        drop(busy);
        let _busy_again: Vec<_> = held[1..].iter().map(|s| s.conn.start_request()).collect();
        assert!(matches!(s.admit(), Admit::Serve(_)), "an idle connection should have made room");
        let evicted: Vec<bool> = held.iter().map(|s| s.conn.evicted()).collect();
        assert_eq!(evicted, [true, false, false, false, false, false, false]);
    }

    #[tokio::test]
    async fn the_accept_loop_waits_while_too_many_evicted_connections_are_closing() {
        let s = slots(CLOSING_MAX + 8); // 1 reserved
        let general = s.max - s.reserve;
        let mut held: Vec<Slot> = (0..general)
            .map(|_| match s.admit() {
                Admit::Serve(slot) => slot,
                _ => panic!("under the bound"),
            })
            .collect();
        // Every newcomer evicts an idle one; none of the evicted is closed.
        for _ in 0..CLOSING_MAX {
            match s.admit() {
                Admit::Serve(slot) => held.push(slot),
                _ => panic!("an idle connection should have made room"),
            }
        }
        let waited = tokio::time::Instant::now();
        s.room_to_evict(waited + Duration::from_millis(50)).await;
        assert!(waited.elapsed() >= Duration::from_millis(50), "returned while {CLOSING_MAX} are closing");
        // One evicted connection closes: the wait ends before its limit.
        let first_evicted = held.iter().position(|h| h.conn.evicted()).expect("an evicted one");
        let waiter = tokio::spawn({
            let s = s.clone();
            async move {
                let t = tokio::time::Instant::now();
                s.room_to_evict(t + Duration::from_secs(10)).await;
                t.elapsed()
            }
        });
        tokio::task::yield_now().await;
        drop(held.remove(first_evicted));
        let took = waiter.await.expect("waiter");
        assert!(took < Duration::from_secs(5), "{took:?}");
    }

    #[test]
    fn a_plain_bound_refuses_at_max_and_frees_on_drop() {
        let metrics = ListenerMetrics {
            registry: Arc::new(Registry::default()),
            open: "o",
            closed: "c",
            listener: "t",
        };
        let s = Slots::plain(4, metrics);
        let held: Vec<_> = (0..4)
            .map(|_| match s.admit() {
                Admit::Serve(slot) => slot,
                _ => panic!("under the bound"),
            })
            .collect();
        assert!(matches!(s.admit(), Admit::Refuse));
        drop(held);
        assert_eq!(s.open(), 0);
        assert!(matches!(s.admit(), Admit::Serve(_)));
    }
}
