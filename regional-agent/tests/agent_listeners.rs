//! The agent's listener limits on both ports: a client sending its headers
//! (or its body) a byte at a time is ended at the header read timeout; idle connections
//! beyond the bound stop neither a probe nor a decision; under
//! `ulimit -n 1024` 2,000 connection attempts leave the probes answered and
//! the agent accepting again once they are gone, without a restart; the
//! gRPC port's bound closes the connection over it at once and a silent
//! gRPC client is closed at the header read timeout. Real allocator on
//! PostgreSQL, Redis and agents as processes.

mod common;

use common::World;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use quota_tests::agent::{AgentOpts, AgentProc};
use quota_tests::http::metric;
use quota_tests::listeners::{closed_count, crowd, fresh_client, probe, slow_headers, slow_request};
use serde_json::json;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The HTTP/2 client preface and an empty SETTINGS frame.
const H2_START: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00";

fn host(base: &str) -> String {
    base.trim_start_matches("http://").to_string()
}

async fn metrics(a: &AgentProc) -> String {
    fresh_client()
        .get(format!("{}/metrics", a.base))
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .expect("text")
}

async fn closed_by(a: &AgentProc, listener: &str, reason: &str) -> f64 {
    let name = format!("agent_listener_closed_total{{listener=\"{listener}\",reason=\"{reason}\"}}");
    metric(&metrics(a).await, &name).unwrap_or(0.0)
}

