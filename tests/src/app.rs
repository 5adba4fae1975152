//! The allocator started in process on a free loopback port over a test
//! database, stopped (gracefully) when dropped or by [`TestAllocator::stop`].

use allocator::AppState;
use quota_shared::clock::Clock;
use std::sync::Arc;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// A running allocator.
pub struct TestAllocator {
    /// `http://127.0.0.1:PORT`.
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
        state.auth = allocator::http::auth::Tokens { agent: opts.agent_token, admin: opts.admin_token };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let base = format!("http://{}", listener.local_addr().expect("addr"));
        let (tx, rx) = oneshot::channel();
        let task = tokio::spawn(allocator::run(listener, state.clone(), async move {
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
