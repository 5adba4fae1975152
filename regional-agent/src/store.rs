//! The region's Redis: one connection (a reconnecting manager for a single
//! server, a cluster connection for Redis Cluster, or the primary found
//! through Sentinel, see [`crate::sentinel`]), every call bounded by a
//! timeout, and the Lua scripts loaded once from `lua/*.lua` (EVALSHA, with
//! a reload on NOSCRIPT done by `redis::Script`).
//!
//! Errors are not classified further: whatever Redis answers other than a
//! result means the agent cannot decide, which is `503 store_unavailable`
//! (or the opt-in local fallback) on the request path.

use crate::config::SentinelSettings;
use crate::sentinel::Primary;
use redis::aio::ConnectionManager;
use redis::cluster_async::ClusterConnection;
use redis::{FromRedisValue, Script, ScriptInvocation, Value};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock};
use std::time::Duration;

/// The prelude shared by the scripts (see `lua/prelude.lua`): lease scan,
/// incarnation and rollback check, fences, the region's fallback clock.
const PRELUDE: &str = include_str!("../lua/prelude.lua");

/// `lua/spend.lua`: the admission decisions of a batch of requests on one quota (I5).
pub static SPEND: LazyLock<Script> =
    LazyLock::new(|| Script::new(&format!("{PRELUDE}\n{}", include_str!("../lua/spend.lua"))));
/// `lua/view.lua`: the renewer's view and the expiry sweep.
pub static VIEW: LazyLock<Script> =
    LazyLock::new(|| Script::new(&format!("{PRELUDE}\n{}", include_str!("../lua/view.lua"))));
/// `lua/credit.lua`: credits a lease, idempotent by lease id, epoch-fenced.
pub static CREDIT: LazyLock<Script> =
    LazyLock::new(|| Script::new(&format!("{PRELUDE}\n{}", include_str!("../lua/credit.lua"))));
/// `lua/cut.lua`: moves unreported counts into an outbox entry (I7).
pub static CUT: LazyLock<Script> =
    LazyLock::new(|| Script::new(&format!("{PRELUDE}\n{}", include_str!("../lua/cut.lua"))));
/// `lua/fence.lua`: raises an agent's epoch fence in one quota (I4).
pub static FENCE: LazyLock<Script> =
    LazyLock::new(|| Script::new(&format!("{PRELUDE}\n{}", include_str!("../lua/fence.lua"))));
/// `lua/unlock.lua`: releases the renew lock if still ours.
pub static UNLOCK: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("../lua/unlock.lua")));

/// Why a Redis call failed (cloned to every request of a failed batch).
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    /// Redis answered with an error or the connection broke.
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    /// No answer within the timeout.
    #[error("redis call timed out after {0:?}")]
    Timeout(Duration),
    /// A script answered something the agent does not understand (a bug).
    #[error("unexpected script answer: {0}")]
    Protocol(String),
}

#[derive(Clone)]
enum Conn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
    /// Looked up through Sentinel, and again after a failover.
    Sentinel(Arc<Primary>),
}

/// A handle on the region's Redis; cheap to clone.
#[derive(Clone)]
pub struct Store {
    conn: Conn,
    timeout: Duration,
}

impl Store {
    /// Connects to one server (lazily: the agent starts and reports
    /// not-ready while Redis is down) or to a cluster (seed nodes).
    pub async fn connect(
        urls: &[String],
        cluster: bool,
        sentinel: Option<&SentinelSettings>,
        timeout: Duration,
    ) -> Result<Store, String> {
        if let Some(s) = sentinel {
            // REDIS_URL, when given with Sentinel, only lends its credentials.
            let node = match urls.first() {
                Some(u) => Some(
                    redis::IntoConnectionInfo::into_connection_info(u.as_str())
                        .map_err(|e| format!("REDIS_URL is not a valid Redis URL: {e}"))?,
                ),
                None => None,
            };
            let primary = Primary::new(&s.nodes, &s.master, node.as_ref(), timeout)?;
            return Ok(Store { conn: Conn::Sentinel(Arc::new(primary)), timeout });
        }
        if cluster {
            let client = redis::cluster::ClusterClientBuilder::new(urls.to_vec())
                .connection_timeout(timeout)
                .response_timeout(timeout)
                .retries(2)
                .build()
                .map_err(|e| format!("REDIS_URL is not a valid cluster node list: {e}"))?;
            let conn = tokio::time::timeout(timeout * 20, client.get_async_connection())
                .await
                .map_err(|_| "timed out connecting to the Redis Cluster".to_string())?
                .map_err(|e| format!("cannot connect to the Redis Cluster: {e}"))?;
            return Ok(Store { conn: Conn::Cluster(conn), timeout });
        }
        let url = urls.first().ok_or("REDIS_URL is empty")?;
        let client = redis::Client::open(url.as_str())
            .map_err(|e| format!("REDIS_URL is not a valid Redis URL: {e}"))?;
        let config = redis::aio::ConnectionManagerConfig::new()
            .set_connection_timeout(Some(timeout))
            .set_response_timeout(Some(timeout))
            .set_number_of_retries(1)
            .set_max_delay(Duration::from_millis(500));
        let conn =
            ConnectionManager::new_lazy_with_config(client, config).map_err(|e| format!("redis: {e}"))?;
        Ok(Store { conn: Conn::Single(conn), timeout })
    }

