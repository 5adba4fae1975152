//! The RLS benchmark's client: one HTTP/2 connection (the `h2` crate),
//! each concurrent call a stream of it, the request's gRPC message framed
//! once and sent with its headers in one write, as Envoy's codec calls its
//! rate limit service (and as the HTTP bench sends a JSON body built once).
//!
//! Not tonic's `Channel`: it puts a buffer task, a reconnect layer and a
//! body task (headers and message in two writes) between the call and the
//! connection, and on a 2-core machine that client's cost is taken from the
//! agent measured beside it. In one run (2026-12-07, 16 streams) the gRPC
//! floor, `Health/Check` of the same agent, was 29,113/s through a tonic
//! `Channel` and 41,531/s through this client (`ShouldRateLimit`: 14,282/s
//! and 15,253/s).

use bytes::{BufMut, Bytes, BytesMut};
use std::time::{Duration, Instant};

/// A connection's sending half (cheap to clone: one per concurrent call).
#[derive(Clone)]
pub struct H2 {
    send: h2::client::SendRequest<Bytes>,
    authority: String,
}

/// Connects to `addr` (retrying until `within` has passed: the agent may
/// still be binding) and hands the connection to a task of its own.
pub async fn connect(addr: &str, within: Duration) -> Result<H2, String> {
    let deadline = Instant::now() + within;
    let tcp = loop {
        match tokio::time::timeout(within, tokio::net::TcpStream::connect(addr)).await {
            Ok(Ok(tcp)) => break tcp,
            _ if Instant::now() >= deadline => return Err(format!("RLS at {addr}: no connection")),
            _ => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    };
    tcp.set_nodelay(true).map_err(|e| format!("RLS at {addr}: {e}"))?;
    let (send, conn) = tokio::time::timeout(within, h2::client::handshake(tcp))
        .await
        .map_err(|_| format!("RLS at {addr}: HTTP/2 handshake timed out"))?
        .map_err(|e| format!("RLS at {addr}: {e}"))?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(H2 { send, authority: addr.to_string() })
}

/// `msg` as one gRPC message frame (uncompressed).
pub fn frame(msg: &impl prost::Message) -> Bytes {
    let mut b = BytesMut::with_capacity(5 + msg.encoded_len());
    b.put_u8(0);
    b.put_u32(msg.encoded_len() as u32);
    msg.encode(&mut b).expect("a BytesMut grows");
    b.freeze()
}

impl H2 {
    /// Calls `path` with the framed request `body`; the answer's message
    /// (its frame's payload), after checking `grpc-status` is 0.
    pub async fn unary(&self, path: &str, body: Bytes) -> Result<Bytes, String> {
        let mut send = self.send.clone().ready().await.map_err(|e| format!("{path}: {e}"))?;
        let req = http::Request::post(format!("http://{}{path}", self.authority))
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .body(())
            .map_err(|e| format!("{path}: {e}"))?;
        let (resp, mut stream) = send.send_request(req, false).map_err(|e| format!("{path}: {e}"))?;
        stream.send_data(body, true).map_err(|e| format!("{path}: {e}"))?;
        let resp = resp.await.map_err(|e| format!("{path}: {e}"))?;
        let (head, mut body) = resp.into_parts();
        if head.status != http::StatusCode::OK {
            return Err(format!("{path}: HTTP status {}", head.status));
        }
        let mut got = BytesMut::new();
        while let Some(chunk) = body.data().await {
            let chunk = chunk.map_err(|e| format!("{path}: {e}"))?;
            let _ = body.flow_control().release_capacity(chunk.len());
            got.extend_from_slice(&chunk);
        }
        let trailers = body.trailers().await.map_err(|e| format!("{path}: {e}"))?;
        let status = trailers
            .as_ref()
            .and_then(|t| t.get("grpc-status"))
            .or_else(|| head.headers.get("grpc-status"))
            .and_then(|v| v.to_str().ok())
            .unwrap_or("none")
            .to_string();
        if status != "0" {
            return Err(format!("{path}: grpc-status {status}"));
        }
        if got.len() < 5 {
            return Err(format!("{path}: no message in the answer"));
        }
        Ok(got.freeze().slice(5..))
    }
}
