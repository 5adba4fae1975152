//! What the handlers and background tasks share: the settings, the Redis
//! store, the allocator client, the quota registry, the agent's identity,
//! the metrics, the clocks, and the background tasks to stop at shutdown.
//! It knows no handler and no task (they take what they use from it), so
//! the modules that use it never lead back here. The parts a handler or
//! task may take on its own are shared handles (`Arc`s, or cheap clones
//! such as [`Store`]), so a narrower state is a copy of a few handles.

use crate::client::AllocatorClient;
use crate::config::Settings;
use crate::fleet_counts::FleetStatus;
use crate::identity::Identity;
use crate::keys::Keys;
use crate::quotas::{self, Quotas};
use crate::store::Store;
use crate::{fallback, guard};
use quota_shared::clock::{Clock, OffsetClock, SystemClock};
use quota_shared::listen::ListenerMetrics;
use quota_shared::prom::Registry;
use std::future::Future;
use std::sync::{Arc, Mutex};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// Gauge of open connections per listener (`http`, `grpc`).
pub const LISTENER_OPEN: &str = "agent_listener_connections";
/// Counter of connections a listener refused or closed, by reason.
pub const LISTENER_CLOSED: &str = "agent_listener_closed_total";

/// Everything the handlers and background tasks share.
pub struct App {
    pub settings: Arc<Settings>,
    pub keys: Keys,
    pub store: Store,
    pub alloc: Arc<AllocatorClient>,
    /// The renewers' grants, batched (see [`crate::grant_batch`]).
    pub grants: Arc<crate::grant_batch::Grants>,
    pub quotas: Arc<Quotas>,
    pub ident: Arc<Identity>,
    pub metrics: Arc<Registry>,
    /// UTC for windows (scheduling and the fallback window), monotonic for deadlines.
    pub clock: Arc<dyn Clock>,
    /// Creates quotas and starts their renewers.
    pub registry: Arc<crate::registry::Registry>,
    /// What a decision uses of this state.
    pub decider: Arc<Decider>,
    /// The opt-in local allowance while Redis is down.
    pub local: Arc<fallback::LocalFallback>,
    /// Quota names the allocator recently answered 404 for.
    pub unknown: Arc<quotas::Unknown>,
    /// The allocator's clock as its grant answers show it.
    pub alloc_clock: Arc<AllocatorClock>,
    /// Whether the region's Redis may be trusted to keep keys (eviction policy).
    pub guard: Arc<guard::Guard>,
    /// Per-window refusal counts and the outbox depth for the allocator's fleet pages.
    pub fleet_status: Arc<FleetStatus>,
    /// The region's legacy gate (key layout upgrade, see [`crate::legacy`]).
    pub legacy: Arc<crate::legacy::Gate>,
    /// Concurrency quotas and their permits (see [`crate::permits`]).
    pub permits: Arc<crate::permits::Permits>,
    /// Stops the background tasks.
    pub cancel: CancellationToken,
    tasks: Tasks,
    /// The runtime the app was made on, where background tasks run: a
    /// quota first seen by an RLS call (served on a thread of its own, see
    /// [`crate::rls`]) still gets its renewer here.
    runtime: tokio::runtime::Handle,
}

/// The background tasks to stop at shutdown.
pub type Tasks = Arc<Mutex<Vec<JoinHandle<()>>>>;

/// Adds `h` to the task list, first dropping the handles of tasks that
/// have ended when the list is full. Each known quota's renewer is a task,
/// and quotas come and go (idle ones leave, unknown names are dropped); a
/// finished task's memory is freed only with its handle, so a list that
/// kept them grew with every quota ever seen. Pruning only when the list
/// is at its capacity keeps a push O(1) on average.
pub fn keep_task(tasks: &mut Vec<JoinHandle<()>>, h: JoinHandle<()>) {
    if tasks.len() == tasks.capacity() {
        tasks.retain(|t| !t.is_finished());
    }
    tasks.push(h);
}

