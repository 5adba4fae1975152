//! The regional agent (DESIGN §1, §3–§5): the sidecar applications call on
//! every request. It spends allocator leases from the region's Redis with
//! an atomic script (one run decides a request, or the batch of concurrent
//! requests on one quota one after the other), renews ahead of need in
//! proportion to region-wide demand, admits a bounded fallback while the allocator is
//! unreachable, and reports every admit and unspent remainder exactly once
//! through a durable outbox in Redis.
//!
//! # Layout
//!
//! * [`config`]: flags and environment variables.
//! * [`keys`]: the one audited key function (hash-tagged, length-prefixed).
//! * [`store`]: the Redis connection (single or cluster), timeouts, the Lua
//!   scripts of `lua/*.lua`.
//! * [`client`], [`breaker`]: the allocator client with timeouts, capped
//!   exponential backoff with jitter and a circuit breaker.
//! * [`epoch`]: registration, epochs and fences (I4).
//! * [`quotas`]: what the agent knows per quota (policy, demand, incarnation).
//! * [`spend`]: `POST /v1/acquire` (I5, I2, fallback, I6).
//! * [`batch`]: concurrent decisions on one quota share one script run.
//! * [`renew`]: the background renewer (DESIGN §4), crediting (I5, I4).
//! * [`outbox`]: cutting and draining reports and releases (I7).
//! * [`fallback`]: the opt-in local allowance while Redis is unreachable.
//! * [`health`]: `/v1/status`, `/healthz`, `/readyz`, `/metrics`.
//! * [`error`]: the one error enum and its mapping to HTTP.
//!
//! # Behaviour where DESIGN is silent
//!
//! * **Learning a policy.** The agent learns `fail_mode`, the fallback
//!   allowance, the limit and the window length from grant answers and caches
//!   them in Redis (`pol`) for the other replicas and for restarts during a
//!   partition. The first acquire of a quota no replica knows waits for one
//!   grant; a 404 from the allocator becomes `404 unknown_quota` (cached 2 s).
//!   A quota never seen while the allocator is unreachable answers `503
//!   allocator_unreachable`.
//! * **After the fallback allowance is spent** during a partition the agent
//!   answers `503 allocator_unreachable` (it cannot decide), not 429.
//! * **Request ids** are remembered for one window length from the first
//!   admit; only admits are remembered, so a retried refusal is decided anew.
//! * **Reachability**: the allocator counts as unreachable from the first
//!   failed call (timeout, refused connection, 5xx) until a call succeeds;
//!   the breaker opens after two consecutive failures.
//! * **Redis data loss** is detected per quota, inside the spend script, by
//!   the quota's incarnation key. An agent that starts while the region's
//!   incarnation key is missing cannot tell a new region from one that lost
//!   its data while no agent ran; it treats the current window's fallback of
//!   each quota it first touches as spent (the safe side).
//! * **Outbox entries** belong to the agent that cut them (the allocator
//!   fences releases and reports by agent); an agent id that never comes back
//!   leaves its entries unreported. Agent ids must be unique per process.
//! * **Time**: a lease is spendable from `nb` (its window start, measured
//!   from the instant the answer arrived) until its deadline (measured from
//!   the instant the request was sent); both are relative Redis TTLs, so no
//!   two hosts' clocks are ever compared (I2). A request arriving in the few
//!   milliseconds between the two waits for the next window's lease.
//! * The agent's own endpoints have no authentication (it is a sidecar);
//!   it warns when listening on a non-loopback address.

pub mod batch;
pub mod breaker;
pub mod client;
pub mod config;
pub mod epoch;
pub mod error;
pub mod fallback;
pub mod health;
pub mod keys;
pub mod outbox;
pub mod quotas;
pub mod renew;
pub mod spend;
pub mod store;

use crate::client::AllocatorClient;
use crate::config::Settings;
use crate::epoch::Identity;
use crate::keys::Keys;
use crate::quotas::{Quota, Quotas};
use crate::store::Store;
use axum::extract::{DefaultBodyLimit, Request};
use axum::Router;
use quota_shared::clock::{Clock, OffsetClock, SystemClock};
use quota_shared::prom::Registry;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// Largest acquire body accepted.
pub const MAX_BODY_BYTES: usize = 64 * 1024;

