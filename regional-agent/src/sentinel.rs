//! The region's Redis found through Sentinel (`--redis-sentinel`,
//! `--redis-master`): one multiplexed connection to the current primary,
//! given up and looked up again through the Sentinels when a call shows the
//! primary is gone or demoted (a connection error, a timeout, `READONLY`,
//! `MASTERDOWN`), so the agent follows a failover.
//!
//! Bounds: a lookup runs inside the caller's Redis timeout (the store wraps
//! every call, lookup included, in it); one lookup runs at a time and the
//! calls arriving meanwhile wait for it; after a failed lookup the next one
//! starts no sooner than [`LOOKUP_BACKOFF`] later and the calls in between
//! fail at once with the lookup's error. So a failover costs `503
//! store_unavailable` answers (or the opt-in local fallback) until Sentinel
//! has promoted a replica, then at most one lookup; nothing retries in a loop.
//!
//! A call is never retried on the new primary by this module: a script
//! whose connection broke may or may not have run, and the caller decides
//! what an unknown outcome means. What the new primary lost (writes its
//! replica had not received) is the spend script's business (rollback
//! detection, DESIGN §3 I6), not the connection's.
//!
//! TLS ([`SentinelTls`]): the Sentinels (`rediss://` entries) and the
//! primary they name are reached with the same certificates. The primary's
//! certificate is verified against the address Sentinel announces (an IP
//! address, usually), so it must name that address.

use redis::aio::MultiplexedConnection;
use redis::sentinel::{SentinelClient, SentinelClientBuilder, SentinelServerType};
use redis::{AsyncConnectionConfig, ConnectionAddr, RedisError, TlsCertificates, TlsMode};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Shortest time between two lookups after one failed: Sentinel needs
/// `down-after-milliseconds` plus an election to promote a replica, and
/// asking it on every request meanwhile only loads it.
pub const LOOKUP_BACKOFF: Duration = Duration::from_millis(100);

/// The connection in use and what the last lookup did.
#[derive(Default)]
struct Current {
    /// Generation and connection; `None` until looked up or after it failed.
    conn: Option<(u64, MultiplexedConnection)>,
    /// When the last lookup failed, and why.
    failed: Option<(Instant, RedisError)>,
}

/// Which links of a Sentinel group use TLS, and the certificates.
pub struct SentinelTls {
    /// The agent → Sentinel connections.
    pub sentinels: bool,
    /// The agent → primary connection.
    pub primary: bool,
    /// Trust roots and client certificate of both (`--redis-ca-file`, ...).
    pub certs: TlsCertificates,
}

/// The primary of one Sentinel-monitored group.
pub struct Primary {
    /// Held during a lookup (one at a time); its `SentinelClient` caches the
    /// connections to the Sentinels.
    lookup: tokio::sync::Mutex<SentinelClient>,
    current: Mutex<Current>,
    generation: AtomicU64,
    config: AsyncConnectionConfig,
    master: String,
    /// Signalled after a lookup found a primary once more (a failover, or a
    /// reconnection), so the eviction guard reads the new server at once.
    pub changed: tokio::sync::Notify,
}

/// Whether an error means the connection no longer reaches a writable
/// primary, so the next call must look the primary up again.
///
/// A plain error answer (a script's own error, a wrong type) does not: the
/// server answered and is still the primary.
pub fn needs_lookup(e: &RedisError) -> bool {
    let server_says_not_primary = matches!(e.code(), Some("READONLY" | "MASTERDOWN" | "LOADING"))
        // A script's write refused on a replica comes back as the script's
        // error with the READONLY text inside.
        || e.to_string().contains("READONLY");
    server_says_not_primary
        || e.is_io_error()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_timeout()
        || e.is_unrecoverable_error()
}

impl Primary {
    /// A handle on `master` as the `sentinels` name it; connects lazily.
    /// `node` carries the primary's credentials and database (from
    /// `REDIS_URL`, when given); `tls` says which links use TLS;
    /// `timeout` bounds the connection and each answer.
    pub fn new(
        sentinels: &[(String, u16)],
        master: &str,
        node: Option<&redis::ConnectionInfo>,
        tls: Option<SentinelTls>,
        timeout: Duration,
    ) -> Result<Primary, String> {
        let sentinel_tls = tls.as_ref().is_some_and(|t| t.sentinels);
        let addrs = sentinels.iter().map(|(h, p)| {
            if sentinel_tls {
                // `insecure: false`: the certificate and its name are checked.
                ConnectionAddr::TcpTls { host: h.clone(), port: *p, insecure: false, tls_params: None }
            } else {
                ConnectionAddr::Tcp(h.clone(), *p)
            }
        });
        let mut b = SentinelClientBuilder::new(addrs, master, SentinelServerType::Master)
            .map_err(|e| format!("AGENT_REDIS_SENTINEL: {e}"))?;
        if let Some(t) = tls {
            if t.sentinels {
                b = b.set_client_to_sentinel_certificates(t.certs.clone());
            }
            if t.primary {
                b = b.set_client_to_redis_tls_mode(TlsMode::Secure).set_client_to_redis_certificates(t.certs);
            }
        }
        if let Some(info) = node {
            let r = info.redis_settings();
            if let Some(u) = r.username() {
                b = b.set_client_to_redis_username(u);
            }
            if let Some(p) = r.password() {
                b = b.set_client_to_redis_password(p);
            }
            b = b.set_client_to_redis_db(r.db());
        }
        let client = b.build().map_err(|e| format!("AGENT_REDIS_SENTINEL: {e}"))?;
        Ok(Primary {
            lookup: tokio::sync::Mutex::new(client),
            current: Mutex::new(Current::default()),
            generation: AtomicU64::new(0),
            config: AsyncConnectionConfig::new()
                .set_connection_timeout(Some(timeout))
                .set_response_timeout(Some(timeout)),
            master: master.to_string(),
            changed: tokio::sync::Notify::new(),
        })
    }

