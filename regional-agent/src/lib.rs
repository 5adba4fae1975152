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
//! * [`app`]: the state the handlers and tasks share (`App`); it knows no
//!   handler or task, and each takes the parts it uses. `App` owns every
//!   part as a shared handle; a handler's state is an axum sub-state
//!   (`FromRef<AppState>`: [`health::StatusView`], [`health::Readiness`]),
//!   a task's a named struct of the handles it uses ([`renew::Renewer`],
//!   [`outbox::OutboxParts`], [`epoch::Registrar`],
//!   [`status_report::Reporter`]). Only the acquire path takes the whole
//!   `App`: it uses every part and creates quotas, whose renewers join
//!   `App`'s task list. This root module wires them: the router, the
//!   tasks, start-up and shutdown.
//! * [`keys`]: the one audited key function (hash-tagged, length-prefixed):
//!   every Redis key name the Rust side uses, and the keys' TTL; a
//!   tenant's keys share one Cluster slot.
//! * [`legacy`]: the rolling upgrade from the per-quota key layout (the
//!   legacy gate on the fallback allowance, F34).
//! * [`scripts`]: the agent's Redis contract, the only place that knows each
//!   Lua script of `lua/*.lua` (KEYS and ARGV order, reply shape): typed
//!   calls `spend`, `view`, `credit`, `cut`, `fence`, `unlock`, each a span;
//!   a changed incarnation comes back as one `Lost` outcome.
//! * [`commands`]: every plain Redis command (request-id claims,
//!   heartbeats, adoption, outbox pages, dead letters, renew lock, policy
//!   cache, the store's health), typed, each a span; a test keeps
//!   `redis::cmd` out of the other modules, and `keys::suffix` holds the
//!   key suffixes the Lua scripts append (checked against them by a test).
//! * [`store`]: the Redis connection (single, cluster or through Sentinel),
//!   timeouts, the store's health for `/readyz`.
//! * [`sentinel`]: the primary found through Sentinel, looked up again
//!   after a failover.
//! * [`redis_tls`]: the certificates of `rediss://` links.
//! * [`guard`]: the eviction policy check (admit only from a `noeviction`
//!   Redis).
//! * [`gauges`]: per-quota mode and policy version, identity and clock
//!   offset, computed at each scrape of `/metrics`.
//! * [`client`], [`breaker`]: the allocator client with timeouts, capped
//!   exponential backoff with jitter and a circuit breaker.
//! * [`grant_batch`]: the renewers' grants, sent through the client and
//!   batched into one `POST /v1/grants` while another is on its way.
//! * [`release_batch`]: the outbox's lease releases of one round, sent in
//!   one `POST /v1/leases/release`.
//! * [`identity`]: the agent's epoch and grant sequence (I4, I3).
//! * [`epoch`]: registration and fences (I4).
//! * [`registry`]: the one place a quota is created and its renewer
//!   started; the request path asks it for a quota and decides with
//!   `app::Decider`, the part of the state a decision uses.
//! * [`quotas`]: what the agent knows per quota (policy and its cache in
//!   Redis, demand, incarnation; `Quota::settle`, the one handling of a
//!   changed incarnation).
//! * [`acquire`]: `POST /v1/acquire`: its body, validation and answer.
//! * [`request`]: the request model shared by HTTP and RLS (`Acquire`,
//!   `ResourceCost`, `Shadow`, `Paid`, `Decided`, `Refused`).
//! * [`spend`]: the decision (I5, I2, fallback, I6) over one quota or
//!   several of a tenant: learn the policies, check costs and keys, claim
//!   the request id, run the spend script and wait as [`step`] says.
//! * [`step`]: the pure rule of a request that found no token (sleep for
//!   a next-window lease, wait for a renewal, fallback, 429 or 503).
//! * [`request_id`]: the tenant-wide claim of a `request_id`.
//! * [`shed`]: shedding by priority (`503 shed`) when this agent's own
//!   decisions in flight or its store latency cross a line; the rule is
//!   pure, checked first in `spend::decide`.
//! * [`shadow`]: shadow mode (`enforce: false`): a refusal becomes an
//!   admit that debits nothing, counted for the report.
//! * [`headers`]: the `RateLimit` headers of the most restrictive limit.
//! * [`batch`]: concurrent decisions on one quota share one script run.
//! * [`spend_run`]: one run of the spend script for a batch, settled (each
//!   quota adopts the token the run saw, a loss is handled) before its
//!   answers go out; a decision goes down `spend` → `batch` → `spend_run` →
//!   `scripts` → `store` and never back up.
//! * [`renew`]: the background renewer (DESIGN §4), crediting (I5, I4).
//! * [`plan`]: the renewer's rule as pure arithmetic: whether to renew the
//!   current and the next window, and how many tokens to ask for.
//! * [`outbox`]: cutting and draining reports and releases (I7), adopting
//!   the outboxes of gone agents, refusals classified, dead letters.
//! * [`fallback`]: the opt-in local allowance while Redis is unreachable.
//! * [`health`]: `/v1/status`, `/healthz`, `/readyz`, `/metrics`.
//! * [`status_report`]: the status sent to the allocator's fleet pages,
//!   with [`fleet_counts`] (its 429/503 counts per quota and window).
//! * [`grpc_conn`]: the gRPC port's connections within the listener limits
//!   (the HTTP port's are in `quota_shared::listen`).
//! * [`rls`]: Envoy's rate limit service (gRPC RLS v3) and the gRPC health
//!   service, on `--grpc-listen`: descriptors decided as one acquire.
//! * [`error`]: the one error enum and its mapping to HTTP.
//!
//! Every request runs in a `request` span (method, route, status); an
//! acquire in an `acquire` span (tenant, resource, cost, outcome), a
//! renewal round in a `renew_once` span and an outbox round in `drain_all`
//! and `drain_list` spans (tenant, resource); each script round trip has a
//! `debug` span. With `--log-format json` every line lists its spans.
//!
//! # Behaviour where DESIGN is silent
//!
//! * **Learning a policy.** The agent learns `fail_mode`, the fallback
//!   allowance, the limit and the window length from grant answers and caches
//!   them in Redis (`pol`) for the other replicas and for restarts during a
//!   partition. The first acquire of a quota no replica knows waits for one
//!   grant; nothing is written to Redis for the quota before that grant
//!   succeeds. A 404 from the allocator becomes `404 unknown_quota`, the
//!   quota leaves the registry at once, and the name is kept in a negative
//!   cache (at most 4,096 names, 5 s each), so a flood of unknown names
//!   leaves no key, registry entry or task (F14). A quota never seen while
//!   the allocator is unreachable answers `503 allocator_unreachable`.
//! * **Priority reserves.** A policy's `reserve` keeps shares of each
//!   window for the important priorities: the spend script refuses a
//!   request of a less important priority (`429`, `limit: "reserve"`) once
//!   the region's balance plus what the window's pool still holds (the
//!   least a grant answer said, kept by `credit.lua`) would fall below the
//!   shares it may not take; its demand is not counted. The fallback
//!   allowance is not reserved.
//! * **Maximum policy age** (F24). A grant answer confirms its quota's
//!   policy; the instant is kept with the policy in Redis. While the
//!   allocator is unreachable and the policy is older than
//!   `--max-policy-age-secs` (default 3,600; 0: never), the policy's
//!   `on_stale` applies: `keep` (default) enforces the last version,
//!   `fail_mode` refuses with `503 policy_stale` (strict) or enforces the
//!   version with shadow mode off (bounded). See [`stale`].
//! * **Per-key limits.** A policy's `per_key` bucket (learnt from grants
//!   like the rest of the policy) is checked first, in the same run of the
//!   spend script as the quota: a key short of the cost is `429
//!   per_key_limited` (`limit: "per_key"`) and spends nothing of the quota
//!   nor counts as demand; a quota that refuses leaves the bucket as it
//!   was. Buckets hold integer micro-tokens refilled from Redis's `TIME`
//!   (one clock for the region's replicas) and expire when full again plus
//!   a minute. They are regional: each region enforces them on its own
//!   traffic. A request without `key` on such a quota is 422 (a gateway
//!   that forgets the user cannot bypass the cap); the local store
//!   fallback does not check them.
//! * **Several quotas in one decision.** `resources: [{resource, cost?}]`
//!   names up to 8 quotas of one tenant; one run of the spend script
//!   checks every named quota's per-key bucket, then every quota's balance
//!   or fallback, and debits all of them or none (F08, F18). The answer
//!   lists each quota; a refusal names the one that refused. Single-quota
//!   requests still share runs with their quota's concurrent requests
//!   ([`batch`]); a multi-quota request has a run of its own.
//! * **Shadow mode.** A policy with `enforce: false` makes every decision
//!   as an enforced one; a `429` it would answer becomes a `200` with
//!   `source: "shadow"`, `shadow_refused: true` and the `limit`, debiting
//!   nothing. `lua/shadow.lua` counts it per window for the outbox, whose
//!   reports carry `shadow_refused` (only when non-zero, so an allocator
//!   before shadow mode accepts every other report, and report entries
//!   keep the three-number form an older agent reads). In a multi-quota
//!   request, a shadow-mode quota that would refuse is left out of the
//!   decision and the others decided again.
//! * **Registry bounds.** Quotas idle for 5 minutes with an empty outbox
//!   and no live lease leave the registry and the agent's quota set; there
//!   is no fixed cap on known quotas (`agent_quotas` shows how many are
//!   held). At most 1,024 new names may be learning their policy at once;
//!   beyond that a new name answers `503 too_many_quotas` for that moment.
//! * **After the fallback allowance is spent** during a partition the agent
//!   answers `503 allocator_unreachable` (it cannot decide), not 429.
//! * **Request ids** are tied to their request, tenant-wide: a repeat
//!   with the same resource and cost is answered with the first decision,
//!   one naming another resource or cost is `409 request_id_mismatch`. Both
//!   the claim and the decision are remembered until the end of the window
//!   the request was decided in plus 10 s; only admits are remembered, so a
//!   retried refusal is decided anew (and may change its cost).
//! * **Reachability**: the allocator counts as unreachable from the first
//!   failed call (timeout, refused connection, 5xx) until a call succeeds;
//!   the breaker opens after two consecutive failures, for at most 500 ms
//!   between single probes, and a renewer's backoff taken while the
//!   allocator was unreachable ends when any call succeeds, so a region heals
//!   within a second. A request that finds no token waits for the renewer
//!   within one budget (`--acquire-wait-ms` + `--allocator-timeout-ms` +
//!   100 ms); it is answered 429 only when the allocator said the pool is
//!   empty, and 503 when no lease came within the budget.
//! * **Redis data loss** is detected per quota, inside every script, by
//!   the quota's incarnation key. An agent that starts while the region's
//!   incarnation key is missing cannot tell a new region from one that lost
//!   its data while no agent ran; it treats the current window's fallback of
//!   each quota it first touches as spent (the safe side).
//! * **Redis going back in time** (a restart from an older snapshot or AOF,
//!   a failover to a replica that missed writes, evicted keys: seed 002
//!   F10, F15, F33) is detected inside every script too, before anything is
//!   decided on the old state: each quota keeps the stamp of the server it
//!   last ran on (`run_id`, which changes at every restart and differs on a
//!   promoted replica, and `evicted_keys`, read with `INFO` inside the
//!   script). A different stamp strands the quota's live leases (neither
//!   spent nor released: their `spent` may be older than the truth), drops
//!   its unreported counters (they may have been reported since the
//!   snapshot: the ledger may under-count, never count twice), counts the
//!   open window's fallback allowance as spent, and installs a new
//!   incarnation, so every replica re-registers on its next call. A Redis
//!   that restarts with everything intact costs the same (stranded tokens);
//!   `agent_redis_rollbacks_total` counts the events.
//! * **One clock for fallback windows** (I8): the window a fallback admit
//!   counts in comes from the region's Redis clock (`TIME`) corrected by the
//!   offset to the allocator's clock that each credited grant measures
//!   (`clk`), never from an agent's own wall clock, so replicas with skewed
//!   clocks share one fallback counter per real window. The opt-in local
//!   fallback (Redis down) uses the allocator's clock extrapolated with the
//!   monotonic clock from its last answer.
//! * **Key lifecycle** (F04): every key of a quota has a TTL that fits its
//!   purpose (leases: their life; `fb:` counters: their window plus a
//!   minute; fences: two days, longer than any lease; counters and books:
//!   a week), refreshed while an agent holds the quota; an agent's quota
//!   set expires a week after the agent was last seen. Only the region's
//!   incarnation key and outbox lists with undelivered entries have none.
//! * **Outbox entries** belong to the region: an agent whose liveness key
//!   expired (10 s after its last round) is adopted by a live replica,
//!   which sends its reports under its own identity and its releases under
//!   the gone agent's (registering for it). Only refusals that can never
//!   change take an entry out unapplied; those go to the region's
//!   dead-letter list (`/v1/status` `dead_letters`, at most 1,000 kept).
//! * **Shutdown** is bounded: after SIGTERM in-flight requests get 2 s,
//!   background tasks 1 s and the final outbox drain 3 s; a second signal
//!   exits at once.
//! * **Time**: a lease is spendable from `nb` (its window start, measured
//!   from the instant the answer arrived) until its deadline (measured from
//!   the instant the request was sent); both are relative Redis TTLs, so no
//!   two hosts' clocks are ever compared (I2). A request arriving in the few
//!   milliseconds between the two waits for the next window's lease.
//! * **Eviction policy**: the agent admits only while the region's Redis
//!   reports `maxmemory-policy noeviction` (any other policy may drop a
//!   counter or fence and let a token be spent twice). It reads the policy
//!   before serving, every `--redis-policy-check-ms` (5 s), and at once
//!   after a Sentinel failover; until the first successful read it does not
//!   admit. Otherwise `POST /v1/acquire` answers `503 store_unavailable`
//!   and `/readyz` 503, both with a message naming the policy and the fix,
//!   logged once per change. A failed read keeps the last verdict.
//! * **Sentinel**: with `--redis-sentinel` and `--redis-master` the agent
//!   asks the Sentinels for the primary and asks again after a connection
//!   error, a timeout or a `READONLY`/`MASTERDOWN` answer; one lookup at a
//!   time, at most one per 100 ms after a failure, each within the Redis
//!   timeout. A call is not retried on the new primary (its outcome on the
//!   old one is unknown); the request answers 503 and the next one reaches
//!   the new primary. What the promoted replica had not received is a
//!   rollback, detected by the spend script.
//! * **Status for operators**: every `--status-interval-ms` (2 s) the agent
//!   sends the allocator its epoch, reachability, outbox depth, dead letters
//!   and per quota its mode and 429/503 answers of the open window
//!   (`PUT /v1/agents/{region}/{agent}/status`, see [`status_report`]),
//!   around the circuit breaker, so this call never changes how it admits.
//! * The agent's own endpoints have no authentication (it is a sidecar);
//!   it warns when listening on a non-loopback address.
//! * **Listener limits** (both ports): a header read timeout, an idle
//!   timeout and a connection bound each (`--header-read-timeout-secs`,
//!   `--idle-timeout-secs`, `--max-connections`, `--grpc-max-connections`,
//!   `--grpc-max-streams-per-connection`; the gRPC port is served by
//!   `--grpc-threads` single-threaded runtimes, see [`rls::serve`]), fitted at start under the
//!   open-file limit, which is raised to the hard limit. At the HTTP bound
//!   the longest-idle connection is evicted, and a reserved share serves
//!   only probes while every connection is busy, so `/healthz` and
//!   `/readyz` stay answerable (`quota_shared::listen`, docs/deploying.md
//!   "Listener limits").

