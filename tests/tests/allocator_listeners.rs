//! The allocator's listener limits (plain HTTP and TLS share one accept
//! loop): a client sending its headers a byte at a time is closed at the
//! header read timeout, an idle kept-alive connection at the idle timeout,
//! and idle connections beyond the bound stop neither a probe nor a grant.

use quota_shared::listen::Limits;
use quota_tests::app::{Options, TlsFiles};
use quota_tests::fixtures::{grant, grant_body, put_policy, register, Stack};
use quota_tests::http::metric;
use quota_tests::listeners::{closed_count, crowd, fresh_client, probe, slow_headers};
use quota_tests::tls::{write, Ca};
use serde_json::json;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn limits(header_secs: u64, idle_secs: u64, max: usize) -> Limits {
    Limits {
        header_read_timeout: Duration::from_secs(header_secs),
        idle_timeout: Duration::from_secs(idle_secs),
        max_connections: max,
    }
}

async fn stack(limits: Limits) -> Stack {
    Stack::with(Options { limits: Some(limits), ..Default::default() }).await
}

fn addr(base: &str) -> String {
    base.rsplit("//").next().expect("host:port").replace("localhost", "127.0.0.1")
}

async fn closed_by(s: &Stack, reason: &str) -> f64 {
    let text = raw_metrics(&s.alloc.base).await;
    metric(&text, &format!("allocator_listener_closed_total{{listener=\"http\",reason=\"{reason}\"}}"))
        .unwrap_or(0.0)
}