/// What an admission decision ([`crate::spend`]) uses of the agent's state:
/// not the allocator client, the fleet counts, the task list or the
/// cancellation. Its parts are the same handles as [`App`]'s.
pub struct Decider {
    pub settings: Arc<Settings>,
    pub keys: Keys,
    pub store: Store,
    pub registry: Arc<crate::registry::Registry>,
    /// Quota names the allocator recently answered 404 for.
    pub unknown: Arc<quotas::Unknown>,
    pub guard: Arc<guard::Guard>,
    pub local: Arc<fallback::LocalFallback>,
    pub legacy: Arc<crate::legacy::Gate>,
    pub ident: Arc<Identity>,
    pub metrics: Arc<Registry>,
    pub clock: Arc<dyn Clock>,
    /// Shedding by priority: the lines and the decisions in flight.
    pub shed: Arc<crate::shed::Shedder>,
    /// Concurrency quotas: a decision on one answers as a policy refusal.
    pub permits: Arc<crate::permits::Permits>,
    alloc: Arc<AllocatorClient>,
    alloc_clock: Arc<AllocatorClock>,
}

impl Decider {
    /// See [`App::allocator_reachable`].
    pub fn allocator_reachable(&self) -> bool {
        self.alloc.breaker.reachable()
    }

    /// See [`AllocatorClock::now`].
    pub fn allocator_now(&self) -> chrono::DateTime<chrono::Utc> {
        self.alloc_clock.now()
    }
}

/// Shared state of every handler.
pub type AppState = Arc<App>;

impl App {
    /// Connects the clients (Redis lazily for a single server). The metric
    /// families are declared by the caller (`describe_metrics` in the crate root).
    pub async fn new(settings: Settings) -> Result<AppState, String> {
        let store = Store::for_settings(&settings).await?;
        let alloc = AllocatorClient::new(
            &settings.allocator,
            settings.agent_token.clone(),
            settings.allocator_timeout,
            &settings.allocator_tls,
        )?;
        let metrics = Registry::default();
        let clock: Arc<dyn Clock> = match settings.test_clock_offset_ms {
            0 => Arc::new(SystemClock),
            ms => {
                tracing::warn!(offset_ms = ms, "wall clock shifted for testing (--test-clock-offset-ms)");
                Arc::new(OffsetClock::new(chrono::Duration::milliseconds(ms)))
            }
        };
        let keys = Keys::with_layout(&settings.redis_prefix, settings.key_layout);
        let settings = Arc::new(settings);
        let quotas: Arc<Quotas> = Arc::default();
        let registry = Arc::new(crate::registry::Registry::new(quotas.clone(), keys.clone()));
        let alloc_clock = Arc::new(AllocatorClock::new(clock.clone()));
        let alloc = Arc::new(alloc);
        let ident: Arc<Identity> = Arc::default();
        let metrics = Arc::new(metrics);
        let permits = Arc::new(crate::permits::Permits::new(
            store.clone(),
            keys.clone(),
            alloc.clone(),
            ident.clone(),
            metrics.clone(),
            &settings.region,
            &settings.agent,
        ));
        let decider = Arc::new(Decider {
            settings: settings.clone(),
            keys: keys.clone(),
            store: store.clone(),
            registry: registry.clone(),
            unknown: Arc::default(),
            guard: Arc::default(),
            local: Arc::default(),
            legacy: Arc::new(crate::legacy::Gate::new(settings.key_layout)),
            ident,
            metrics,
            clock: clock.clone(),
            shed: Arc::new(crate::shed::Shedder::new(settings.shed_in_flight, settings.shed_store_latency)),
            permits: permits.clone(),
            alloc,
            alloc_clock: alloc_clock.clone(),
        });
        let d = &decider;
        Ok(Arc::new(App {
            keys,
            legacy: d.legacy.clone(),
            settings,
            store,
            alloc: d.alloc.clone(),
            grants: Arc::new(crate::grant_batch::Grants::new(d.alloc.clone())),
            quotas,
            ident: d.ident.clone(),
            metrics: d.metrics.clone(),
            alloc_clock,
            clock,
            registry,
            local: d.local.clone(),
            unknown: d.unknown.clone(),
            guard: d.guard.clone(),
            fleet_status: Arc::default(),
            permits,
            cancel: CancellationToken::new(),
            tasks: Tasks::default(),
            runtime: tokio::runtime::Handle::current(),
            decider,
        }))
    }

    /// Whether the allocator counts as reachable (see the crate doc).
    pub fn allocator_reachable(&self) -> bool {
        self.decider.allocator_reachable()
    }

