//! The region's Redis: one connection (a reconnecting manager for a single
//! server, a cluster connection for Redis Cluster, or the primary found
//! through Sentinel, see [`crate::sentinel`]), every call bounded by a
//! timeout. The Lua scripts, their arguments and replies are
//! the `scripts` module's; this module only runs them.
//!
//! Errors are not classified further: whatever Redis answers other than a
//! result means the agent cannot decide, which is `503 store_unavailable`
//! (or the opt-in local fallback) on the request path.
//!
//! `rediss://` URLs (and `rediss://` Sentinels) go over TLS with the
//! certificates of [`crate::redis_tls`]. A failure to reach Redis at all
//! (refused, timed out, a TLS handshake that fails: unknown CA, expired
//! certificate, client certificate refused) is kept as the store's
//! [`Store::last_error`] for `/v1/status` and `/readyz`, and logged once
//! each time the reason changes, not once per request; the first answer
//! clears it. The reason is the error's text with its causes, which never
//! holds the URL or its password.

use crate::client::TlsFiles;
use crate::config::SentinelSettings;
use crate::redis_tls;
use crate::sentinel::{Primary, SentinelTls};
use redis::aio::ConnectionManager;
use redis::cluster_async::ClusterConnection;
use redis::{ErrorKind, FromRedisValue, RedisError, ScriptInvocation};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Why a Redis call failed (cloned to every request of a failed batch).
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    /// Redis answered with an error or the connection broke.
    #[error("redis: {}", describe(.0))]
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

/// Why the store cannot be used, as the last failed call showed it.
#[derive(Default)]
struct Health {
    /// Set while `reason` holds something, so a successful call need not
    /// take the lock.
    failing: AtomicBool,
    reason: Mutex<Option<String>>,
}

/// A handle on the region's Redis; cheap to clone.
#[derive(Clone)]
pub struct Store {
    conn: Conn,
    timeout: Duration,
    health: Arc<Health>,
}

thread_local! {
    /// The calling thread's own connection, where it has one: a gRPC
    /// thread's (see [`Store::own_thread`]).
    static OWN: std::cell::RefCell<Option<Store>> = const { std::cell::RefCell::new(None) };
}

impl Store {
    /// The connection to use on the calling thread: its own if it has one
    /// (a gRPC thread's, whose spend runs then never wait for another
    /// thread to read Redis's answer), else `self`.
    pub fn here(&self) -> Store {
        OWN.with(|o| o.borrow().clone()).unwrap_or_else(|| self.clone())
    }

    /// Makes `self` (a connection made on the calling thread) that
    /// thread's own, see [`Store::here`]; its failures count in `shared`'s
    /// health, which readiness reads.
    pub fn own_thread(mut self, shared: &Store) {
        self.health = shared.health.clone();
        OWN.with(|o| *o.borrow_mut() = Some(self));
    }
}

/// An error with its cause chain (where a TLS handshake's reason lives),
/// each cause once.
pub fn describe(e: &RedisError) -> String {
    let mut out = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(s) = src {
        let text = s.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        src = s.source();
    }
    out
}

/// Whether two failure reasons are the same apart from their numbers: a
/// TLS verification error quotes the current time ("verification time
/// 1796389130, ... 186929930 seconds ago"), and a reason that changes every
/// second must still be logged once, not once per second.
pub fn same_reason(a: &str, b: &str) -> bool {
    let digitless = |s: &str| s.chars().filter(|c| !c.is_ascii_digit()).collect::<String>();
    digitless(a) == digitless(b)
}

/// Whether an error means Redis could not be used at all (no connection,
/// no handshake, no answer), as opposed to an answer the caller did not
/// like (a script's error, a wrong type), which says Redis works.
fn unusable(e: &RedisError) -> bool {
    !matches!(
        e.kind(),
        ErrorKind::Server(_) | ErrorKind::Extension | ErrorKind::UnexpectedReturnType | ErrorKind::Parse
    )
}

impl Store {
    /// The agent's Redis as its settings name it (see [`Store::connect`]).
    pub async fn for_settings(s: &crate::config::Settings) -> Result<Store, String> {
        Store::connect(&s.redis, s.redis_cluster, s.sentinel.as_ref(), &s.redis_tls, s.redis_timeout).await
    }

