//! Envoy's rate limit service on the agent (`--grpc-listen`), driven by
//! the client `envoy-types` generates from Envoy's own `rls.proto` (not by
//! the server's code): quotas, per-user limits, `hits_addend`, descriptors
//! decided atomically, unknown descriptors, partitions, the health service,
//! and gRPC and HTTP decisions sharing one pool. Real allocator on
//! PostgreSQL, Redis and agents as processes.

mod common;

use common::World;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::UInt64Value;
use quota_tests::agent::AgentProc;
use quota_tests::proxy::{Fault, FaultProxy};
use serde_json::json;
use std::time::Duration;
use tonic::transport::Channel;

type Client = RateLimitServiceClient<Channel>;

/// An agent serving RLS (with headers) on a free port, and a client for it.
async fn rls_agent(w: &World, id: &str, allocator: Option<&str>) -> (AgentProc, Client, String) {
    let port = quota_tests::free_port();
    let addr = format!("127.0.0.1:{port}");
    let a =
        w.agent("eu", id, allocator, &[("AGENT_GRPC_LISTEN", &addr), ("AGENT_RLS_HEADERS", "true")]).await;
    let url = format!("http://{addr}");
    let c = client(&url).await;
    (a, c, url)
}

async fn client(url: &str) -> Client {
    quota_tests::wait::until("the RLS port accepts", Duration::from_secs(20), || {
        let url = url.to_string();
        async move { RateLimitServiceClient::connect(url).await.ok() }
    })
    .await
}

fn d(entries: &[(&str, &str)], hits: Option<u64>) -> RateLimitDescriptor {
    RateLimitDescriptor {
        entries: entries.iter().map(|(k, v)| Entry { key: k.to_string(), value: v.to_string() }).collect(),
        hits_addend: hits.map(|value| UInt64Value { value }),
        ..Default::default()
    }
}

async fn ask(
    c: &Client,
    descriptors: Vec<RateLimitDescriptor>,
    hits: u32,
) -> Result<RateLimitResponse, tonic::Status> {
    let mut c = c.clone();
    let req = RateLimitRequest { domain: "atlas".into(), descriptors, hits_addend: hits };
    tokio::time::timeout(Duration::from_secs(10), c.should_rate_limit(req))
        .await
        .expect("ShouldRateLimit answers within 10 s")
        .map(|r| r.into_inner())
}