// The acquire future nests the request-id claim, the spend run and the
// store's bounded call, each with a debug span (`commands`, `scripts`);
// computing its layout takes more than the default 128 query levels.
#![recursion_limit = "256"]

pub mod acquire;
pub mod app;
pub mod batch;
pub mod breaker;
pub mod client;
pub mod commands;
pub mod config;
pub mod epoch;
pub mod error;
pub mod fallback;
pub mod fleet_counts;
pub mod gauges;
pub mod grant_batch;
pub mod grpc_conn;
pub mod guard;
pub mod headers;
pub mod health;
pub mod identity;
pub mod keys;
pub mod legacy;
pub mod negative;
pub mod outbox;
pub mod permit_routes;
pub mod permits;
pub mod plan;
pub mod quotas;
pub mod redis_tls;
pub mod registry;
pub mod release_batch;
pub mod renew;
pub mod request;
pub mod request_id;
pub mod rls;
pub mod scripts;
pub mod sentinel;
pub mod shadow;
pub mod shed;
pub mod spend;
pub mod spend_run;
pub mod stale;
pub mod status_report;
pub mod step;
pub mod store;

pub use crate::app::{App, AppState};
use crate::epoch::Registrar;
use crate::outbox::{OutboxParts, Outboxes};
use crate::status_report::Reporter;
use axum::extract::{DefaultBodyLimit, MatchedPath, Request};
use axum::response::Response;
use axum::Router;
use quota_shared::listen::{nofile, ListenerMetrics};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// Largest acquire body accepted.
pub const MAX_BODY_BYTES: usize = 64 * 1024;