    /// Connects to one server (lazily: the agent starts and reports
    /// not-ready while Redis is down) or to a cluster (seed nodes), over
    /// TLS for `rediss://` addresses with the certificates of `tls`.
    pub async fn connect(
        urls: &[String],
        cluster: bool,
        sentinel: Option<&SentinelSettings>,
        tls: &TlsFiles,
        timeout: Duration,
    ) -> Result<Store, String> {
        let health = Arc::new(Health::default());
        let tls_urls = urls.iter().any(|u| redis_tls::is_tls_url(u));
        let certs = if tls_urls || sentinel.is_some_and(|s| s.tls) {
            Some(redis_tls::certificates(tls)?)
        } else {
            None
        };
        if let Some(s) = sentinel {
            // REDIS_URL, when given with Sentinel, only lends its scheme
            // and credentials.
            let node = match urls.first() {
                Some(u) => Some(
                    redis::IntoConnectionInfo::into_connection_info(u.as_str())
                        .map_err(|e| format!("REDIS_URL is not a valid Redis URL: {e}"))?,
                ),
                None => None,
            };
            // The primary speaks TLS when REDIS_URL says rediss://, or,
            // without REDIS_URL, when the Sentinels do (a TLS deployment
            // usually runs `tls-replication yes` everywhere).
            let primary_tls = if urls.is_empty() { s.tls } else { tls_urls };
            let tls = certs.map(|certs| SentinelTls { sentinels: s.tls, primary: primary_tls, certs });
            let primary = Primary::new(&s.nodes, &s.master, node.as_ref(), tls, timeout)?;
            return Ok(Store { conn: Conn::Sentinel(Arc::new(primary)), timeout, health });
        }
        if cluster {
            let mut builder = redis::cluster::ClusterClientBuilder::new(urls.to_vec())
                .connection_timeout(timeout)
                .response_timeout(timeout)
                .retries(2);
            if let Some(certs) = certs {
                builder = builder.certs(certs);
            }
            let client =
                builder.build().map_err(|e| format!("REDIS_URL is not a valid cluster node list: {e}"))?;
            let conn = tokio::time::timeout(timeout * 20, client.get_async_connection())
                .await
                .map_err(|_| "timed out connecting to the Redis Cluster".to_string())?
                .map_err(|e| format!("cannot connect to the Redis Cluster: {}", describe(&e)))?;
            return Ok(Store { conn: Conn::Cluster(conn), timeout, health });
        }
        let url = urls.first().ok_or("REDIS_URL is empty")?;
        let client = match certs {
            Some(certs) => redis::Client::build_with_tls(url.as_str(), certs),
            None => redis::Client::open(url.as_str()),
        }
        .map_err(|e| format!("REDIS_URL is not a valid Redis URL: {e}"))?;
        let config = redis::aio::ConnectionManagerConfig::new()
            .set_connection_timeout(Some(timeout))
            .set_response_timeout(Some(timeout))
            .set_number_of_retries(1)
            .set_max_delay(Duration::from_millis(500));
        let conn =
            ConnectionManager::new_lazy_with_config(client, config).map_err(|e| format!("redis: {e}"))?;
        Ok(Store { conn: Conn::Single(conn), timeout, health })
    }

    /// Why Redis cannot be used, while the latest call failed to reach it
    /// (refused, timed out, TLS handshake failed); `None` once it answers.
    pub fn last_error(&self) -> Option<String> {
        if !self.health.failing.load(Ordering::Relaxed) {
            return None;
        }
        self.health.reason.lock().unwrap().clone()
    }

    /// Records a call's outcome; logs only when the reason changes.
    fn record<T>(&self, r: &Result<T, StoreError>) {
        let why = match r {
            Ok(_) => None,
            Err(StoreError::Redis(e)) if unusable(e) => Some(describe(e)),
            Err(StoreError::Timeout(d)) => Some(format!("no answer within {d:?}")),
            // Redis answered: it is usable, whatever it said.
            Err(_) => None,
        };
        if why.is_none() && !self.health.failing.load(Ordering::Relaxed) {
            return;
        }
        let mut reason = self.health.reason.lock().unwrap();
        match why {
            None => {
                if reason.take().is_some() {
                    tracing::info!("the region's Redis answers again");
                }
                self.health.failing.store(false, Ordering::Relaxed);
            }
            Some(why) => {
                if !reason.as_deref().is_some_and(|r| same_reason(r, &why)) {
                    tracing::warn!(reason = %why, "the region's Redis cannot be used");
                }
                // The latest text, for /v1/status.
                *reason = Some(why);
                self.health.failing.store(true, Ordering::Relaxed);
            }
        }
    }

    /// Runs a script invocation (EVALSHA; SCRIPT LOAD and retry on NOSCRIPT,
    /// which is what a new primary after a failover answers first).
    ///
    /// The Sentinel lookup is boxed: inline, its state (6.3 KiB) was part of
    /// every call's future, whatever the connection, and so of every
    /// decision and of every renewal round in flight (see
    /// `renew::size`); boxed, only a Sentinel call allocates it.
    pub async fn eval<T: FromRedisValue>(&self, inv: &ScriptInvocation<'_>) -> Result<T, StoreError> {
        // The Sentinel connection's generation this call used, so that a
        // timeout gives up that connection and not a newer one.
        let used = AtomicU64::new(0);
        let fut = async {
            match self.conn.clone() {
                Conn::Single(mut c) => inv.invoke_async(&mut c).await,
                Conn::Cluster(mut c) => inv.invoke_async(&mut c).await,
                Conn::Sentinel(p) => {
                    let (gen, mut c) = Box::pin(p.connection()).await?;
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
                    let (gen, mut c) = Box::pin(p.connection()).await?;
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
        let r = match tokio::time::timeout(self.timeout, fut).await {
            Ok(r) => r.map_err(Into::into),
            Err(_) => {
                if let Conn::Sentinel(p) = &self.conn {
                    p.forget(used.load(Ordering::SeqCst), "timeout");
                }
                Err(StoreError::Timeout(self.timeout))
            }
        };
        self.record(&r);
        r
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasons_differing_only_in_numbers_are_the_same() {
        let a = "invalid peer certificate: certificate expired: verification time 1796389130 (UNIX)";
        let b = "invalid peer certificate: certificate expired: verification time 1796389131 (UNIX)";
        assert!(same_reason(a, b));
        assert!(!same_reason(a, "invalid peer certificate: UnknownIssuer"));
    }
}
