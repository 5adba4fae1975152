//! A TCP fault proxy for one link (agent→allocator, agent→Redis,
//! allocator→PostgreSQL), switched at run time between pass, blackhole,
//! refuse, added latency and dropped replies. The one such proxy of the
//! tests (a partition between an agent and its allocator) and of the lab
//! (a proxy on every link of its stack). With several upstreams it is
//! also the load balancer in front of allocator replicas: connections go
//! round-robin to the upstreams that accept them. Its upstreams can be
//! replaced at run time, as a load balancer's health check would after a
//! database failover.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// What the link does with traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Forward both ways.
    Pass,
    /// Accept connections and never answer (looks like timeouts).
    Blackhole,
    /// Reset every connection at once (looks like a refused connection).
    Refuse,
    /// Forward, delaying every chunk by this many milliseconds.
    Latency(u64),
    /// Forward requests, swallow every answer: the request takes effect
    /// and the caller sees a timeout (a lost reply).
    DropReplies,
}

/// Longest a proxied connection waits to reach an upstream.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// A running proxy; stops when dropped.
pub struct FaultProxy {
    /// `127.0.0.1:PORT`.
    pub addr: String,
    state: watch::Sender<Fault>,
    /// Connections accepted, for reports.
    accepted: Arc<AtomicU64>,
    /// Where new connections go; read once per accepted connection.
    upstreams: Arc<Mutex<Vec<String>>>,
    task: tokio::task::JoinHandle<()>,
}

impl FaultProxy {
    /// A proxy on loopback in front of `upstreams` (`host:port` each).
    pub async fn start(upstreams: Vec<String>) -> std::io::Result<FaultProxy> {
        Self::start_on("127.0.0.1", upstreams).await
    }

    /// A proxy on loopback in front of the one HTTP service at `url`
    /// (`http://host:port`); give [`FaultProxy::http_url`] to its clients.
    pub async fn in_front_of(url: &str) -> std::io::Result<FaultProxy> {
        Self::start(vec![host_port(url)]).await
    }

    /// A proxy listening on `ip` (e.g. the host end of a veth pair).
    pub async fn start_on(ip: &str, upstreams: Vec<String>) -> std::io::Result<FaultProxy> {
        let listener = TcpListener::bind((ip, 0)).await?;
        let addr = listener.local_addr()?.to_string();
        let (state, _) = watch::channel(Fault::Pass);
        let accepted = Arc::new(AtomicU64::new(0));
        let upstreams = Arc::new(Mutex::new(upstreams));
        let next = Arc::new(AtomicUsize::new(0));
        let (st, acc, ups_of_task) = (state.clone(), accepted.clone(), upstreams.clone());
        let task = tokio::spawn(async move {
            loop {
                let Ok((inbound, _)) = listener.accept().await else { continue };
                acc.fetch_add(1, Ordering::Relaxed);
                let _ = inbound.set_nodelay(true);
                let rx = st.subscribe();
                let ups = ups_of_task.lock().map(|u| u.clone()).unwrap_or_default();
                let start = next.fetch_add(1, Ordering::Relaxed);
                tokio::spawn(handle(inbound, rx, ups, start));
            }
        });
        Ok(FaultProxy { addr, state, accepted, upstreams, task })
    }

    /// Sends new connections to `upstreams` from now on and ends the open
    /// ones, as a load balancer does when its health check moves the
    /// primary: a client keeps no connection to the old upstream (a
    /// PostgreSQL backend orphaned by a killed postmaster could otherwise
    /// keep answering on it for a while).
    pub fn set_upstreams(&self, upstreams: Vec<String>) {
        if let Ok(mut u) = self.upstreams.lock() {
            *u = upstreams;
        }
        // Re-sending the fault in force wakes every connection's watch,
        // which ends it (see `handle`).
        let fault = self.fault();
        self.state.send_replace(fault);
    }

    /// Switches the link; open connections end so the new fault applies to
    /// every request from now on.
    pub fn set(&self, fault: Fault) {
        self.state.send_replace(fault);
    }

    /// The fault in force.
    pub fn fault(&self) -> Fault {
        *self.state.borrow()
    }

    /// Connections accepted so far.
    pub fn accepted(&self) -> u64 {
        self.accepted.load(Ordering::Relaxed)
    }

    /// `http://127.0.0.1:PORT`.
    pub fn http_url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

/// `host:port` of an `http://host:port` (or `https://`) URL.
pub fn host_port(url: &str) -> String {
    url.trim_start_matches("http://").trim_start_matches("https://").trim_end_matches('/').to_string()
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn connect_any(upstreams: &[String], start: usize) -> Option<TcpStream> {
    for i in 0..upstreams.len() {
        let target = &upstreams[(start + i) % upstreams.len()];
        if let Ok(Ok(s)) = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(target)).await {
            let _ = s.set_nodelay(true);
            return Some(s);
        }
    }
    None
}

async fn handle(inbound: TcpStream, mut rx: watch::Receiver<Fault>, upstreams: Vec<String>, start: usize) {
    let fault = *rx.borrow_and_update();
    match fault {
        Fault::Refuse => {
            // Linger 0 turns the close into a reset, as a refused port would.
            let _ = inbound.set_zero_linger();
        }
        Fault::Blackhole => {
            let _ = rx.changed().await;
        }
        Fault::Pass | Fault::Latency(_) | Fault::DropReplies => {
            let Some(out) = connect_any(&upstreams, start).await else { return };
            let delay = match fault {
                Fault::Latency(ms) => Duration::from_millis(ms),
                _ => Duration::ZERO,
            };
            let (ri, wi) = inbound.into_split();
            let (ro, wo) = out.into_split();
            let up = pump(ri, wo, delay, false);
            let down = pump(ro, wi, delay, fault == Fault::DropReplies);
            tokio::select! {
                _ = async { tokio::join!(up, down) } => {},
                _ = rx.changed() => {},
            }
        }
    }
}

/// Copies `from` to `to`, delaying each chunk, or discarding it when `drop`.
async fn pump<R: AsyncRead + Unpin, W: AsyncWrite + Unpin>(
    mut from: R,
    mut to: W,
    delay: Duration,
    drop: bool,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if drop {
            continue;
        }
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    let _ = to.shutdown().await;
}