/// Declares the agent's metric families (and starts its label-less
/// counters at 0) before anything is counted.
pub fn describe_metrics(m: &quota_shared::prom::Registry) {
    health::describe(m);
    guard::describe(m);
    gauges::describe(m);
    status_report::describe(m);
    rls::describe(m);
    permits::describe(m);
    ListenerMetrics::describe(m, app::LISTENER_OPEN, app::LISTENER_CLOSED, &["http", "grpc"]);
}

/// The agent's router; every request runs in a span (method, route, status).
pub fn router(app: AppState) -> Router {
    let trace = tower_http::trace::TraceLayer::new_for_http()
        .make_span_with(request_span)
        .on_response(|res: &Response, latency: Duration, span: &tracing::Span| {
            span.record("status", res.status().as_u16());
            tracing::debug!(latency_ms = latency.as_millis() as u64, "answered");
        })
        // A 503 is an answer the agent chose (partition, store down), not
        // a failure to log at error level once per request.
        .on_failure(());
    Router::new()
        .merge(acquire::router())
        .merge(permit_routes::router())
        .merge(health::router())
        .fallback(|req: Request| async move { error::Error::NoRoute(req.uri().path().to_string()) })
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(trace)
        .with_state(app)
}

/// The span of one request: its method, its route (the matched path, so a
/// span's fields are bounded by the routes, whatever the URI) and, once
/// answered, its status.
fn request_span(req: &Request) -> tracing::Span {
    let route = req.extensions().get::<MatchedPath>().map(MatchedPath::as_str).unwrap_or("unmatched");
    tracing::info_span!("request", method = %req.method(), route, status = tracing::field::Empty)
}

