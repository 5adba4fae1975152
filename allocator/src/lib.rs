//! The central allocator (DESIGN §1–§5).
//!
//! It owns each quota's global pool per UTC window in PostgreSQL and hands
//! out leases: idempotent (I3), epoch-fenced (I4) and clamped to the window
//! end (I2), never more than the pool holds (I1).
//!
//! # Layout
//!
//! The modules stand in layers: each imports only modules below it (and the
//! crate's [`error`] type, which every layer uses), so no import runs back
//! up and none closes a circle. From the top:
//!
//! * this root: [`connect`], [`run`] and [`serve`]; it builds the pieces of
//!   the state ([`registry`], the tokens) and the state itself
//!   ([`AppState::new`]).
//! * [`routes`]: the route table: which path goes to which handler, the
//!   auth class of each route, and the layers every request passes.
//! * the handlers and what they read:
//!   * [`openapi`]: the OpenAPI document generated from the handlers.
//!   * [`health`]: liveness, readiness and metrics endpoints.
//!   * [`ui`]: the read-only HTML dashboard with SVG charts.
//!   * [`window_metrics`]: the open and previous windows of the busiest
//!     quotas as gauges for alerts (bounded cardinality).
//!   * [`explain`]: why admission looked the way it did for a region;
//!     `load` reads one snapshot in one transaction, `assemble` builds the
//!     answer from it without I/O.
//!   * [`grants`]: the grant transaction (I1, I2, I3, I4).
//!   * [`quota_gate`]: at most a few grant statements of a quota in
//!     flight from a replica (a hot quota queues here, not on its row lock).
//!   * [`leases`]: releases and lease reads.
//!   * [`permits`]: permit leases of concurrency quotas (a global
//!     semaphore) and their view.
//!   * [`reports`]: consumption and fallback reports, exactly once (I7).
//!   * [`windows`]: per-window accounting with the overshoot bound (I6).
//!   * [`fleet`]: each agent's latest self-reported status (for `/ui`).
//!   * [`policies`]: versioned policies; changes apply to open windows (I9).
//!   * [`agents`]: registration and epochs (I4).
//!   * [`ledger`]: the append-only event log.
//! * [`state`]: [`AppState`], the state every handler shares, made of the
//!   pieces the root passes in.
//! * [`config`]: command-line flags and environment variables.
//! * [`retention`]: the background deletion of everything beyond a horizon.
//! * [`tls`]: HTTPS served by the allocator, certificates reloaded live.
//! * [`time`]: the one clock for windows, the database's (I8, DESIGN §6).
//! * [`http`]: plumbing only, knowing no handler and no state: extractors
//!   with the allocator's rejections, bearer-token and region checks, the
//!   request metrics middleware and the request span.
//! * [`share`]: the demand-weighted share arithmetic (DESIGN §4).
//! * [`tx`]: the one way a transaction begins.
//! * [`reload`]: noticing changed configuration files (TLS, agent tokens).
//! * [`telemetry`]: logging set-up and the shutdown signal.
//! * [`error`]: the one error enum and its mapping to status and JSON.
//!
//! # SQL
//!
//! Every statement is a file of its own in `allocator/src/sql/`, run with
//! sqlx's `query_file!`, `query_file_as!` or `query_file_scalar!`: its
//! parameter and column types (and which columns may be null, where the
//! file overrides that with `"column!"`) are checked at compile time. The
//! check reads the committed `.sqlx/` cache at the workspace root, never a
//! live database (`SQLX_OFFLINE` in `.cargo/config.toml`); `.ci/sqlx-cache`
//! rewrites the cache from a throwaway PostgreSQL with `migrations/`
//! applied after a query or a migration changed, and `.ci/run` fails when
//! a query and the cache disagree. Named constraints are mapped to errors
//! at the statement that can violate them ([`error::on_constraint`]).
//!
//! # Spans
//!
//! Each request runs in an `http` span (route template, status); the grant
//! transaction, a report's apply, a release and a policy write open spans
//! with their keys (tenant, resource, region, lease id, ...), and database
//! round trips open `debug` ones inside them, so `--log-format json` lines
//! name what they were about.

