//! The HTTP/1 accept loop both services serve with: the connection bound
//! ([`super::slots`]), the header read and idle timeouts, and graceful
//! shutdown (stop accepting, let every in-flight request finish, close idle
//! connections at once; the caller bounds the wait).

use super::slots::{Admit, Conn, Slot, Slots};
use super::{Limits, ListenerMetrics, Reason};
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;

/// The paths a connection of the reserved share is served.
pub const PROBE_PATHS: [&str; 2] = ["/healthz", "/readyz"];

/// Longest the accept loop waits for evicted connections to close before
/// it accepts (and then refuses) anyway.
const EVICTED_CLOSE_WAIT: Duration = Duration::from_millis(500);

/// The boxed error hyper accepts from a body.
type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Serves `handshake`'s service on every connection `listener` accepts,
/// within `limits`, until `shutdown` resolves; then stops accepting, lets
/// in-flight requests finish and returns once every connection is closed.
/// Dropping the returned future closes every connection at once (the
/// caller's shutdown deadline).
///
/// `handshake` turns an accepted TCP stream into the stream to speak HTTP
/// on and the service for that connection (plain: the stream and the
/// router; TLS: the handshake, within its own timeout); `None` closes it.
pub async fn serve<H, HF, IO, S, B>(
    listener: TcpListener,
    limits: Limits,
    metrics: ListenerMetrics,
    handshake: H,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> io::Result<()>
where
    H: Fn(TcpStream, SocketAddr) -> HF + Clone + Send + 'static,
    HF: Future<Output = Option<(IO, S)>> + Send + 'static,
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    S: tower::Service<Request<TimedBody>, Response = Response<B>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    B: hyper::body::Body + From<String> + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
{
    let slots = Slots::http(&limits, metrics);
    let (stop_tx, stop_rx) = watch::channel(false);
    // Dropping the set (this future dropped at the caller's deadline)
    // aborts every connection task.
    let mut conns = JoinSet::new();
    tokio::pin!(shutdown);
    // One deadline per wait for evicted connections to close, kept across
    // the loop's turns (a connection task that ends restarts the select,
    // and must not restart the wait).
    let mut wait_until: Option<tokio::time::Instant> = None;
    loop {
        let deadline = *wait_until.get_or_insert_with(|| tokio::time::Instant::now() + EVICTED_CLOSE_WAIT);
        // Both steps are cancel-safe: a connection that finished or the
        // shutdown does not lose an accepted stream.
        let accept = async {
            slots.room_to_evict(deadline).await;
            listener.accept().await
        };
        let (tcp, peer) = tokio::select! {
            accepted = accept => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of file descriptors and the like: back off a
                    // little instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            Some(_) = conns.join_next(), if !conns.is_empty() => continue,
            _ = &mut shutdown => break,
        };
        wait_until = None;
        let (slot, probes_only) = match slots.admit() {
            Admit::Serve(s) => (s, false),
            Admit::ProbesOnly(s) => (s, true),
            Admit::Refuse => {
                tracing::debug!(%peer, "connection bound reached: closed at once");
                continue;
            }
        };
        let _ = tcp.set_nodelay(true);
        let handshake = handshake.clone();
        let stop = stop_rx.clone();
        conns.spawn(async move {
            let conn = slot.conn.clone();
            // The handshake counts against the header timeout too.
            let header = limits.header_read_timeout;
            // An evicted connection still in its handshake (TLS) closes at
            // once: its descriptor is what the accept loop waits for.
            let handshaken = tokio::select! {
                r = tokio::time::timeout(header, handshake(tcp, peer)) => r,
                () = conn.until_evicted() => return,
            };
            let Ok(Some((io, svc))) = handshaken else {
                return;
            };
            connection(slot, probes_only, Tracked { io, conn }, svc, limits, stop, peer).await;
        });
    }
    drop(listener);
    let _ = stop_tx.send(true);
    while conns.join_next().await.is_some() {}
    Ok(())
}

/// One connection until it closes, is evicted, times out or is stopped.
async fn connection<IO, S, B>(
    mut slot: Slot,
    probes_only: bool,
    io: Tracked<IO>,
    svc: S,
    limits: Limits,
    mut stop: watch::Receiver<bool>,
    peer: SocketAddr,
) where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    S: tower::Service<Request<TimedBody>, Response = Response<B>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    B: hyper::body::Body + From<String> + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
{
    let conn = slot.conn.clone();
    let svc = Track {
        inner: svc,
        conn: conn.clone(),
        probes_only,
        body_timeout: limits.header_read_timeout,
        metrics: slot.metrics().clone(),
    };
    let mut builder = hyper::server::conn::http1::Builder::new();
    // One probe per reserved connection: it gives its slot back at once.
    builder.timer(TokioTimer::new()).keep_alive(!probes_only);
    let served = builder.serve_connection(TokioIo::new(io), TowerToHyperService::new(svc));
    tokio::pin!(served);
    loop {
        if conn.evicted() || *stop.borrow() {
            if !conn.busy() {
                return;
            }
            served.as_mut().graceful_shutdown();
            break;
        }
        let deadline = conn.deadline(&limits);
        tokio::select! {
            // The connection first: bytes that arrived while the process
            // was paused (SIGSTOP, an overloaded host) are read before a
            // deadline that passed meanwhile is looked at.
            biased;
            r = served.as_mut() => {
                if let Err(e) = r {
                    tracing::debug!(%peer, error = %e, "connection ended with an error");
                }
                return;
            }
            _ = conn.changed.notified() => {}
            _ = stop.changed() => {}
            _ = sleep_until(deadline.map(|d| d.0)) => {
                // Still due after whatever happened meanwhile?
                if let Some((at, reason)) = conn.deadline(&limits) {
                    if at <= std::time::Instant::now() {
                        slot.conn_closed(reason);
                        tracing::debug!(%peer, reason = reason.label(), "connection closed");
                        return;
                    }
                }
            }
        }
    }
    let _ = served.await;
    drop(slot);
}

/// Sleeps until `at`, forever without one.
async fn sleep_until(at: Option<std::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}

/// The service wrapper: marks requests in progress, and answers only
/// probes on a connection of the reserved share.
#[derive(Clone)]
struct Track<S> {
    inner: S,
    conn: Arc<Conn>,
    probes_only: bool,
    /// From the end of the headers to the end of the body.
    body_timeout: Duration,
    metrics: ListenerMetrics,
}

impl<S, B> tower::Service<Request<Incoming>> for Track<S>
where
    S: tower::Service<Request<TimedBody>, Response = Response<B>, Error = Infallible>,
    S::Future: Send + 'static,
    B: From<String> + Send + 'static,
{
    type Response = Response<B>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response<B>, Infallible>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<Incoming>) -> Self::Future {
        if self.probes_only && !PROBE_PATHS.contains(&req.uri().path()) {
            return Box::pin(std::future::ready(Ok(overloaded())));
        }
        let busy = self.conn.start_request();
        let deadline = tokio::time::Instant::now() + self.body_timeout;
        let conn = self.conn.clone();
        let metrics = self.metrics.clone();
        let req = req.map(|inner| TimedBody {
            inner,
            deadline: Box::pin(tokio::time::sleep_until(deadline)),
            conn,
            metrics,
        });
        let answer = self.inner.call(req);
        Box::pin(async move {
            let r = answer.await;
            drop(busy);
            r
        })
    }
}