/// Everything the handlers and background tasks share.
pub struct App {
    pub settings: Settings,
    pub keys: Keys,
    pub store: Store,
    pub alloc: AllocatorClient,
    pub quotas: Quotas,
    pub ident: Identity,
    pub metrics: Registry,
    /// UTC for windows (scheduling and the fallback window), monotonic for deadlines.
    pub clock: Arc<dyn Clock>,
    /// The region's incarnation key was missing at start (see the crate doc).
    pub region_fresh: AtomicBool,
    /// The opt-in local allowance while Redis is down.
    pub local: fallback::LocalFallback,
    /// Quota names the allocator recently answered 404 for.
    pub unknown: quotas::Unknown,
    /// The allocator's clock as its last grant answer showed it, and the
    /// monotonic instant that answer arrived (see [`App::allocator_now`]).
    alloc_time: Mutex<Option<(chrono::DateTime<chrono::Utc>, std::time::Instant)>>,
    /// Stops the background tasks.
    pub cancel: CancellationToken,
    tasks: Mutex<Vec<JoinHandle<()>>>,
}

/// Shared state of every handler.
pub type AppState = Arc<App>;

impl App {
    /// Connects the clients (Redis lazily for a single server).
    pub async fn new(settings: Settings) -> Result<AppState, String> {
        let store = Store::connect(&settings.redis, settings.redis_cluster, settings.redis_timeout).await?;
        let alloc = AllocatorClient::new(
            &settings.allocator,
            settings.agent_token.clone(),
            settings.allocator_timeout,
            &settings.allocator_tls,
        )?;
        let metrics = Registry::default();
        health::describe(&metrics);
        let clock: Arc<dyn Clock> = match settings.test_clock_offset_ms {
            0 => Arc::new(SystemClock),
            ms => {
                tracing::warn!(offset_ms = ms, "wall clock shifted for testing (--test-clock-offset-ms)");
                Arc::new(OffsetClock::new(chrono::Duration::milliseconds(ms)))
            }
        };
        Ok(Arc::new(App {
            keys: Keys::new(&settings.redis_prefix),
            settings,
            store,
            alloc,
            quotas: Quotas::default(),
            ident: Identity::default(),
            metrics,
            clock,
            region_fresh: AtomicBool::new(false),
            local: fallback::LocalFallback::default(),
            unknown: quotas::Unknown::default(),
            alloc_time: Mutex::new(None),
            cancel: CancellationToken::new(),
            tasks: Mutex::new(Vec::new()),
        }))
    }

    /// Whether the allocator counts as reachable (see the crate doc).
    pub fn allocator_reachable(&self) -> bool {
        self.alloc.breaker.reachable()
    }

    /// Records the allocator's clock read off a grant answer (`at` is the
    /// allocator's instant when it answered, `arrived` when the answer came).
    pub fn observe_allocator_time(&self, at: chrono::DateTime<chrono::Utc>, arrived: std::time::Instant) {
        *self.alloc_time.lock().unwrap() = Some((at, arrived));
    }

    /// The allocator's clock now, extrapolated with the monotonic clock from
    /// its last answer (I8: window decisions of this agent's own, such as the
    /// local store fallback, follow the allocator, not this host's wall
    /// clock); this host's clock only before the first answer.
    pub fn allocator_now(&self) -> chrono::DateTime<chrono::Utc> {
        match *self.alloc_time.lock().unwrap() {
            Some((at, arrived)) => {
                at + chrono::Duration::from_std(arrived.elapsed())
                    .unwrap_or_else(|_| chrono::Duration::zero())
            }
            None => self.clock.now_utc(),
        }
    }