    /// The connection to the current primary and its generation, looked up
    /// through Sentinel when there is none. Not bounded here: the store
    /// bounds the whole call.
    pub async fn connection(&self) -> Result<(u64, MultiplexedConnection), RedisError> {
        if let Some(c) = self.current.lock().unwrap().conn.clone() {
            return Ok(c);
        }
        let mut client = self.lookup.lock().await;
        {
            // Another call may have finished a lookup while this one waited.
            let cur = self.current.lock().unwrap();
            if let Some(c) = cur.conn.clone() {
                return Ok(c);
            }
            if let Some((at, e)) = &cur.failed {
                if at.elapsed() < LOOKUP_BACKOFF {
                    return Err(e.clone());
                }
            }
        }
        let found = async {
            let node = client.async_get_client().await?;
            let addr = node.get_connection_info().addr().to_string();
            let conn = node.get_multiplexed_async_connection_with_config(&self.config).await?;
            Ok::<_, RedisError>((addr, conn))
        }
        .await;
        let mut cur = self.current.lock().unwrap();
        match found {
            Ok((addr, conn)) => {
                let gen = self.generation.fetch_add(1, Ordering::SeqCst) + 1;
                // The address only: no credentials in the log.
                tracing::info!(master = %self.master, primary = %addr, generation = gen,
                    "connected to the Redis primary named by Sentinel");
                cur.conn = Some((gen, conn.clone()));
                cur.failed = None;
                if gen > 1 {
                    self.changed.notify_one();
                }
                Ok((gen, conn))
            }
            Err(e) => {
                // Logged once per distinct failure: during a failover the
                // lookup fails every LOOKUP_BACKOFF for a second or more.
                let again = cur.failed.as_ref().is_some_and(|(_, p)| p.to_string() == e.to_string());
                if again {
                    tracing::debug!(master = %self.master, error = %e, "still no Redis primary from Sentinel");
                } else {
                    tracing::warn!(master = %self.master, error = %e, "no Redis primary from Sentinel");
                }
                cur.failed = Some((Instant::now(), e.clone()));
                Err(e)
            }
        }
    }

    /// Gives up connection `gen` (if still current) so the next call looks
    /// the primary up again; `why` is logged.
    pub fn forget(&self, gen: u64, why: &str) {
        let mut cur = self.current.lock().unwrap();
        if cur.conn.as_ref().is_some_and(|(g, _)| *g == gen) {
            cur.conn = None;
            tracing::warn!(master = %self.master, generation = gen, reason = why,
                "Redis primary connection given up; asking Sentinel again");
        }
    }

    /// The generation of the connection in use (0 before the first).
    pub fn generation(&self) -> u64 {
        self.current.lock().unwrap().conn.as_ref().map_or(0, |(g, _)| *g)
    }

    /// Reacts to a call's result on connection `gen`.
    pub fn observe<T>(&self, gen: u64, r: &Result<T, RedisError>) {
        if let Err(e) = r {
            if needs_lookup(e) {
                self.forget(gen, e.category());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use redis::ErrorKind;

    fn server(code: &str, detail: &str) -> RedisError {
        redis::make_extension_error(code.to_string(), Some(detail.to_string()))
    }

    #[test]
    fn a_lost_or_demoted_primary_needs_a_lookup() {
        let io = RedisError::from(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
        assert!(needs_lookup(&io));
        let refused = RedisError::from(std::io::Error::from(std::io::ErrorKind::ConnectionRefused));
        assert!(needs_lookup(&refused));
        let timed_out = RedisError::from(std::io::Error::from(std::io::ErrorKind::TimedOut));
        assert!(needs_lookup(&timed_out));
        assert!(needs_lookup(&server("READONLY", "You can't write against a read only replica.")));
        assert!(needs_lookup(&server("MASTERDOWN", "Link with MASTER is down")));
    }

    #[test]
    fn an_ordinary_error_answer_keeps_the_connection() {
        let wrong_type = RedisError::from((ErrorKind::UnexpectedReturnType, "not a number"));
        assert!(!needs_lookup(&wrong_type));
        assert!(!needs_lookup(&server("ERR", "user_script:1: bad argument")));
    }
}