pub mod agents;
pub mod config;
pub mod error;
pub mod explain;
pub mod fleet;
pub mod grants;
pub mod health;
pub mod http;
pub mod leases;
pub mod ledger;
pub mod openapi;
pub mod permits;
pub mod policies;
pub mod quota_gate;
pub mod reload;
pub mod reports;
pub mod retention;
pub mod rollout;
pub mod routes;
pub mod share;
pub mod state;
pub mod telemetry;
pub mod time;
pub mod tls;
pub mod tx;
pub mod ui;
pub mod window_metrics;
pub mod windows;

use quota_shared::clock::OffsetClock;
use quota_shared::listen::{nofile, Limits};
use quota_shared::prom::Registry;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::PgPool;
use std::future::Future;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;

pub use error::{Error, Result};

/// Migrations embedded from the workspace's `migrations/` folder.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../migrations");

pub use retention::DEFAULT_RETENTION_HOURS;
pub use state::AppState;

/// The metrics registry with every family described by its owner: the
/// request and listener families (`http::metrics`), the window gauges
/// ([`window_metrics`]), and the grant, release and pool families recorded
/// by the handlers.
pub fn registry() -> Registry {
    let r = Registry::default();
    http::metrics::describe(&r);
    r.describe("allocator_grants_total", "counter", "Grant requests by outcome");
    r.describe("allocator_granted_tokens_total", "counter", "Tokens put into leases");
    r.describe("allocator_released_tokens_total", "counter", "Unspent tokens returned to open pools");
    r.describe(
        "allocator_grant_seconds",
        "histogram",
        "Grant handling latency, including retries of a raced key",
    );
    r.describe("allocator_grant_batches_total", "counter", "Grant requests in the batch form (items)");
    r.describe("allocator_grant_batch_items_total", "counter", "Items of grant requests in the batch form");
    r.describe("allocator_release_batches_total", "counter", "Release requests in the batch form (items)");
    r.describe(
        "allocator_release_batch_items_total",
        "counter",
        "Items of release requests in the batch form",
    );
    r.describe(
        "allocator_rollouts_total",
        "counter",
        "Staged policy rollouts by outcome (started, promoted, halted, superseded)",
    );
    // From 0, so the first halt is an increase an alert can see.
    for outcome in ["started", "promoted", "halted", "superseded"] {
        r.inc_by("allocator_rollouts_total", &[("outcome", outcome)], 0.0);
    }
    r.describe(
        "allocator_permit_leases_total",
        "counter",
        "Permit lease requests by outcome (applied, conflict, or the error code)",
    );
    r.describe("allocator_db_connections", "gauge", "PostgreSQL pool connections by state (open, idle)");
    window_metrics::describe(&r);
    r
}

/// The root builds the state: it is the one module that stands above every
/// piece (the registry's families come from the handlers' modules too).
impl AppState {
    /// State over an existing pool with the system clock and no tokens.
    pub fn new(db: PgPool) -> Self {
        AppState::from_parts(
            db,
            Arc::new(registry()),
            window_metrics::DEFAULT_QUOTAS,
            http::auth::Tokens::default(),
        )
    }
}

/// Longest a request waits for a pool connection (and a grant for its
/// place at its quota's gate, see [`quota_gate`]) before it is answered
/// `503 database_unavailable`, which agents retry with the same keys.
pub const DB_ACQUIRE_TIMEOUT: Duration = Duration::from_secs(3);