/// One decision on a new connection.
async fn decide(a: &AgentProc) -> Option<u16> {
    let r = fresh_client()
        .post(format!("{}/v1/acquire", a.base))
        .json(&json!({"tenant": "atlas", "resource": "read"}))
        .send()
        .await;
    r.ok().map(|r| r.status().as_u16())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_headers_and_a_slow_body_are_ended_at_the_header_read_timeout() {
    let w = World::start().await;
    let a = w.agent("eu", "eu-1", None, &[("AGENT_HEADER_READ_TIMEOUT_SECS", "1")]).await;
    let took = slow_headers(&host(&a.base), Duration::from_millis(200), Duration::from_secs(5))
        .await
        .expect("a client sending a byte per 200 ms was not closed within 5 s");
    eprintln!("agent closed a slow client after {took:?} (header read timeout 1 s)");
    assert!(took >= Duration::from_millis(900) && took < Duration::from_millis(2500), "{took:?}");
    assert!(closed_by(&a, "http", "header_timeout").await >= 1.0);

    // A body sent a byte every 200 ms gets the same time once the headers
    // are in: answered (an error) then, not held.
    let head = b"POST /v1/acquire HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 200\r\n\r\n";
    let end = slow_request(
        &host(&a.base),
        head,
        b"{\"tenant\": ",
        Duration::from_millis(200),
        Duration::from_secs(5),
    )
    .await
    .expect("a slow body was neither answered nor closed within 5 s");
    eprintln!("agent ended a slow body after {:?}: {:?}", end.after, end.answer);
    assert!(end.after >= Duration::from_millis(900) && end.after < Duration::from_millis(2500), "{end:?}");
    assert!(closed_by(&a, "http", "header_timeout").await >= 2.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_beyond_the_bound_stop_neither_probes_nor_decisions() {
    let w = World::start().await;
    w.policy("atlas", "read", json!({"limit": 1000, "window_secs": 3600})).await;
    // Timeouts long enough that only the bound frees anything here.
    let a = w
        .agent(
            "eu",
            "eu-1",
            None,
            &[
                ("AGENT_MAX_CONNECTIONS", "16"),
                ("AGENT_HEADER_READ_TIMEOUT_SECS", "30"),
                ("AGENT_IDLE_TIMEOUT_SECS", "60"),
            ],
        )
        .await;
    let mut held = crowd(&host(&a.base), 64).await;
    assert_eq!(held.len(), 64, "every connection attempt connected");
    let client = fresh_client();
    for path in ["/healthz", "/readyz"] {
        for i in 0..5 {
            let url = format!("{}{path}", a.base);
            assert_eq!(probe(&client, &url).await, Some(200), "{path} {i} with 64 idle connections held");
        }
    }
    assert_eq!(decide(&a).await, Some(200), "a decision with 64 idle connections held");
    let closed = closed_count(&mut held).await;
    assert!(closed >= 64 - 16, "only {closed} of 64 closed");
    assert!(closed_by(&a, "http", "bound").await >= 48.0);
}

/// A log without its colour escapes.
fn plain(log: &str) -> String {
    let mut out = String::with_capacity(log.len());
    let mut chars = log.chars();
    while let Some(c) = chars.next() {
        if c == '\x1b' {
            for c in chars.by_ref() {
                if c == 'm' {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// An agent whose process runs under `ulimit -n 1024` (soft and hard), with
/// its gRPC port on too.
async fn agent_at_1024_files(w: &World, dir: &std::path::Path, grpc: &str) -> AgentProc {
    let script = dir.join("agent-1024.sh");
    std::fs::write(
        &script,
        format!("#!/bin/sh\nulimit -n 1024\nexec '{}' \"$@\"\n", common::bin().display()),
    )
    .expect("script");
    std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755)).expect("chmod");
    let mut opts = AgentOpts::new("eu", "eu-1", &w.stack.alloc.base, w.redis_url());
    opts.env.push(("AGENT_GRPC_LISTEN".into(), grpc.into()));
    AgentProc::spawn(&script, opts).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_ulimit_1024_two_thousand_connections_leave_probes_answered_and_the_agent_recovers() {
    let w = World::start().await;
    w.policy("atlas", "read", json!({"limit": 100000, "window_secs": 3600})).await;
    let dir = tempfile::tempdir().expect("dir");
    let grpc = format!("127.0.0.1:{}", quota_tests::free_port());
    let a = agent_at_1024_files(&w, dir.path(), &grpc).await;
    let log = plain(&a.log());
    assert!(log.contains("open-file limit") && log.contains("hard=1024"), "{log}");
    assert!(log.contains("connection bounds lowered"), "{log}");

    // 2,000 connection attempts (every other one with half a request head)
    // while a probe runs every 50 ms on a new connection.
    let crowd_task = tokio::spawn({
        let addr = host(&a.base);
        async move { crowd(&addr, 2000).await }
    });
    let client = fresh_client();
    let (mut asked, mut answered, mut slowest) = (0, 0, Duration::ZERO);
    let started = Instant::now();
    while !crowd_task.is_finished() {
        asked += 1;
        let t = Instant::now();
        if probe(&client, &format!("{}/healthz", a.base)).await == Some(200) {
            answered += 1;
        }
        slowest = slowest.max(t.elapsed());
    }
    let mut held = crowd_task.await.expect("crowd");
    eprintln!(
        "2,000 attempts in {:?}: {} connected; probes during the crowd: {answered}/{asked} answered, slowest {slowest:?}",
        started.elapsed(),
        held.len()
    );
    assert_eq!(answered, asked, "probes refused during the crowd");
    // With the crowd held: probes and a decision, each on a new connection.
    let (mut at_bound, mut slowest) = (0, Duration::ZERO);
    for i in 0..20 {
        let path = if i % 2 == 0 { "/healthz" } else { "/readyz" };
        let t = Instant::now();
        if probe(&client, &format!("{}{path}", a.base)).await == Some(200) {
            at_bound += 1;
        }
        slowest = slowest.max(t.elapsed());
    }
    eprintln!("probes with the crowd held: {at_bound}/20 answered, slowest {slowest:?}");
    assert_eq!(at_bound, 20);
    assert_eq!(decide(&a).await, Some(200));
    let text = metrics(&a).await;
    let open = metric(&text, "agent_listener_connections{listener=\"http\"}").expect("gauge");
    assert!(open < 1024.0 - 128.0, "{open} open");
    assert!(!a.log().contains("Too many open files"), "{}", a.log());
    let closed = closed_count(&mut held).await;
    assert!(closed > 1000, "only {closed} of the crowd closed");

    // The crowd goes away: the agent accepts new connections again without
    // a restart (the same process).
    let pid = a.pid();
    drop(held);
    quota_tests::wait::until("the crowd's connections closed", Duration::from_secs(10), || {
        let a = &a;
        async move {
            let text = metrics(a).await;
            let open = metric(&text, "agent_listener_connections{listener=\"http\"}")?;
            (open <= 2.0).then_some(())
        }
    })
    .await;
    let mut again = crowd(&host(&a.base), 100).await;
    assert_eq!(again.len(), 100);
    assert_eq!(closed_count(&mut again).await, 0, "new connections under the bound are kept");
    assert_eq!(probe(&client, &format!("{}/healthz", a.base)).await, Some(200));
    assert_eq!(decide(&a).await, Some(200));
    assert_eq!(a.pid(), pid);
}

/// A raw connection to the gRPC port that sent the HTTP/2 preface: `true`
/// when the server answered with its SETTINGS (admitted), `false` when it
/// closed the connection (over the bound).
async fn h2_admitted(addr: &str) -> (bool, TcpStream) {
    let mut c = TcpStream::connect(addr).await.expect("connect");
    c.write_all(H2_START).await.expect("preface");
    let mut buf = [0u8; 64];
    let r = tokio::time::timeout(Duration::from_secs(2), c.read(&mut buf)).await;
    (matches!(r, Ok(Ok(n)) if n > 0), c)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_grpc_port_closes_connections_over_its_bound_and_silent_clients() {
    let w = World::start().await;
    let addr = format!("127.0.0.1:{}", quota_tests::free_port());
    let a = w
        .agent(
            "eu",
            "eu-1",
            None,
            &[
                ("AGENT_GRPC_LISTEN", &addr),
                ("AGENT_GRPC_MAX_CONNECTIONS", "8"),
                ("AGENT_HEADER_READ_TIMEOUT_SECS", "1"),
            ],
        )
        .await;
    let mut held = Vec::new();
    for i in 0..8 {
        let (ok, c) = h2_admitted(&addr).await;
        assert!(ok, "connection {i} under the bound");
        held.push(c);
    }
    let started = Instant::now();
    let (ok, _) = h2_admitted(&addr).await;
    assert!(!ok, "the ninth connection was served");
    assert!(started.elapsed() < Duration::from_millis(500), "not closed at once: {:?}", started.elapsed());
    assert!(closed_by(&a, "grpc", "bound").await >= 1.0);

    // One goes away: an RLS call is served again. The server notices the
    // close on its own time, so a connection made before it did is still
    // over the bound and reset: the call is retried until the deadline.
    held.pop();
    let r = quota_tests::wait::until("an RLS call served", Duration::from_secs(5), || {
        let url = format!("http://{addr}");
        async move {
            let mut client = RateLimitServiceClient::connect(url).await.ok()?;
            let req = RateLimitRequest { domain: "atlas".into(), descriptors: vec![], hits_addend: 1 };
            let call = tokio::time::timeout(Duration::from_secs(1), client.should_rate_limit(req));
            call.await.ok()?.ok().map(|r| r.into_inner())
        }
    })
    .await;
    assert_eq!(r.overall_code, Code::Ok as i32);
    drop(held);
    // The server sees those connections end on its own time: wait until
    // none is counted, or the silent client below would meet the bound.
    quota_tests::wait::until("the gRPC connections to close", Duration::from_secs(5), || async {
        let open = metric(&metrics(&a).await, "agent_listener_connections{listener=\"grpc\"}");
        (open == Some(0.0)).then_some(())
    })
    .await;

    // A client that connects and sends nothing is closed at the header
    // read timeout (no HTTP/2 preface).
    let mut silent = TcpStream::connect(&addr).await.expect("connect");
    let started = Instant::now();
    let mut buf = [0u8; 64];
    let end = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            match silent.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {} // the server's SETTINGS
            }
        }
    })
    .await;
    assert!(end.is_ok(), "a silent gRPC client was not closed within 5 s");
    let took = started.elapsed();
    assert!(took >= Duration::from_millis(900) && took < Duration::from_millis(2500), "{took:?}");
    assert!(closed_by(&a, "grpc", "header_timeout").await >= 1.0);
}