/// Finds out whether the region's Redis is new (or lost its data) and loads
/// the quotas this agent touched before a restart, so their outboxes drain
/// and their old leases are retired.
async fn boot(app: &AppState) {
    let inc_key = app.keys.region_incarnation(&app.settings.region);
    let token = uuid::Uuid::new_v4().simple().to_string();
    for attempt in 0..10u32 {
        match commands::claim_region_incarnation(&app.store, &inc_key, &token).await {
            Ok(missing) => {
                if missing {
                    tracing::warn!(region = %app.settings.region, "region incarnation key was missing: new region or Redis data loss");
                    app.registry.mark_region_fresh();
                }
                let mine = app.keys.agent_quotas(&app.settings.region, &app.settings.agent);
                let members = commands::members(&app.store, &mine).await.unwrap_or_default();
                for m in members {
                    if let Some((t, r)) = m.split_once('/') {
                        // No request has used it in this process yet: idle
                        // (looked at once a second), or thousands of reloaded
                        // quotas would each run a view every 50 ms.
                        if let Some(q) = app.registry.quota_of(t, r, true) {
                            // Its cached policy, so it does not count as
                            // learning (that would hold new names back).
                            let _ = q.load_policy(&app.store).await;
                            if let Some(t) = std::time::Instant::now().checked_sub(renew::IDLE_AFTER * 2) {
                                *q.last_used.lock().unwrap() = t;
                            }
                        }
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
    app.registry.mark_region_fresh();
}

/// How long in-flight requests may run after a shutdown signal.
pub const SHUTDOWN_REQUESTS: Duration = Duration::from_secs(2);
/// How long background tasks may take to stop.
pub const SHUTDOWN_TASKS: Duration = Duration::from_secs(1);
/// How long the final outbox drain may take.
pub const SHUTDOWN_DRAIN: Duration = Duration::from_secs(3);

/// Serves the agent on `listener` until `shutdown` resolves; then stops
/// accepting, finishes in-flight requests, stops the background tasks and
/// drains the outbox, each step with its own deadline, so the whole stop
/// takes at most [`SHUTDOWN_REQUESTS`] + [`SHUTDOWN_TASKS`] +
/// [`SHUTDOWN_DRAIN`] (6 s) whatever state Redis and the allocator are in
/// and however many quotas are known. What the drain could not send stays
/// in Redis: the agent's next start, or the region's other replicas once
/// its liveness key expires, send it.
pub async fn run(
    listener: TcpListener,
    grpc: Option<TcpListener>,
    app: AppState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let outbox = start_tasks(&app).await;
    let servers = Servers::start(&app, listener, grpc);
    let grpc_exit = servers.grpc_exit.clone();
    // The phases of a stop, each with its own deadline: requests, then the
    // background tasks, then the last outbox drain.
    let served = servers.stop_after(shutdown).await;
    stop_tasks(&app).await;
    final_drain(&outbox).await;
    // Only now: a spend run or a Redis connection an RLS call started runs
    // on a gRPC thread, and the drain may still have needed it.
    grpc_exit.cancel();
    match served {
        Ok(r) => r,
        Err(e) if e.is_cancelled() => Ok(()),
        Err(e) => Err(std::io::Error::other(format!("server task failed: {e}"))),
    }
}

/// The outbox's parts kept past the tasks for the final drain.
struct OutboxKeep {
    parts: OutboxParts,
    outboxes: Arc<Outboxes>,
}

/// Start-up before serving, then every background task: the boot look at
/// Redis, the eviction policy, the heartbeat and the legacy gate (so the
/// first request is decided on them), then the tasks of `app`'s task list.
async fn start_tasks(app: &AppState) -> OutboxKeep {
    // Every quota's renewer is a task of the app's list (the shutdown
    // stops it); installed before the boot reloads the agent's quotas.
    let (renewer, tasks, rt) = (renew::Renewer::of(app), app.tasks(), app.runtime().clone());
    app.registry.on_create(move |q| {
        app::keep_task(&mut tasks.lock().unwrap(), rt.spawn(renew::run(renewer.clone(), q)));
    });
    boot(app).await;
    // Read the eviction policy before serving, so a correctly configured
    // Redis admits from the first request (see `guard`).
    guard::check(&app.store, &app.guard, &app.metrics).await;
    // Each task gets handles on the parts it uses; `app` keeps owning them.
    let parts = OutboxParts::of(app);
    outbox::heartbeat(&parts).await;
    // The legacy gate before the first request (no fallback until looked).
    let live_ttl = outbox::live_ttl(app.settings.outbox_interval).as_millis() as i64;
    let (region, me) = (app.settings.region.clone(), app.settings.agent.clone());
    legacy::look(&app.store, &app.keys, &region, &me, live_ttl, &app.legacy).await;
    app.spawn(legacy::run(
        app.store.clone(),
        app.keys.clone(),
        region,
        me,
        live_ttl,
        app.legacy.clone(),
        app.cancel.clone(),
    ));
    // The outbox's own state (adopted identities, retries), shared by its
    // task and the final drain.
    let outboxes = Arc::new(Outboxes::default());
    app.spawn({
        let (store, guard, metrics, cancel) =
            (app.store.clone(), app.guard.clone(), app.metrics.clone(), app.cancel.clone());
        let every = app.settings.redis_policy_check;
        async move { guard::run(&store, &guard, &metrics, every, &cancel).await }
    });
    app.spawn(epoch::run(Registrar::of(app)));
    app.spawn(permits::lease::run(app.permits.clone(), app.cancel.clone()));
    app.spawn(outbox::run(parts.clone(), outboxes.clone()));
    if let Some(every) = app.settings.status_interval {
        app.spawn(status_report::run(Reporter::of(app), every));
    }
    OutboxKeep { parts, outboxes }
}

/// The HTTP server and, with `--grpc-listen`, Envoy's rate limit service.
struct Servers {
    http: JoinHandle<std::io::Result<()>>,
    http_stop: tokio::sync::oneshot::Sender<()>,
    grpc: Option<JoinHandle<()>>,
    grpc_stop: tokio_util::sync::CancellationToken,
    /// Ends the gRPC threads once the agent has stopped (see [`rls::serve`]).
    grpc_exit: tokio_util::sync::CancellationToken,
}

impl Servers {
    fn start(app: &AppState, listener: TcpListener, grpc: Option<TcpListener>) -> Servers {
        let grpc_stop = tokio_util::sync::CancellationToken::new();
        let grpc_exit = tokio_util::sync::CancellationToken::new();
        let grpc = grpc.map(|l| {
            let mapping = app.settings.rls.clone();
            tokio::spawn(rls::serve(app.clone(), mapping, l, grpc_stop.clone(), grpc_exit.clone()))
        });
        let (http_stop, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let routes = router(app.clone());
        let plain = move |tcp, _| std::future::ready(Some((tcp, routes.clone())));
        let http = tokio::spawn(quota_shared::listen::http::serve(
            listener,
            app.settings.http_limits,
            app.listener_metrics("http"),
            plain,
            async move {
                let _ = stop_rx.await;
            },
        ));
        Servers { http, http_stop, grpc, grpc_stop, grpc_exit }
    }

    /// Serves until `shutdown` (or until the HTTP server ends by itself),
    /// then stops both servers: in-flight HTTP and gRPC calls share one
    /// deadline, [`SHUTDOWN_REQUESTS`] from the signal.
    async fn stop_after(
        mut self,
        shutdown: impl Future<Output = ()>,
    ) -> Result<std::io::Result<()>, tokio::task::JoinError> {
        let mut deadline = None;
        let served = tokio::select! {
            r = &mut self.http => r,
            _ = shutdown => {
                let at = *deadline.insert(tokio::time::Instant::now() + SHUTDOWN_REQUESTS);
                let _ = self.http_stop.send(());
                self.grpc_stop.cancel();
                match tokio::time::timeout_at(at, &mut self.http).await {
                    Ok(r) => r,
                    Err(_) => {
                        tracing::warn!(deadline_ms = SHUTDOWN_REQUESTS.as_millis() as u64,
                            "in-flight requests cut at the shutdown deadline");
                        self.http.abort();
                        Ok(Ok(()))
                    }
                }
            }
        };
        self.grpc_stop.cancel();
        if let Some(mut g) = self.grpc {
            // The same deadline as the HTTP server's: both stop in parallel.
            let at = deadline.unwrap_or_else(|| tokio::time::Instant::now() + SHUTDOWN_REQUESTS);
            if tokio::time::timeout_at(at, &mut g).await.is_err() {
                tracing::warn!("in-flight gRPC calls cut at the shutdown deadline");
                g.abort();
            }
        }
        served
    }
}

/// Cancels the background tasks and waits for them, at most
/// [`SHUTDOWN_TASKS`]; what is still running then is aborted.
async fn stop_tasks(app: &AppState) {
    app.cancel.cancel();
    let tasks = app.take_tasks();
    let aborts: Vec<_> = tasks.iter().map(|t| t.abort_handle()).collect();
    if tokio::time::timeout(SHUTDOWN_TASKS, futures_join_all(tasks)).await.is_err() {
        tracing::warn!("background tasks cut at the shutdown deadline");
        for a in aborts {
            a.abort();
        }
    }
}

/// Sends what the outboxes hold, at most [`SHUTDOWN_DRAIN`]; the rest
/// stays in Redis for the next start or the region's replicas.
async fn final_drain(keep: &OutboxKeep) {
    let left = tokio::time::timeout(
        SHUTDOWN_DRAIN,
        outbox::final_drain(&keep.parts, &keep.outboxes, SHUTDOWN_DRAIN),
    )
    .await
    .unwrap_or(-1);
    if left == 0 {
        tracing::info!("agent stopped; outbox drained");
    } else {
        tracing::warn!(outbox_left = left, "agent stopped; entries left in Redis are sent by the next start or the region's replicas (-1: not counted)");
    }
}

/// Raises the open-file limit to the hard limit and lowers the connection
/// bounds (HTTP, and gRPC when served) to fit under it.
fn fit_open_files(settings: &mut config::Settings) {
    let Some(n) = nofile::raise_and_log() else { return };
    let grpc = settings.grpc_listen.is_some();
    let mut bounds = vec![settings.http_limits.max_connections];
    if grpc {
        bounds.push(settings.grpc_limits.max_connections);
    }
    if nofile::fit(&mut bounds, n.soft) {
        tracing::warn!(
            soft = n.soft,
            max_connections = bounds[0],
            grpc_max_connections = bounds.get(1).copied(),
            "connection bounds lowered to fit the open-file limit"
        );
    }
    settings.http_limits.max_connections = bounds[0];
    if grpc {
        settings.grpc_limits.max_connections = bounds[1];
    }
}

/// Awaits every task (no extra dependency for `join_all`).
async fn futures_join_all(tasks: Vec<JoinHandle<()>>) {
    for t in tasks {
        let _ = t.await;
    }
}

/// What the binary does: validate, connect, serve until a signal arrives.
pub async fn serve(config: config::Config) -> Result<(), String> {
    let mut settings = config.settings()?;
    error::set_retry_after_jitter(config.retry_after_jitter);
    fit_open_files(&mut settings);
    let addr = config.listen;
    if !addr.ip().is_loopback() {
        tracing::warn!(%addr, "the agent API has no authentication; expose it only to the application");
    }
    if settings.agent_token.is_none() {
        tracing::warn!("QUOTA_AGENT_TOKEN not set: calling the allocator without a token");
    }
    let app = App::new(settings).await?;
    describe_metrics(&app.metrics);
    let listener = quota_shared::listen::bind(addr).map_err(|e| format!("cannot listen on {addr}: {e}"))?;
    let grpc = match app.settings.grpc_listen {
        Some(g) => {
            let l = quota_shared::listen::bind(g)
                .map_err(|e| format!("cannot listen on {g} (--grpc-listen): {e}"))?;
            tracing::info!(addr = %l.local_addr().map_err(|e| e.to_string())?, "Envoy rate limit service (gRPC) listening");
            Some(l)
        }
        None => None,
    };
    tracing::info!(addr = %listener.local_addr().map_err(|e| e.to_string())?, region = %app.settings.region,
        agent = %app.settings.agent, "agent listening");
    let signal = async {
        shutdown_signal().await;
        // From here a second signal ends the process at once.
        tokio::spawn(async {
            shutdown_signal().await;
            eprintln!("regional-agent: second signal, exiting at once");
            std::process::exit(1);
        });
    };
    run(listener, grpc, app, signal).await.map_err(|e| format!("server failed: {e}"))
}

pub use quota_shared::telemetry::{init as init_tracing, shutdown_signal};