/// Connects to PostgreSQL with bounded timeouts and applies the migrations.
///
/// Every statement gets a server-side timeout so a stuck lock cannot hold a
/// request (and its pool connection) forever.
pub async fn connect(database_url: &str, max_connections: u32) -> Result<PgPool, String> {
    let options = PgConnectOptions::from_str(database_url)
        .map_err(|e| format!("DATABASE_URL is not a valid PostgreSQL URL: {e}"))?
        .options([("statement_timeout", "5000"), ("lock_timeout", "4000")]);
    let pool = PgPoolOptions::new()
        .max_connections(max_connections)
        .acquire_timeout(DB_ACQUIRE_TIMEOUT)
        // After a failover error, connections opened before it may still
        // lead to the old primary: closed here rather than each failing a
        // request of its own (see crate::tx).
        .before_acquire(|_conn, meta| Box::pin(async move { Ok(!tx::opened_before_failover(meta.age)) }))
        .connect_with(options)
        .await
        .map_err(|e| format!("cannot connect to PostgreSQL: {e}"))?;
    MIGRATOR.run(&pool).await.map_err(|e| format!("cannot apply migrations: {e}"))?;
    Ok(pool)
}

/// Serves the allocator API over plain HTTP on `listener` until `shutdown`
/// resolves, then stops accepting and finishes in-flight requests.
pub async fn run(
    listener: TcpListener,
    state: AppState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    run_with_tls(listener, state, None, shutdown).await
}

/// [`run`], over TLS when `tls` is given, with the default listener limits.
pub async fn run_with_tls(
    listener: TcpListener,
    state: AppState,
    tls: Option<Arc<tls::ServerTls>>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    run_listening(listener, state, tls, Limits::default(), shutdown).await
}

/// [`run_with_tls`] within `limits` (header read and idle timeouts,
/// connection bound; see `quota_shared::listen`). While serving, changed
/// TLS files and a changed agent tokens file are reloaded (polled every
/// second, and at once on SIGHUP), and the rollout watcher runs
/// ([`rollout::watch`]).
pub async fn run_listening(
    listener: TcpListener,
    state: AppState,
    tls: Option<Arc<tls::ServerTls>>,
    limits: Limits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let reloader = tokio::spawn(reload_files(state.auth.regions.clone(), tls.clone()));
    let watcher = tokio::spawn(rollout::watch(state.clone()));
    let metrics = http::metrics::listener(&state.metrics);
    let router = routes::router(state);
    let served = match tls {
        None => {
            let plain = move |tcp, _| std::future::ready(Some((tcp, router.clone())));
            quota_shared::listen::http::serve(listener, limits, metrics, plain, shutdown).await
        }
        Some(tls) => tls::serve(listener, router, tls, limits, metrics, shutdown).await,
    };
    reloader.abort();
    watcher.abort();
    served
}

/// The reload loop: poll the watched files, or reload them all on SIGHUP.
async fn reload_files(
    tokens: Option<Arc<http::agent_tokens::AgentTokens>>,
    tls: Option<Arc<tls::ServerTls>>,
) {
    if tokens.is_none() && tls.is_none() {
        return;
    }
    let mut hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
        .map_err(|e| tracing::warn!(error = %e, "cannot listen for SIGHUP; reloading on file changes only"))
        .ok();
    let mut tick = tokio::time::interval(reload::POLL_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let force = tokio::select! {
            _ = tick.tick() => false,
            Some(()) = async { match hup.as_mut() { Some(h) => h.recv().await, None => std::future::pending().await } } => {
                tracing::info!("SIGHUP: reloading TLS and agent tokens files");
                true
            }
        };
        if let Some(t) = &tls {
            t.reload_if_changed(force);
        }
        if let Some(t) = &tokens {
            t.reload_if_changed(force);
        }
    }
}