    /// Runs a script invocation (EVALSHA; SCRIPT LOAD and retry on NOSCRIPT,
    /// which is what a new primary after a failover answers first).
    pub async fn eval<T: FromRedisValue>(&self, inv: &ScriptInvocation<'_>) -> Result<T, StoreError> {
        // The Sentinel connection's generation this call used, so that a
        // timeout gives up that connection and not a newer one.
        let used = AtomicU64::new(0);
        let fut = async {
            match self.conn.clone() {
                Conn::Single(mut c) => inv.invoke_async(&mut c).await,
                Conn::Cluster(mut c) => inv.invoke_async(&mut c).await,
                Conn::Sentinel(p) => {
                    let (gen, mut c) = p.connection().await?;
                    used.store(gen, Ordering::SeqCst);
                    let r = inv.invoke_async(&mut c).await;
                    p.observe(gen, &r);
                    r
                }
            }
        };
        self.bounded(fut, &used).await
    }

    /// Runs one command.
    pub async fn cmd<T: FromRedisValue>(&self, cmd: &redis::Cmd) -> Result<T, StoreError> {
        let used = AtomicU64::new(0);
        let fut = async {
            match self.conn.clone() {
                Conn::Single(mut c) => cmd.query_async(&mut c).await,
                Conn::Cluster(mut c) => cmd.query_async(&mut c).await,
                Conn::Sentinel(p) => {
                    let (gen, mut c) = p.connection().await?;
                    used.store(gen, Ordering::SeqCst);
                    let r = cmd.query_async(&mut c).await;
                    p.observe(gen, &r);
                    r
                }
            }
        };
        self.bounded(fut, &used).await
    }

    /// Bounds a call by the timeout; a Sentinel connection that did not
    /// answer in time is given up (the primary may be gone without a reset).
    async fn bounded<T>(
        &self,
        fut: impl std::future::Future<Output = redis::RedisResult<T>>,
        used: &AtomicU64,
    ) -> Result<T, StoreError> {
        match tokio::time::timeout(self.timeout, fut).await {
            Ok(r) => r.map_err(Into::into),
            Err(_) => {
                if let Conn::Sentinel(p) = &self.conn {
                    p.forget(used.load(Ordering::SeqCst), "timeout");
                }
                Err(StoreError::Timeout(self.timeout))
            }
        }
    }

    /// Whether this store follows a primary through Sentinel.
    pub fn is_sentinel(&self) -> bool {
        matches!(self.conn, Conn::Sentinel(_))
    }

    /// Whether this store is a Redis Cluster (commands without a key go to
    /// every primary, answered as a map by node).
    pub fn is_cluster(&self) -> bool {
        matches!(self.conn, Conn::Cluster(_))
    }

    /// Resolves when a Sentinel lookup found the primary again (never for
    /// the other kinds).
    pub async fn primary_changed(&self) {
        match &self.conn {
            Conn::Sentinel(p) => p.changed.notified().await,
            _ => std::future::pending().await,
        }
    }

    /// Gives up the Sentinel connection in use (the server it reaches says
    /// it is a replica now); nothing for the other kinds.
    pub fn forget_primary(&self, why: &str) {
        if let Conn::Sentinel(p) = &self.conn {
            p.forget(p.generation(), why);
        }
    }

    /// `PING`, for readiness.
    pub async fn ping(&self) -> bool {
        self.cmd::<String>(&redis::cmd("PING")).await.is_ok()
    }
}

/// A script's array answer, read field by field.
pub struct Reply(Vec<Value>);

impl FromRedisValue for Reply {
    fn from_redis_value(v: Value) -> Result<Self, redis::ParsingError> {
        match v {
            Value::Array(items) => Ok(Reply(items)),
            other => Ok(Reply(vec![other])),
        }
    }
}

impl Reply {
    /// Field `i` as text (`""` when absent or nil).
    pub fn str(&self, i: usize) -> String {
        match self.0.get(i) {
            Some(Value::BulkString(b)) => String::from_utf8_lossy(b).into_owned(),
            Some(Value::SimpleString(s)) => s.clone(),
            Some(Value::Int(n)) => n.to_string(),
            Some(Value::Okay) => "OK".into(),
            _ => String::new(),
        }
    }

    /// Field `i`, itself an array (empty when absent or not an array).
    pub fn nested(&self, i: usize) -> Reply {
        match self.0.get(i) {
            Some(Value::Array(items)) => Reply(items.clone()),
            _ => Reply(Vec::new()),
        }
    }

    /// Field `i` as an integer (0 when absent or not a number).
    pub fn int(&self, i: usize) -> i64 {
        match self.0.get(i) {
            Some(Value::Int(n)) => *n,
            Some(Value::BulkString(b)) => {
                std::str::from_utf8(b).ok().and_then(|s| s.parse().ok()).unwrap_or(0)
            }
            _ => 0,
        }
    }
}
