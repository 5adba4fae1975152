//! Shedding by priority (issue 30, item 3) end to end: a real allocator
//! on PostgreSQL, Redis and an agent process overloaded by more clients
//! than its `--shed-in-flight` line.

mod common;

use common::{Tally, World};
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use quota_tests::http::{metric, Http, Resp};
use serde_json::json;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// Answers by priority: (admitted, shed, anything else).
#[derive(Debug, Default, Clone, Copy)]
struct ByPriority {
    admitted: i64,
    shed: i64,
    other: i64,
}

/// One client of priority `p`: acquires until `until`, pausing 5 ms after
/// a shed (as a client honouring a retry hint would, only shorter).
async fn client(http: &Http, p: u8, until: Instant) -> (Tally, ByPriority, Vec<Resp>) {
    let (mut tally, mut by, mut odd) = (Tally::default(), ByPriority::default(), Vec::new());
    while Instant::now() < until {
        let r =
            http.post("/v1/acquire", &json!({"tenant": "atlas", "resource": "export", "priority": p})).await;
        tally.add(&r);
        match (r.status, r.error()) {
            (200, _) => by.admitted += 1,
            (503, "shed") => {
                by.shed += 1;
                let hint: i64 = r.header("retry-after").and_then(|v| v.parse().ok()).unwrap_or(0);
                assert!((1..=2).contains(&hint), "a shed carries a jittered Retry-After of 1-2 s: {hint}");
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            _ => {
                by.other += 1;
                if odd.len() < 5 {
                    odd.push(r);
                }
            }
        }
    }
    (tally, by, odd)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overloaded_agent_sheds_priorities_4_to_2_keeps_0_and_1_and_charges_no_shed_request() {
    let w = World::start().await;
    w.policy("atlas", "export", json!({"limit": 1_000_000, "window_secs": 3600})).await;
    // A line of 4 decisions in flight: 30 clients are an overload of
    // several times the line, as a flood is of the default 512.
    let a = w.agent("eu", "eu-1", None, &[("AGENT_SHED_IN_FLIGHT", "4")]).await;
    // One admit first, so the quota's lease is in place before the flood.
    let mut tally = Tally::default();
    tally.add(
        &a.http.post("/v1/acquire", &json!({"tenant": "atlas", "resource": "export"})).await.expect(200),
    );

    let until = Instant::now() + Duration::from_secs(2);
    let clients = (0..30u8).map(|i| client(&a.http, i % 5, until));
    let results = futures::future::join_all(clients).await;

    let mut by: BTreeMap<u8, ByPriority> = BTreeMap::new();
    for (i, (t, b, odd)) in results.iter().enumerate() {
        assert!(odd.is_empty(), "answers other than 200 and 503 shed: {:?}", odd);
        tally.merge(t);
        let e = by.entry(i as u8 % 5).or_default();
        e.admitted += b.admitted;
        e.shed += b.shed;
        e.other += b.other;
    }
    eprintln!("answers by priority: {by:?}");
    for p in [0u8, 1] {
        let b = by[&p];
        assert_eq!(b.shed, 0, "priority {p} is never shed: {by:?}");
        let total = b.admitted + b.shed + b.other;
        assert!(total > 0 && b.admitted * 100 >= total * 99, "priority {p} kept under 99 % admitted: {by:?}");
    }
    for p in [3u8, 4] {
        let b = by[&p];
        let total = b.admitted + b.shed + b.other;
        assert!(b.shed * 2 >= total && b.shed > 0, "priority {p} was not shed most of the time: {by:?}");
    }
    // Priority 4 is shed from a lower load than 2, so at least as often.
    let rate = |b: ByPriority| b.shed as f64 / (b.admitted + b.shed + b.other).max(1) as f64;
    assert!(rate(by[&4]) + 0.02 >= rate(by[&2]), "priority 4 shed less often than 2: {by:?}");

    // The agent counted exactly the sheds its clients saw, by priority.
    let text = a.http.get("/metrics").await.body;
    let text = text.as_str().unwrap_or_default();
    for p in 2u8..=4 {
        let counted = metric(text, &format!("agent_shed_total{{priority=\"{p}\"}} ")).unwrap_or(-1.0);
        assert_eq!(counted as i64, by[&p].shed, "agent_shed_total for priority {p}");
    }
    assert_eq!(
        metric(text, "agent_decisions_in_flight ").map(|v| v as i64),
        Some(0),
        "nothing in flight after"
    );
    let status = a.http.get("/v1/status").await.expect(200).body;
    let shed = &status["shed"];
    assert_eq!((shed["in_flight_line"].as_i64(), shed["in_flight"].as_i64()), (Some(4), Some(0)), "{status}");
    assert_eq!(shed["shedding"], json!([]), "nothing is shed once the flood is over: {status}");

    // Nothing shed is charged: the allocator's window accounting is the
    // admits and nothing more.
    w.wait_accounting("atlas", "export", &tally.by_window).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_priority_outside_0_to_4_is_a_422_naming_the_field() {
    let w = World::start().await;
    w.policy("atlas", "export", json!({"limit": 100, "window_secs": 3600})).await;
    let a = w.agent("eu", "eu-1", None, &[]).await;
    for bad in [json!(5), json!(-1), json!("high"), json!(1.5)] {
        let r = a
            .http
            .post("/v1/acquire", &json!({"tenant": "atlas", "resource": "export", "priority": bad}))
            .await;
        assert_eq!(
            (r.status, r.error(), r.body["field"].as_str()),
            (422, "invalid_field", Some("priority")),
            "{bad}: {}",
            r.body
        );
    }
    for ok in [0, 4] {
        a.http
            .post("/v1/acquire", &json!({"tenant": "atlas", "resource": "export", "priority": ok}))
            .await
            .expect(200);
    }
    // Under the default line (512) nothing is shed.
    w.wait_consumed("export", 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_rls_a_shed_request_is_over_limit_with_the_reason_and_charges_nothing() {
    let w = World::start().await;
    w.policy("atlas", "export", json!({"limit": 1_000_000, "window_secs": 3600})).await;
    let addr = format!("127.0.0.1:{}", quota_tests::free_port());
    // A line of 1: any decision in flight sheds priority 4.
    let a = w.agent("eu", "eu-1", None, &[("AGENT_GRPC_LISTEN", &addr), ("AGENT_SHED_IN_FLIGHT", "1")]).await;
    let url = format!("http://{addr}");
    let c = quota_tests::wait::until("the RLS port accepts", Duration::from_secs(20), || {
        let url = url.clone();
        async move { RateLimitServiceClient::connect(url).await.ok() }
    })
    .await;
    let ask = |priority: &'static str| {
        let mut c = c.clone();
        async move {
            let entries = [("resource", "export"), ("priority", priority)]
                .iter()
                .map(|(k, v)| Entry { key: k.to_string(), value: v.to_string() })
                .collect();
            let d = RateLimitDescriptor { entries, ..Default::default() };
            let req = RateLimitRequest { domain: "atlas".into(), descriptors: vec![d], hits_addend: 1 };
            tokio::time::timeout(Duration::from_secs(10), c.should_rate_limit(req))
                .await
                .expect("ShouldRateLimit answers within 10 s")
                .expect("a shed is an answer, not a gRPC error")
                .into_inner()
        }
    };

    // Priority 0 over HTTP keeps decisions in flight; RLS asks at 4 and 0
    // until a shed was seen (at most the flood's 3 s).
    let until = Instant::now() + Duration::from_secs(3);
    let flood = futures::future::join_all((0..8).map(|_| client(&a.http, 0, until)));
    let probe = async {
        let (mut shed, mut ok) = (0, 0);
        while Instant::now() < until && shed == 0 {
            for p in ["4", "0"] {
                let r = ask(p).await;
                let reason = r.response_headers_to_add.iter().find(|h| h.key == "x-quota-refused");
                if r.overall_code == Code::OverLimit as i32 {
                    assert_eq!(p, "4", "priority 0 is never shed: {r:?}");
                    assert_eq!(reason.map(|h| h.value.as_str()), Some("shed"), "{r:?}");
                    assert!(r.statuses.iter().all(|s| s.code == Code::OverLimit as i32), "{r:?}");
                    shed += 1;
                } else {
                    assert_eq!(r.overall_code, Code::Ok as i32, "{r:?}");
                    ok += 1;
                }
            }
        }
        (shed, ok)
    };
    let (flood, (shed, rls_ok)) = tokio::join!(flood, probe);
    assert!(shed > 0, "no RLS request at priority 4 was shed while 8 clients kept decisions in flight");
    let http_ok: i64 = flood
        .iter()
        .map(|(_, b, odd)| {
            assert!(odd.is_empty() && b.shed == 0, "priority 0 over HTTP: {b:?} {odd:?}");
            b.admitted
        })
        .sum();
    // The shed ones are charged nowhere: the allocator counts the HTTP and
    // RLS admits and nothing more.
    w.wait_consumed("export", http_ok + rls_ok).await;
}
