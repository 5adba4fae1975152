//! Listener limits shared by both services' HTTP ports and the agent's
//! gRPC port (feature `listen`): a header read timeout, an idle keep-alive
//! timeout and a bound on open connections, with metrics, and the
//! open-file limit raised at start.
//!
//! * [`slots`]: the connection bound and the state of each connection.
//! * [`http`]: the HTTP/1 accept loop (plain or behind a handshake such as
//!   TLS) with both timeouts and graceful shutdown.
//! * [`stream`]: an accepted stream that holds its slot and closes itself
//!   on the header and idle timeouts, for servers that own their
//!   connections (tonic).
//! * [`nofile`]: `RLIMIT_NOFILE` raised to the hard limit, and the bounds
//!   fitted under it.
//!
//! # At the bound
//!
//! A connection that has no request in progress (never sent one, sends its
//! headers slowly, or waits between keep-alive requests) holds a file
//! descriptor and nothing else. When the bound is reached, a new connection
//! therefore **evicts the longest-idle such connection** instead of being
//! refused: idle or slow clients, however many, cannot keep a probe or a
//! decision of another client out. Only when every connection has a request
//! in progress (real overload, which eviction cannot relieve) does a small
//! **reserved share** of the bound ([`Limits::probe_reserve`]) take new
//! connections that are served `/healthz` and `/readyz` only (anything else
//! gets `503 overloaded` with `Connection: close`), one request each, so
//! the orchestrator can still tell a busy process from a dead one. Past
//! that share new connections are closed at once. While many evicted
//! connections are still closing, the accept loop waits for them instead of
//! accepting (a flood then waits in the kernel's accept queue). A separate probe listener
//! would need a second port in every deployment; accepting everything and
//! sorting afterwards would have no bound at all.

/// `AsyncWrite` for a wrapper `$ty<IO>` with field `io`, passed straight
/// through: the wrappers only watch reads (a request arriving), never
/// writes. Defined before the modules so both can use it.
macro_rules! forward_async_write {
    ($ty:ident) => {
        impl<IO: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for $ty<IO> {
            fn poll_write(
                mut self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
                buf: &[u8],
            ) -> std::task::Poll<std::io::Result<usize>> {
                std::pin::Pin::new(&mut self.io).poll_write(cx, buf)
            }

            fn poll_flush(
                mut self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
            ) -> std::task::Poll<std::io::Result<()>> {
                std::pin::Pin::new(&mut self.io).poll_flush(cx)
            }

            fn poll_shutdown(
                mut self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
            ) -> std::task::Poll<std::io::Result<()>> {
                std::pin::Pin::new(&mut self.io).poll_shutdown(cx)
            }

            fn poll_write_vectored(
                mut self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
                bufs: &[std::io::IoSlice<'_>],
            ) -> std::task::Poll<std::io::Result<usize>> {
                std::pin::Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
            }

            fn is_write_vectored(&self) -> bool {
                self.io.is_write_vectored()
            }
        }
    };
}

pub mod http;
pub mod nofile;
pub mod slots;
pub mod stream;

use crate::prom::Registry;
use std::sync::Arc;
use std::time::Duration;

/// `--header-read-timeout-secs` by default.
pub const DEFAULT_HEADER_READ_TIMEOUT_SECS: u64 = 10;
/// `--idle-timeout-secs` by default: longer than the 90 s a reqwest client
/// (the agent's link to the allocator) keeps an idle pooled connection, so
/// the client side closes first and never reuses a connection the server
/// is closing at that moment.
pub const DEFAULT_IDLE_TIMEOUT_SECS: u64 = 120;
/// Longest timeout a flag accepts (an hour).
pub const MAX_TIMEOUT_SECS: u64 = 3600;
/// Smallest connection bound a flag accepts (one probe slot and a few
/// for clients).
pub const MIN_CONNECTIONS: usize = 4;
/// Largest connection bound a flag accepts.
pub const MAX_CONNECTIONS: usize = 1 << 20;

/// The limits of one listener.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// From accept (or from a keep-alive connection's first byte of its
    /// next request) to the end of the request's headers; the body gets as
    /// long again from there.
    pub header_read_timeout: Duration,
    /// Longest a connection may wait between requests.
    pub idle_timeout: Duration,
    /// Most connections open at once.
    pub max_connections: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            header_read_timeout: Duration::from_secs(DEFAULT_HEADER_READ_TIMEOUT_SECS),
            idle_timeout: Duration::from_secs(DEFAULT_IDLE_TIMEOUT_SECS),
            max_connections: 1024,
        }
    }
}