/// What the binary does: validate the configuration, connect, serve until a
/// signal arrives, then stop within `--shutdown-timeout-secs`.
///
/// Shutdown is bounded whatever state PostgreSQL is in: the first signal
/// stops accepting, stops the retention job and lets in-flight requests
/// finish; requests still running at the deadline (a paused database does
/// not even let its own statement timeout fire) are cut by returning, which
/// drops their tasks and connections. A second signal exits at once.
pub async fn serve(config: config::Config) -> Result<(), String> {
    let database_url = config.database_url.clone().ok_or_else(|| {
        "DATABASE_URL is not set: pass --database-url postgres://USER@HOST/DB or set DATABASE_URL".to_string()
    })?;
    let regions = match config.agent_tokens_file() {
        Some(p) => Some(http::agent_tokens::AgentTokens::load(&p)?),
        None => None,
    };
    let tokens = http::auth::Tokens { agent: config.agent_token(), admin: config.admin_token(), regions };
    let tls = match config.tls_files()? {
        Some(files) => Some(tls::ServerTls::load(files)?),
        None => None,
    };
    let addr = config.listen;
    if !addr.ip().is_loopback() && (!tokens.agent_configured() || tokens.admin.is_none()) {
        return Err(format!(
            "refusing to listen on {addr} without agent credentials (QUOTA_AGENT_TOKEN or \
             QUOTA_AGENT_TOKENS_FILE) and QUOTA_ADMIN_TOKEN; set them or listen on a loopback address"
        ));
    }
    if !tokens.agent_configured() || tokens.admin.is_none() {
        tracing::warn!(%addr, "auth tokens not configured: routes without a token are open, loopback only");
    }
    let mut limits = config.limits()?;
    if let Some(n) = nofile::raise_and_log() {
        let mut bound = [limits.max_connections];
        if nofile::fit(&mut bound, n.soft) {
            tracing::warn!(
                soft = n.soft,
                max_connections = bound[0],
                "--max-connections lowered to fit the open-file limit"
            );
        }
        limits.max_connections = bound[0];
    }
    let db = connect(&database_url, config.db_max_connections).await?;
    let listener = quota_shared::listen::bind(addr).map_err(|e| format!("cannot listen on {addr}: {e}"))?;
    let mut state = AppState::new(db);
    state.auth = tokens;
    state.window_metrics_quotas = i64::from(config.window_metrics_quotas);
    state.report_horizon = (config.retention_hours > 0).then(|| retention::hours(config.retention_hours));
    if config.test_clock_offset_ms != 0 {
        tracing::warn!(
            offset_ms = config.test_clock_offset_ms,
            "test flag: this replica's own clock is shifted"
        );
        state.clock = Arc::new(OffsetClock::new(chrono::Duration::milliseconds(config.test_clock_offset_ms)));
    }
    let sweeper = retention::Retention::from_hours(
        config.retention_hours,
        config.window_retention_hours,
        config.retention_batch,
    )
    .map(|cfg| tokio::spawn(retention::run(state.db.clone(), state.db_clock.clone(), cfg)));
    tracing::info!(addr = %listener.local_addr().map_err(|e| e.to_string())?, tls = tls.is_some(),
        mtls = config.tls_client_ca.is_some(), "allocator listening");

    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let mut server = tokio::spawn(run_listening(listener, state.clone(), tls, limits, async move {
        let _ = stop_rx.await;
    }));
    let deadline = Duration::from_secs(config.shutdown_timeout_secs);
    let served = tokio::select! {
        r = &mut server => r,
        _ = telemetry::shutdown_signal() => {
            let _ = stop_tx.send(());
            if let Some(s) = &sweeper {
                s.abort();
            }
            // From here a second signal ends the process at once.
            tokio::spawn(async {
                telemetry::shutdown_signal().await;
                eprintln!("allocator: second signal, exiting at once");
                std::process::exit(1);
            });
            match tokio::time::timeout(deadline, &mut server).await {
                Ok(r) => r,
                Err(_) => {
                    tracing::warn!(deadline_secs = deadline.as_secs(), "in-flight requests cut at the shutdown deadline");
                    server.abort();
                    Ok(Ok(()))
                }
            }
        }
    };
    if let Some(s) = sweeper {
        s.abort();
    }
    match served {
        Ok(r) => r.map_err(|e| format!("server failed: {e}"))?,
        Err(e) if e.is_cancelled() => {}
        Err(e) => return Err(format!("server task failed: {e}")),
    }
    // Closing the pool waits for connections in use; a paused database would
    // hold it, so it is bounded too (the process exits right after).
    let _ = tokio::time::timeout(Duration::from_secs(1), state.db.close()).await;
    tracing::info!("allocator stopped");
    Ok(())
}
