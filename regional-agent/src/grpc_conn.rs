//! The gRPC port's connections (`--grpc-listen`) within the listener
//! limits: each accepted stream takes a slot of `--grpc-max-connections`
//! (closed at once when there is none) and closes itself when the client
//! has not sent the HTTP/2 preface within `--header-read-timeout-secs` or
//! has sent nothing for `--idle-timeout-secs` (see
//! `quota_shared::listen::stream`). tonic's server owns the connections, so
//! the limits live in the stream it is handed. One accept loop hands the
//! connections in turn to the gRPC threads (see [`crate::rls::serve`]).

use quota_shared::listen::slots::Slots;
use quota_shared::listen::stream::Guarded;
use quota_shared::listen::{Limits, ListenerMetrics};
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tonic::codegen::tokio_stream::wrappers::ReceiverStream;
use tonic::transport::server::{Connected, TcpConnectInfo};

/// Accepted connections waiting for the server to take them.
const QUEUE: usize = 64;

/// One admitted gRPC connection; its slot is given back when tonic drops it.
pub struct GrpcConn(Guarded<TcpStream>);

impl Connected for GrpcConn {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        self.0.get_ref().connect_info()
    }
}

/// The admitted connections of `listener` as `n` streams (at least one),
/// each for one server's `serve_with_incoming`, dealt in turn: the accept
/// loop ends when every server has dropped its stream (at shutdown).
pub fn incoming(
    listener: TcpListener,
    limits: Limits,
    metrics: ListenerMetrics,
    n: usize,
) -> Vec<ReceiverStream<io::Result<GrpcConn>>> {
    let slots = Slots::plain(limits.max_connections, metrics);
    let (txs, rxs): (Vec<_>, Vec<_>) = (0..n.max(1)).map(|_| mpsc::channel(QUEUE)).unzip();
    tokio::spawn(async move {
        let mut next = 0;
        loop {
            // Each in turn: done once every one is closed.
            let all_closed = async {
                for tx in &txs {
                    tx.closed().await;
                }
            };
            let tcp = tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok((tcp, _)) => tcp,
                    Err(e) => {
                        // Out of file descriptors and the like: back off.
                        tracing::warn!(error = %e, "gRPC accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
                _ = all_closed => return,
            };
            // Without TCP_NODELAY a small answer waits for the client's
            // delayed ACK (40 ms on Linux): measured as a 42 ms p99 at 16 streams.
            let _ = tcp.set_nodelay(true);
            let Some(conn) = Guarded::admit(tcp, &slots, limits) else {
                tracing::debug!("gRPC connection bound reached: closed at once");
                continue;
            };
            // The next server that still serves (one that stopped early
            // gets no more); none left is the shutdown.
            let mut conn = Ok(GrpcConn(conn));
            for _ in 0..txs.len() {
                let tx = &txs[next];
                next = (next + 1) % txs.len();
                match tx.send(conn).await {
                    Ok(()) => break,
                    Err(back) => conn = back.0,
                }
            }
        }
    });
    rxs.into_iter().map(ReceiverStream::new).collect()
}

impl AsyncRead for GrpcConn {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl AsyncWrite for GrpcConn {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.0.is_write_vectored()
    }
}