fn header<'a>(r: &'a RateLimitResponse, name: &str) -> Option<&'a str> {
    r.response_headers_to_add.iter().find(|h| h.key == name).map(|h| h.value.as_str())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ok_then_over_limit_at_the_quota_and_unknown_descriptors_are_not_limited() {
    let w = World::start().await;
    w.policy(
        "atlas",
        "read",
        json!({"limit": 5, "window_secs": 3600, "fail_mode": "strict", "chunk_max": 5}),
    )
    .await;
    let (_a, c, _) = rls_agent(&w, "eu-1", None).await;
    let read = || vec![d(&[("resource", "read"), ("path", "/items")], None)];
    for _ in 0..5 {
        let r = ask(&c, read(), 0).await.expect("OK");
        assert_eq!(r.overall_code, Code::Ok as i32, "{r:?}");
        let s = &r.statuses[0];
        let limit = s.current_limit.as_ref().expect("current_limit");
        assert_eq!((limit.requests_per_unit, limit.unit), (5, Unit::Hour as i32), "{r:?}");
        // The region's balance, as `remaining` over HTTP: at most what is left of 5.
        assert!(s.limit_remaining < 5, "{r:?}");
        assert!(s.duration_until_reset.is_some_and(|d| d.seconds > 0 && d.seconds <= 3600), "{r:?}");
        assert_eq!(header(&r, "ratelimit-policy"), Some("\"atlas/read\";q=5;w=3600"), "{r:?}");
        assert_eq!(header(&r, "quota-policy-version"), Some("1"), "{r:?}");
    }
    let r = ask(&c, read(), 0).await.expect("an answer");
    assert_eq!(r.overall_code, Code::OverLimit as i32, "{r:?}");
    assert_eq!(header(&r, "quota-policy-version"), Some("1"), "the refusal names its version: {r:?}");
    assert_eq!(r.statuses[0].code, Code::OverLimit as i32);
    assert!(header(&r, "retry-after").and_then(|v| v.parse::<i64>().ok()).is_some_and(|s| s >= 1), "{r:?}");

    // A descriptor without a resource entry, and one naming a quota with no
    // policy: OK, and no state in Redis for the unknown name (F14).
    let r = ask(&c, vec![d(&[("generic_key", "x")], None), d(&[("resource", "nope")], None)], 0)
        .await
        .expect("OK");
    assert_eq!(r.overall_code, Code::Ok as i32, "{r:?}");
    assert!(r.statuses.iter().all(|s| s.code == Code::Ok as i32 && s.current_limit.is_none()), "{r:?}");
    let client = redis::Client::open(w.redis_url()).expect("redis url");
    let mut conn = client.get_multiplexed_async_connection().await.expect("redis");
    let keys: Vec<String> = redis::cmd("KEYS").arg("*nope*").query_async(&mut conn).await.expect("KEYS");
    assert!(keys.is_empty(), "{keys:?}");
    // Invalid input names itself.
    let e = ask(&c, vec![d(&[("resource", "a b")], None)], 0).await.expect_err("invalid");
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("descriptor 0"), "{e:?}");
    w.wait_consumed("read", 5).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_per_user_limit_and_hits_addend_at_both_levels() {
    let w = World::start().await;
    w.policy(
        "atlas",
        "write",
        json!({"limit": 1000, "window_secs": 3600, "per_key": {"rate_per_sec": 0.001, "burst": 5}}),
    )
    .await;
    let (a, c, _) = rls_agent(&w, "eu-1", None).await;
    let as_user = |u: &str, hits| vec![d(&[("resource", "write"), ("user", u)], hits)];
    // Request-level hits_addend 2, then a descriptor-level 3 overriding the
    // request's 4: u1's bucket of 5 is spent.
    assert_eq!(ask(&c, as_user("u1", None), 2).await.expect("OK").overall_code, Code::Ok as i32);
    assert_eq!(ask(&c, as_user("u1", Some(3)), 4).await.expect("OK").overall_code, Code::Ok as i32);
    let r = ask(&c, as_user("u1", None), 0).await.expect("an answer");
    assert_eq!(r.overall_code, Code::OverLimit as i32, "{r:?}");
    assert_eq!(r.statuses[0].limit_remaining, 0, "{r:?}");
    assert_eq!(header(&r, "ratelimit-policy"), Some("\"atlas/write/per_key\";q=5;w=5000"), "{r:?}");
    // Another user is another bucket.
    assert_eq!(ask(&c, as_user("u2", None), 0).await.expect("OK").overall_code, Code::Ok as i32);
    // A quota with a per-key limit and no user, or a cost above the burst:
    // refusals, not errors (Envoy would let an error through unless
    // failure_mode_deny is set), with the reason.
    for (descriptors, reason) in [
        (vec![d(&[("generic_key", "x")], None), d(&[("resource", "write")], None)], "principal_missing"),
        (vec![d(&[("resource", "write"), ("user", "u3")], Some(6))], "cost_above_burst"),
        (vec![d(&[("resource", "write"), ("user", "u3")], Some(1001))], "cost_above_limit"),
        (vec![d(&[("resource", "write"), ("user", "u3")], Some(u64::MAX))], "cost_above_limit"),
    ] {
        let n = descriptors.len();
        let r = ask(&c, descriptors, 0).await.expect("a refusal, not an error");
        assert_eq!(r.overall_code, Code::OverLimit as i32, "{reason}: {r:?}");
        assert_eq!(r.statuses[n - 1].code, Code::OverLimit as i32, "{reason}: {r:?}");
        assert!(n == 1 || r.statuses[0].code == Code::Ok as i32, "{reason}: {r:?}");
        assert_eq!(header(&r, "x-quota-refused"), Some(reason), "{r:?}");
    }
    let m = a.http.get("/metrics").await.expect(200).body.as_str().unwrap_or_default().to_string();
    for (reason, n) in [("principal_missing", 1.0), ("cost_above_burst", 1.0), ("cost_above_limit", 2.0)] {
        let series = format!("agent_rls_policy_refusals_total{{reason=\"{reason}\"}}");
        assert_eq!(quota_tests::http::metric(&m, &series), Some(n), "{series}");
    }
    // 2 + 3 + 1: the refusals debited nothing.
    w.wait_consumed("write", 6).await;
}

