//! The allocator started in process on a free loopback port over a test
//! database, stopped (gracefully) when dropped or by [`TestAllocator::stop`].

pub use allocator::http::agent_tokens::AgentTokens;
pub use allocator::tls::TlsFiles;
use allocator::AppState;
use quota_shared::clock::Clock;
use std::sync::Arc;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// A running allocator.
pub struct TestAllocator {
    /// `http://127.0.0.1:PORT`, or `https://localhost:PORT` with TLS.
    pub base: String,
    /// Its state (database pool, clock), for assertions on the database.
    pub state: AppState,
    shutdown: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<std::io::Result<()>>>,
}

/// How to build an allocator for a test.
#[derive(Default, Clone)]
pub struct Options {
    /// Stands the allocator at another instant: its own clock and its one
    /// clock for windows (the database's, shifted by this clock's offset).
    pub clock: Option<Arc<dyn Clock>>,
    /// Agent token.
    pub agent_token: Option<String>,
    /// Admin token.
    pub admin_token: Option<String>,
    /// Pool size (default 16).
    pub max_connections: Option<u32>,
    /// Per-region agent tokens file (`--agent-tokens-file`).
    pub agent_tokens_file: Option<std::path::PathBuf>,
    /// Serve HTTPS from these files (`--tls-cert`, `--tls-key`,
    /// `--tls-client-ca`); the base URL is then `https://localhost:PORT`.
    pub tls: Option<allocator::tls::TlsFiles>,
    /// `--window-metrics-quotas` (default 20).
    pub window_metrics_quotas: Option<i64>,
    /// Listener limits (`--header-read-timeout-secs`, `--idle-timeout-secs`,
    /// `--max-connections`; default: the flags' defaults).
    pub limits: Option<quota_shared::listen::Limits>,
}

impl TestAllocator {
    /// An allocator with default options.
    pub async fn spawn(database_url: &str) -> TestAllocator {
        Self::spawn_with(database_url, Options::default()).await
    }

    /// An allocator with `opts`.
    pub async fn spawn_with(database_url: &str, opts: Options) -> TestAllocator {
        let db = allocator::connect(database_url, opts.max_connections.unwrap_or(16))
            .await
            .expect("connect allocator");
        let mut state = AppState::new(db);
        if let Some(c) = opts.clock {
            state.db_clock = allocator::time::DbClock::shifted(c.clone());
            state.clock = c;
        }
        let regions = opts
            .agent_tokens_file
            .as_deref()
            .map(|p| allocator::http::agent_tokens::AgentTokens::load(p).expect("agent tokens file"));
        if let Some(n) = opts.window_metrics_quotas {
            state.window_metrics_quotas = n;
        }
        state.auth =
            allocator::http::auth::Tokens { agent: opts.agent_token, admin: opts.admin_token, regions };
        let tls = opts.tls.map(|f| allocator::tls::ServerTls::load(f).expect("TLS files"));
        let listener = quota_shared::listen::bind(([127, 0, 0, 1], 0).into()).expect("bind");
        let addr = listener.local_addr().expect("addr");
        // Certificates name `localhost`; the listener is on loopback either way.
        let base = match tls {
            Some(_) => format!("https://localhost:{}", addr.port()),
            None => format!("http://{addr}"),
        };
        let (tx, rx) = oneshot::channel();
        let limits = opts.limits.unwrap_or_default();
        let task = tokio::spawn(allocator::run_listening(listener, state.clone(), tls, limits, async move {
            let _ = rx.await;
        }));
        TestAllocator { base, state, shutdown: Some(tx), task: Some(task) }
    }

    /// Graceful stop: stop accepting, finish in-flight requests.
    pub async fn stop(mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.task.take() {
            let _ = t.await;
        }
        self.state.db.close().await;
    }
}

impl Drop for TestAllocator {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.task.take() {
            t.abort();
        }
    }
}