async fn raw_metrics(base: &str) -> String {
    fresh_client().get(format!("{base}/metrics")).send().await.expect("metrics").text().await.expect("text")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_headers_are_closed_at_the_header_read_timeout() {
    let s = stack(limits(1, 30, 64)).await;
    let took = slow_headers(&addr(&s.alloc.base), Duration::from_millis(200), Duration::from_secs(5))
        .await
        .expect("a client sending a byte per 200 ms was not closed within 5 s");
    eprintln!("allocator closed a slow client after {took:?} (header read timeout 1 s)");
    assert!(took >= Duration::from_millis(900) && took < Duration::from_millis(2500), "{took:?}");
    assert!(closed_by(&s, "header_timeout").await >= 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_kept_alive_connection_is_closed_at_the_idle_timeout() {
    let s = stack(limits(5, 1, 64)).await;
    let mut c = tokio::net::TcpStream::connect(addr(&s.alloc.base)).await.expect("connect");
    c.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n").await.expect("write");
    let mut buf = [0u8; 1024];
    let n = c.read(&mut buf).await.expect("answer");
    assert!(buf[..n].starts_with(b"HTTP/1.1 200"), "{}", String::from_utf8_lossy(&buf[..n]));
    let answered = Instant::now();
    let end =
        tokio::time::timeout(Duration::from_secs(5), c.read(&mut buf)).await.expect("closed within 5 s");
    assert!(matches!(end, Ok(0) | Err(_)), "{end:?}");
    let took = answered.elapsed();
    assert!(took >= Duration::from_millis(900) && took < Duration::from_millis(2500), "{took:?}");
    assert!(closed_by(&s, "idle").await >= 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_beyond_the_bound_stop_neither_probes_nor_grants() {
    // Timeouts long enough that only the bound frees anything here.
    let s = stack(limits(30, 60, 16)).await;
    put_policy(&s.http, "atlas", "read", json!({"limit": 100, "window_secs": 3600})).await;
    let epoch = register(&s.http, "eu", "eu-1").await;
    let mut held = crowd(&addr(&s.alloc.base), 64).await;
    assert_eq!(held.len(), 64, "every connection attempt connected");
    let client = fresh_client();
    let health = format!("{}/healthz", s.alloc.base);
    for i in 0..10 {
        assert_eq!(probe(&client, &health).await, Some(200), "probe {i} with 64 idle connections held");
    }
    let r = grant(&s.http, &grant_body("atlas", "read", "eu", "eu-1", epoch, 1, 10, 1.0)).await.expect(200);
    assert_eq!(r.body["tokens"], json!(10));
    // The crowd was thinned to the bound, oldest first.
    let closed = closed_count(&mut held).await;
    assert!(closed >= 64 - 16, "only {closed} of 64 closed");
    let text = raw_metrics(&s.alloc.base).await;
    let open = metric(&text, "allocator_listener_connections{listener=\"http\"}").expect("gauge");
    assert!(open <= 16.0 + 1.0, "{open} open");
    assert!(closed_by(&s, "bound").await >= 48.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_tls_a_silent_client_is_closed_at_the_header_read_timeout_not_the_handshake_one() {
    let dir = tempfile::tempdir().expect("dir");
    let ca = Ca::new("test CA");
    let leaf = ca.server("localhost", 2);
    let files = TlsFiles {
        cert: write(dir.path(), "cert.pem", &leaf.cert_pem),
        key: write(dir.path(), "key.pem", &leaf.key_pem),
        client_ca: None,
    };
    let opts = Options { tls: Some(files), limits: Some(limits(1, 30, 64)), ..Default::default() };
    let s = Stack::with(opts).await;
    let mut c = tokio::net::TcpStream::connect(addr(&s.alloc.base)).await.expect("connect");
    let started = Instant::now();
    let mut buf = [0u8; 64];
    let end =
        tokio::time::timeout(Duration::from_secs(5), c.read(&mut buf)).await.expect("closed within 5 s");
    assert!(matches!(end, Ok(0) | Err(_)), "{end:?}");
    assert!(started.elapsed() < Duration::from_millis(2500), "{:?}", started.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_every_connection_busy_a_reserved_share_still_answers_probes() {
    // 16 connections: 15 for everyone, 1 kept for probes.
    let s = stack(limits(30, 60, 16)).await;
    // `Expect: 100-continue`: the server answers `100 Continue` once the
    // handler reads the body, i.e. once the request is in progress. Until
    // then a connection is still being read and may be evicted as the
    // longest idle by the next one (by design), so each is awaited before
    // the next connects.
    let head = b"POST /v1/grants HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\nExpect: 100-continue\r\n\r\n";
    let mut busy = Vec::new();
    for _ in 0..15 {
        let mut c = tokio::net::TcpStream::connect(addr(&s.alloc.base)).await.expect("connect");
        c.write_all(head).await.expect("head");
        let mut buf = [0u8; 64];
        let n = tokio::time::timeout(Duration::from_secs(5), c.read(&mut buf))
            .await
            .expect("100 Continue within 5 s")
            .expect("read");
        assert!(buf[..n].starts_with(b"HTTP/1.1 100"), "{:?}", String::from_utf8_lossy(&buf[..n]));
        c.write_all(b"{").await.expect("first body byte");
        busy.push(c);
    }
    // Once their headers are read, all 15 have a request in progress (each
    // waits for the rest of its body): a new connection gets the reserved
    // slot, which serves probes only.
    let client = fresh_client();
    let other = format!("{}/v1/policies/atlas/read", s.alloc.base);
    let r =
        quota_tests::wait::until("a non-probe refused on the reserved slot", Duration::from_secs(5), || {
            let (client, other) = (client.clone(), other.clone());
            async move {
                let r = client.get(&other).send().await.ok()?;
                (r.status().as_u16() == 503).then_some(r)
            }
        })
        .await;
    assert_eq!(r.headers().get("connection").and_then(|v| v.to_str().ok()), Some("close"));
    let body: serde_json::Value = r.json().await.expect("json");
    assert_eq!(body["error"], json!("overloaded"));
    for path in ["/healthz", "/readyz", "/healthz"] {
        assert_eq!(probe(&client, &format!("{}{path}", s.alloc.base)).await, Some(200), "{path}");
    }
    assert_eq!(closed_count(&mut busy).await, 0, "busy connections are never evicted");
}