/// Bytes that are not a `RateLimitRequest` (invalid UTF-8 in `domain`,
/// field 1), sent as they are: tonic's own codec would answer INTERNAL.
mod raw {
    use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
    use tonic::codegen::Bytes;
    use tonic::Status;

    pub struct RawCodec;
    pub struct Raw;

    impl Encoder for Raw {
        type Item = Vec<u8>;
        type Error = Status;
        fn encode(&mut self, item: Vec<u8>, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
            bytes::BufMut::put_slice(dst, &item);
            Ok(())
        }
    }

    impl Decoder for Raw {
        type Item = Bytes;
        type Error = Status;
        fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Bytes>, Status> {
            let n = bytes::Buf::remaining(src);
            Ok(Some(bytes::Buf::copy_to_bytes(src, n)))
        }
    }

    impl Codec for RawCodec {
        type Encode = Vec<u8>;
        type Decode = Bytes;
        type Encoder = Raw;
        type Decoder = Raw;
        fn encoder(&mut self) -> Raw {
            Raw
        }
        fn decoder(&mut self) -> Raw {
            Raw
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_requests_are_invalid_argument_with_bounded_messages() {
    let w = World::start().await;
    w.policy("atlas", "read", json!({"limit": 100, "window_secs": 3600})).await;
    let (_a, c, url) = rls_agent(&w, "eu-1", None).await;

    // The resource entry twice: which one was meant is not guessed.
    let e = ask(&c, vec![d(&[("resource", "read"), ("resource", "write")], None)], 0)
        .await
        .expect_err("a repeated entry");
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("\"resource\" is given twice"), "{e:?}");

    // A 1 MB domain: named, not echoed whole.
    let mut big = c.clone();
    let req = RateLimitRequest { domain: "a".repeat(1 << 20), descriptors: vec![], hits_addend: 0 };
    let e = big.should_rate_limit(req).await.expect_err("a domain too long");
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(e.message().len() <= 1024 && e.message().starts_with("domain"), "{} bytes", e.message().len());

    // Invalid UTF-8 in the domain (field 1, length-delimited).
    let channel = tonic::transport::Endpoint::from_shared(url).unwrap().connect().await.unwrap();
    let mut g = tonic::client::Grpc::new(channel);
    g.ready().await.unwrap();
    let path = tonic::codegen::http::uri::PathAndQuery::from_static(
        "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit",
    );
    let bytes = vec![0x0a, 0x03, b'a', 0xff, 0xfe];
    let e = g.unary(tonic::Request::new(bytes), path, raw::RawCodec).await.expect_err("undecodable");
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");

    // And the service still decides.
    let r = ask(&c, vec![d(&[("resource", "read")], None)], 0).await.expect("OK");
    assert_eq!(r.overall_code, Code::Ok as i32, "{r:?}");
}

/// Two descriptors of one request, 16 concurrent streams over two agents,
/// until `search` (40) is exhausted: never one quota debited without the
/// other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_descriptors_are_decided_atomically_under_concurrency() {
    let w = World::start().await;
    common::catalog_and_search(&w).await;
    let (_a, ca, _) = rls_agent(&w, "eu-1", None).await;
    let (_b, cb, _) = rls_agent(&w, "eu-2", None).await;
    let mut tasks = Vec::new();
    for i in 0..16 {
        let c = if i % 2 == 0 { ca.clone() } else { cb.clone() };
        tasks.push(tokio::spawn(async move {
            let both = || {
                let both = vec![d(&[("resource", "catalog")], None), d(&[("resource", "search")], None)];
                let c = c.clone();
                async move { ask(&c, both, 0).await.expect("an answer") }
            };
            let answers = common::until_refused(3, both, |r| r.overall_code == Code::Ok as i32).await;
            let mut ok = 0;
            for r in answers {
                if r.overall_code == Code::Ok as i32 {
                    ok += 1;
                } else {
                    assert_eq!(r.statuses[1].code, Code::OverLimit as i32, "{r:?}");
                }
            }
            ok
        }));
    }
    let mut ok = 0;
    for t in tasks {
        ok += t.await.unwrap();
    }
    assert_eq!(ok, 40, "search's pool admits exactly its limit");
    w.wait_consumed("search", 40).await;
    w.wait_consumed("catalog", 40).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_strict_partition_is_unavailable_with_the_reason() {
    let w = World::start().await;
    w.policy(
        "atlas",
        "s",
        json!({"limit": 1000, "window_secs": 3600, "fail_mode": "strict", "chunk_min": 1, "chunk_max": 5}),
    )
    .await;
    let sw = FaultProxy::in_front_of(&w.stack.alloc.base).await.expect("fault proxy");
    let (_a, c, _) = rls_agent(&w, "eu-1", Some(&sw.http_url())).await;
    assert_eq!(
        ask(&c, vec![d(&[("resource", "s")], None)], 0).await.expect("OK").overall_code,
        Code::Ok as i32
    );
    sw.set(Fault::Blackhole);
    // The region's leases run out; then the agent cannot decide.
    let mut last = None;
    for _ in 0..50 {
        match ask(&c, vec![d(&[("resource", "s")], None)], 0).await {
            Ok(r) => assert_eq!(r.overall_code, Code::Ok as i32, "no OVER_LIMIT while unreachable: {r:?}"),
            Err(e) => {
                last = Some(e);
                break;
            }
        }
    }
    let e = last.expect("UNAVAILABLE once the leases are spent");
    assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
    assert!(e.message().contains("unreachable"), "{e:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_is_serving_and_not_serving_while_redis_is_unusable() {
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::{health_check_response::ServingStatus, HealthCheckRequest};
    let w = World::start().await;
    let (_a, _c, url) = rls_agent(&w, "eu-1", None).await;
    let channel = Channel::from_shared(url).expect("url").connect().await.expect("health channel");
    let health = HealthClient::new(channel);
    let status = |service: &'static str| {
        let mut h = health.clone();
        async move {
            let req = HealthCheckRequest { service: service.into() };
            tokio::time::timeout(Duration::from_secs(5), h.check(req))
                .await
                .ok()
                .and_then(|r| r.ok())
                .map(|r| r.into_inner().status)
        }
    };
    let wait_for = |want: ServingStatus| async move {
        quota_tests::wait::until("health status", Duration::from_secs(20), || async move {
            let all = (status("").await, status("envoy.service.ratelimit.v3.RateLimitService").await);
            (all == (Some(want as i32), Some(want as i32))).then_some(())
        })
        .await
    };
    wait_for(ServingStatus::Serving).await;
    w.redis.signal(libc::SIGSTOP);
    wait_for(ServingStatus::NotServing).await;
    w.redis.signal(libc::SIGCONT);
    wait_for(ServingStatus::Serving).await;
}

/// How a client of [`admitted_until_refused`] asks.
#[derive(Clone)]
enum Asker {
    Rls(Client),
    Http(quota_tests::http::Http),
}

/// Each asker asks for `resource` of tenant atlas on a task of its own
/// until refused three times in a row; the admits of all of them.
async fn admitted_until_refused(askers: Vec<Asker>, resource: &'static str) -> usize {
    let mut tasks = Vec::new();
    for who in askers {
        tasks.push(tokio::spawn(async move {
            let admitted = || {
                let who = who.clone();
                async move {
                    match who {
                        Asker::Rls(c) => {
                            let r = ask(&c, vec![d(&[("resource", resource)], None)], 0)
                                .await
                                .expect("an answer");
                            r.overall_code == Code::Ok as i32
                        }
                        Asker::Http(http) => {
                            let r = common::acquire(&http, "atlas", resource).await;
                            assert!(r.status == 200 || r.status == 429, "{}", r.body);
                            r.status == 200
                        }
                    }
                }
            };
            common::until_refused(3, admitted, |ok| *ok).await.into_iter().filter(|ok| *ok).count()
        }));
    }
    let mut ok = 0;
    for t in tasks {
        ok += t.await.unwrap();
    }
    ok
}

/// gRPC and HTTP decisions spend one pool: 8 streams and 8 HTTP clients on
/// two agents until the pool of 100 is exhausted admit exactly 100.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_and_http_decisions_share_one_pool() {
    let w = World::start().await;
    w.policy(
        "atlas",
        "mixed",
        json!({"limit": 100, "window_secs": 3600, "fail_mode": "strict", "chunk_max": 9}),
    )
    .await;
    let (a, ca, _) = rls_agent(&w, "eu-1", None).await;
    let (b, cb, _) = rls_agent(&w, "eu-2", None).await;
    // 8 streams then 8 HTTP clients, alternating between the agents.
    let askers = (0..16)
        .map(|i| match (i < 8, i % 2 == 0) {
            (true, true) => Asker::Rls(ca.clone()),
            (true, false) => Asker::Rls(cb.clone()),
            (false, true) => Asker::Http(a.http.clone()),
            (false, false) => Asker::Http(b.http.clone()),
        })
        .collect();
    let ok = admitted_until_refused(askers, "mixed").await;
    assert_eq!(ok, 100, "gRPC and HTTP together admit exactly the pool");
    w.wait_consumed("mixed", 100).await;
}

/// The names of the agent process's threads (`/proc/<pid>/task/*/comm`).
fn thread_names(pid: u32) -> Vec<String> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return Vec::new() };
    tasks
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .map(|n| n.trim().to_string())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_dealt_to_several_grpc_threads_share_one_pool_and_stop_in_time() {
    let w = World::start().await;
    w.policy(
        "atlas",
        "spread",
        json!({"limit": 120, "window_secs": 3600, "fail_mode": "strict", "chunk_max": 15}),
    )
    .await;
    let addr = format!("127.0.0.1:{}", quota_tests::free_port());
    let mut a =
        w.agent("eu", "eu-1", None, &[("AGENT_GRPC_LISTEN", &addr), ("AGENT_GRPC_THREADS", "3")]).await;
    let url = format!("http://{addr}");
    // Six connections (a channel each): dealt in turn, two per thread.
    let mut conns = Vec::new();
    for _ in 0..6 {
        conns.push(client(&url).await);
    }
    let pid = a.pid().expect("the agent runs");
    let grpc_threads: Vec<String> =
        thread_names(pid).into_iter().filter(|n| n.starts_with("agent-grpc-")).collect();
    assert_eq!(grpc_threads.len(), 3, "--grpc-threads 3 starts three threads: {grpc_threads:?}");
    // Two of every three askers a stream (over the six connections in
    // turn), the third an HTTP client.
    let askers = (0..18)
        .map(|i| {
            if i % 3 != 2 {
                Asker::Rls(conns[i % conns.len()].clone())
            } else {
                Asker::Http(a.http.clone())
            }
        })
        .collect();
    let ok = admitted_until_refused(askers, "spread").await;
    assert_eq!(ok, 120, "six connections on three threads and HTTP together admit exactly the pool");
    w.wait_consumed("spread", 120).await;
    // The connections stay open: the stop still ends within its bound
    // (requests 2 s + tasks 1 s + drain 3 s), with the outbox sent.
    let started = std::time::Instant::now();
    let status = a.stop(libc::SIGTERM).expect("the agent exits");
    let took = started.elapsed();
    assert!(status.success(), "exit {status:?}\n{}", a.log());
    assert!(took < Duration::from_secs(8), "the stop took {took:?}\n{}", a.log());
    drop(conns);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grpc_threads_own_redis_connection_comes_back_after_redis_restarts() {
    let mut w = World::start().await;
    w.policy("atlas", "again", json!({"limit": 1000, "window_secs": 3600, "fail_mode": "strict"})).await;
    let addr = format!("127.0.0.1:{}", quota_tests::free_port());
    // One thread: every RLS call's spend run uses that thread's connection.
    let a = w.agent("eu", "eu-1", None, &[("AGENT_GRPC_LISTEN", &addr), ("AGENT_GRPC_THREADS", "1")]).await;
    let c = client(&format!("http://{addr}")).await;
    let again = || async { ask(&c, vec![d(&[("resource", "again")], None)], 0).await };
    assert_eq!(again().await.expect("an answer").overall_code, Code::Ok as i32);
    // Redis comes back empty on the same port: the thread's connection
    // must reconnect (the shared one is not what its runs use), and the
    // agent takes a new lease.
    w.redis.restart_empty();
    quota_tests::wait::until("RLS admits after the restart", Duration::from_secs(30), || async {
        match again().await {
            Ok(r) if r.overall_code == Code::Ok as i32 => Some(()),
            Ok(r) => panic!("refused after the restart: {r:?}"),
            // UNAVAILABLE while the agent finds its lease lost.
            Err(s) if s.code() == tonic::Code::Unavailable => None,
            Err(s) => panic!("after the restart: {s:?}"),
        }
    })
    .await;
    let r = common::acquire(&a.http, "atlas", "again").await;
    assert_eq!(r.status, 200, "{}", r.body);
}