    /// The quota, created (with its renewer) on first use; `None` when
    /// [`quotas::MAX_LEARNING`] quotas are still learning their policy.
    pub fn quota(self: &Arc<Self>, tenant: &str, resource: &str) -> Option<Arc<Quota>> {
        let first = if self.region_fresh.load(Ordering::SeqCst) { "?" } else { "" };
        let (q, created) =
            self.quotas.get_or_create(tenant, resource, || self.keys.quota(tenant, resource), first)?;
        if created {
            let h = tokio::spawn(renew::run(self.clone(), q.clone()));
            self.tasks.lock().unwrap().push(h);
        }
        Some(q)
    }

    fn spawn(&self, f: impl Future<Output = ()> + Send + 'static) {
        self.tasks.lock().unwrap().push(tokio::spawn(f));
    }
}

/// The agent's router.
pub fn router(app: AppState) -> Router {
    Router::new()
        .merge(spend::router())
        .merge(health::router())
        .fallback(|req: Request| async move { error::Error::NoRoute(req.uri().path().to_string()) })
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(app)
}

/// Finds out whether the region's Redis is new (or lost its data) and loads
/// the quotas this agent touched before a restart, so their outboxes drain
/// and their old leases are retired.
async fn boot(app: &AppState) {
    let inc_key = app.keys.region_incarnation(&app.settings.region);
    let token = uuid::Uuid::new_v4().simple().to_string();
    for attempt in 0..10u32 {
        let set: Result<Option<String>, _> =
            app.store.cmd(redis::cmd("SET").arg(&inc_key).arg(&token).arg("NX")).await;
        match set {
            Ok(r) => {
                if r.is_some() {
                    tracing::warn!(region = %app.settings.region, "region incarnation key was missing: new region or Redis data loss");
                    app.region_fresh.store(true, Ordering::SeqCst);
                }
                let members: Vec<String> = app
                    .store
                    .cmd(
                        redis::cmd("SMEMBERS")
                            .arg(app.keys.agent_quotas(&app.settings.region, &app.settings.agent)),
                    )
                    .await
                    .unwrap_or_default();
                for m in members {
                    if let Some((t, r)) = m.split_once('/') {
                        let _ = app.quota(t, r);
                    }
                }
                return;
            }
            Err(e) => {
                tracing::warn!(error = %e, "Redis not reachable at start; retrying");
                tokio::time::sleep(breaker::backoff(
                    attempt,
                    Duration::from_millis(50),
                    Duration::from_millis(500),
                ))
                .await;
            }
        }
    }
    app.region_fresh.store(true, Ordering::SeqCst);
}

/// Serves the agent on `listener` until `shutdown` resolves; then stops
/// accepting, finishes in-flight requests, stops the background tasks and
/// drains the outbox (bounded by a deadline).
pub async fn run(
    listener: TcpListener,
    app: AppState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    boot(&app).await;
    app.spawn(epoch::run(app.clone()));
    app.spawn(outbox::run(app.clone()));
    let served = axum::serve(listener, router(app.clone())).with_graceful_shutdown(shutdown).await;
    app.cancel.cancel();
    let tasks: Vec<_> = std::mem::take(&mut *app.tasks.lock().unwrap());
    for t in tasks {
        let _ = t.await;
    }
    let left = outbox::final_drain(&app, Duration::from_secs(5)).await;
    tracing::info!(outbox_left = left, "agent stopped");
    served
}

/// What the binary does: validate, connect, serve until a signal arrives.
pub async fn serve(config: config::Config) -> Result<(), String> {
    let settings = config.settings()?;
    let addr = config.listen;
    if !addr.ip().is_loopback() {
        tracing::warn!(%addr, "the agent API has no authentication; expose it only to the application");
    }
    if settings.agent_token.is_none() {
        tracing::warn!("QUOTA_AGENT_TOKEN not set: calling the allocator without a token");
    }
    let app = App::new(settings).await?;
    let listener = TcpListener::bind(addr).await.map_err(|e| format!("cannot listen on {addr}: {e}"))?;
    tracing::info!(addr = %listener.local_addr().map_err(|e| e.to_string())?, region = %app.settings.region,
        agent = %app.settings.agent, "agent listening");
    run(listener, app, shutdown_signal()).await.map_err(|e| format!("server failed: {e}"))
}

pub use quota_shared::telemetry::{init as init_tracing, shutdown_signal};