impl Limits {
    /// Connections of the bound kept for probes while every other one has
    /// a request in progress: 1/32 of it, between 1 and 64.
    pub fn probe_reserve(&self) -> usize {
        (self.max_connections / 32).clamp(1, 64)
    }

    /// Checks the flags' values; an error names the flag.
    pub fn validate(
        header_read_timeout_secs: u64,
        idle_timeout_secs: u64,
        max_connections: usize,
        flags: [&str; 3],
    ) -> Result<Limits, String> {
        let secs = |v: u64, flag: &str| {
            if (1..=MAX_TIMEOUT_SECS).contains(&v) {
                Ok(Duration::from_secs(v))
            } else {
                Err(format!("{flag} must be between 1 and {MAX_TIMEOUT_SECS} seconds, got {v}"))
            }
        };
        Ok(Limits {
            header_read_timeout: secs(header_read_timeout_secs, flags[0])?,
            idle_timeout: secs(idle_timeout_secs, flags[1])?,
            max_connections: connections(max_connections, flags[2])?,
        })
    }
}

/// Checks a connection bound flag; the error names it.
pub fn connections(v: usize, flag: &str) -> Result<usize, String> {
    if (MIN_CONNECTIONS..=MAX_CONNECTIONS).contains(&v) {
        Ok(v)
    } else {
        Err(format!("{flag} must be between {MIN_CONNECTIONS} and {MAX_CONNECTIONS}, got {v}"))
    }
}

/// Pending connections the kernel queues for `accept`: the standard
/// library's (and tokio's) 128 overflows under a burst of connects (every
/// one dropped waits a second for its SYN to be sent again), measured with
/// 2,000 connects one after the other on loopback: six 1 s stalls at 128,
/// none at 1,024. The kernel caps it at `net.core.somaxconn`.
pub const BACKLOG: u32 = 1024;

/// Binds `addr` with [`BACKLOG`] (address reuse on, as tokio's bind).
pub fn bind(addr: std::net::SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    let socket =
        if addr.is_ipv4() { tokio::net::TcpSocket::new_v4()? } else { tokio::net::TcpSocket::new_v6()? };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(BACKLOG)
}

/// Why a connection was refused or closed by the listener.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// The bound was reached: refused at accept, or evicted while idle to
    /// make room.
    Bound,
    /// Headers (or a TLS handshake, or an HTTP/2 preface) not complete in time.
    HeaderTimeout,
    /// No request for the idle timeout.
    Idle,
}

impl Reason {
    /// The `reason` label.
    pub fn label(self) -> &'static str {
        match self {
            Reason::Bound => "bound",
            Reason::HeaderTimeout => "header_timeout",
            Reason::Idle => "idle",
        }
    }
}

/// Where a listener counts: a gauge of open connections and a counter of
/// refused or closed ones by reason, both labelled `listener`.
#[derive(Clone)]
pub struct ListenerMetrics {
    pub registry: Arc<Registry>,
    /// Gauge family, e.g. `agent_listener_connections`.
    pub open: &'static str,
    /// Counter family, e.g. `agent_listener_closed_total`.
    pub closed: &'static str,
    /// The `listener` label, e.g. `http` or `grpc`.
    pub listener: &'static str,
}

impl ListenerMetrics {
    /// Declares both families and starts the series of `listeners` at 0.
    pub fn describe(registry: &Registry, open: &'static str, closed: &'static str, listeners: &[&str]) {
        registry.describe(open, "gauge", "Connections open on a listener");
        registry.describe(
            closed,
            "counter",
            "Connections a listener refused or closed, by reason (bound, header_timeout, idle)",
        );
        for l in listeners {
            registry.set(open, &[("listener", l)], 0.0);
            for r in [Reason::Bound, Reason::HeaderTimeout, Reason::Idle] {
                registry.inc_by(closed, &[("listener", l), ("reason", r.label())], 0.0);
            }
        }
    }

    pub(crate) fn closed(&self, reason: Reason) {
        self.registry.inc(self.closed, &[("listener", self.listener), ("reason", reason.label())]);
    }

    pub(crate) fn open(&self, n: usize) {
        self.registry.set(self.open, &[("listener", self.listener)], n as f64);
    }
}