/// The answer to anything but a probe on a connection of the reserved share.
fn overloaded<B: From<String>>() -> Response<B> {
    let body = r#"{"error":"overloaded","message":"connection bound reached: only /healthz and /readyz are served on this connection"}"#;
    let mut r = Response::new(B::from(body.to_string()));
    *r.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
    let h = r.headers_mut();
    h.insert(hyper::header::CONTENT_TYPE, hyper::header::HeaderValue::from_static("application/json"));
    h.insert(hyper::header::CONNECTION, hyper::header::HeaderValue::from_static("close"));
    h.insert(hyper::header::RETRY_AFTER, hyper::header::HeaderValue::from_static("1"));
    r
}

/// A request's body that fails once it has not arrived in full within the
/// header read timeout counted from the end of the headers (a client that
/// sends its body slowly holds a connection that is not idle, so eviction
/// cannot free it). The handler sees a body error and answers it; hyper
/// then closes the connection, the body being unread.
pub struct TimedBody {
    inner: Incoming,
    deadline: Pin<Box<tokio::time::Sleep>>,
    conn: Arc<Conn>,
    metrics: ListenerMetrics,
}

impl hyper::body::Body for TimedBody {
    type Data = hyper::body::Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<hyper::body::Frame<Self::Data>, Self::Error>>> {
        match Pin::new(&mut self.inner).poll_frame(cx) {
            Poll::Ready(r) => return Poll::Ready(r.map(|f| f.map_err(Into::into))),
            Poll::Pending => {}
        }
        match self.deadline.as_mut().poll(cx) {
            Poll::Ready(()) => {
                self.conn.count_closed(&self.metrics, Reason::HeaderTimeout);
                Poll::Ready(Some(Err("request body not received within the header read timeout".into())))
            }
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

/// A connection's stream, telling its state when bytes arrive.
struct Tracked<IO> {
    io: IO,
    conn: Arc<Conn>,
}

impl<IO: AsyncRead + Unpin> AsyncRead for Tracked<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.io).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.conn.on_read();
        }
        r
    }
}

forward_async_write!(Tracked);