    /// See [`AllocatorClock::now`].
    pub fn allocator_now(&self) -> chrono::DateTime<chrono::Utc> {
        self.decider.allocator_now()
    }

    /// Runs `f` as a background task the shutdown waits for (and cuts at
    /// its deadline).
    pub fn spawn(&self, f: impl Future<Output = ()> + Send + 'static) {
        keep_task(&mut self.tasks.lock().unwrap(), self.runtime.spawn(f));
    }

    /// The runtime background tasks run on (see [`App::spawn`]).
    pub fn runtime(&self) -> &tokio::runtime::Handle {
        &self.runtime
    }

    /// Where the listener named `listener` counts its connections.
    pub fn listener_metrics(&self, listener: &'static str) -> ListenerMetrics {
        ListenerMetrics {
            registry: self.metrics.clone(),
            open: LISTENER_OPEN,
            closed: LISTENER_CLOSED,
            listener,
        }
    }

    /// A handle on the task list, for what spawns tasks without the app
    /// (the registry's renewers).
    pub(crate) fn tasks(&self) -> Tasks {
        self.tasks.clone()
    }

    /// The background tasks started so far (taken: the shutdown awaits them).
    pub(crate) fn take_tasks(&self) -> Vec<JoinHandle<()>> {
        std::mem::take(&mut *self.tasks.lock().unwrap())
    }
}

/// The allocator's clock as its last grant answer showed it, and the
/// monotonic instant the request for that answer was sent; shared by the renewer (which
/// observes it), the acquire path and the status (which read it).
pub struct AllocatorClock {
    /// This host's clock, until the first answer.
    clock: Arc<dyn Clock>,
    last: Mutex<Option<(chrono::DateTime<chrono::Utc>, std::time::Instant)>>,
}

impl AllocatorClock {
    /// Nothing observed yet: [`AllocatorClock::now`] is `clock`'s.
    pub fn new(clock: Arc<dyn Clock>) -> AllocatorClock {
        AllocatorClock { clock, last: Mutex::new(None) }
    }

    /// Records the allocator's clock read off a grant answer (`at` is the
    /// allocator's instant when it answered, `sent` when this agent sent the
    /// request: the allocator read `at` after it, so [`Self::now`] never
    /// lags the allocator's clock; it may lead by one round trip).
    pub fn observe(&self, at: chrono::DateTime<chrono::Utc>, sent: std::time::Instant) {
        *self.last.lock().unwrap() = Some((at, sent));
    }

    /// The allocator's clock minus this host's (the agent's own clock), as
    /// the last grant answer showed it; `None` before the first answer.
    /// Only for operators: no decision reads it.
    pub fn offset(&self) -> Option<chrono::Duration> {
        let known = self.last.lock().unwrap().is_some();
        known.then(|| self.now() - self.clock.now_utc())
    }

    /// The allocator's clock now, extrapolated with the monotonic clock from
    /// its last answer (I8: window decisions of this agent's own, such as the
    /// local store fallback, follow the allocator, not this host's wall
    /// clock); this host's clock only before the first answer.
    pub fn now(&self) -> chrono::DateTime<chrono::Utc> {
        match *self.last.lock().unwrap() {
            Some((at, sent)) => {
                at + chrono::Duration::from_std(sent.elapsed()).unwrap_or_else(|_| chrono::Duration::zero())
            }
            None => self.clock.now_utc(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::keep_task;

    /// Quotas come and go for days: the handles of renewers that ended do
    /// not pile up in the task list, and running tasks are all kept.
    #[tokio::test]
    async fn the_task_list_drops_ended_tasks_and_keeps_running_ones() {
        let mut tasks = Vec::new();
        let stop = tokio_util::sync::CancellationToken::new();
        for _ in 0..3 {
            let stop = stop.clone();
            keep_task(&mut tasks, tokio::spawn(async move { stop.cancelled().await }));
        }
        for _ in 0..10_000 {
            let h = tokio::spawn(async {});
            while !h.is_finished() {
                tokio::task::yield_now().await;
            }
            keep_task(&mut tasks, h);
        }
        assert!(tasks.len() <= 16, "{} handles kept for 3 running tasks", tasks.len());
        assert_eq!(tasks.iter().filter(|t| !t.is_finished()).count(), 3);
        stop.cancel();
    }
}
