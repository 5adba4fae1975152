//! Per-key limits (a token bucket per principal inside a quota) and shadow
//! mode end to end: a real allocator on PostgreSQL, Redis and agents as
//! processes.
//! The key's bucket is checked first: a key over its cap spends nothing of
//! the tenant's quota, and a quota that refuses leaves the key's bucket as
//! it was.

mod common;

use common::{Tally, World};
use quota_tests::http::{Http, Resp};
use serde_json::json;
use std::time::{Duration, Instant};

async fn acquire_as(http: &Http, resource: &str, key: &str) -> Resp {
    http.post("/v1/acquire", &json!({"tenant": "atlas", "resource": resource, "key": key})).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_over_its_cap_gets_429_per_key_and_spends_nothing_of_the_quota() {
    let w = World::start().await;
    // 0.001 tokens/s: the bucket does not refill within the test.
    w.policy(
        "atlas",
        "read",
        json!({"limit": 1000, "window_secs": 3600, "per_key": {"rate_per_sec": 0.001, "burst": 3}}),
    )
    .await;
    let policy = w.stack.http.get("/v1/policies/atlas/read").await.expect(200);
    assert_eq!(policy.body["per_key"], json!({"rate_per_sec": 0.001, "burst": 3}));
    let a = w.agent("eu", "eu-1", None, &[]).await;

    let mut tally = Tally::default();
    for left in [2, 1, 0] {
        let r = acquire_as(&a.http, "read", "alice").await.expect(200);
        assert_eq!(r.body["key_remaining"], json!(left), "{}", r.body);
        tally.add(&r);
    }
    // The bucket is now the most restrictive limit: the headers describe it.
    for _ in 0..5 {
        let r = acquire_as(&a.http, "read", "alice").await.expect(429);
        assert_eq!(r.body["error"], json!("per_key_limited"), "{}", r.body);
        assert_eq!(r.body["limit"], json!("per_key"));
        assert_eq!(r.body["allowed"], json!(false));
        // One token at 0.001/s is 1000 s away (less what refilled since).
        let retry: i64 = r.header("retry-after").expect("Retry-After").parse().expect("seconds");
        assert!((990..=1001).contains(&retry), "Retry-After {retry}");
        assert_eq!(r.body["retry_after_s"], json!(retry));
        assert_eq!(r.header("ratelimit-policy"), Some("\"atlas/read/per_key\";q=3;w=3000"));
        assert_eq!(r.header("ratelimit"), Some("\"atlas/read/per_key\";r=0;t=3000"));
        tally.add(&r);
    }
    // Another key has its own bucket; the quota stays what the headers show
    // while it is the tighter limit.
    let bob = acquire_as(&a.http, "read", "bob").await.expect(200);
    assert_eq!(bob.body["key_remaining"], json!(2));
    tally.add(&bob);
    // Keys are compared whole: "alice:" is not "alice".
    tally.add(&acquire_as(&a.http, "read", "alice:").await.expect(200));

    // Bad keys, a missing key and a cost above the burst are refused
    // before anything is spent.
    for (body, field) in [
        (json!({"tenant": "atlas", "resource": "read"}), "key"),
        (json!({"tenant": "atlas", "resource": "read", "key": ""}), "key"),
        (json!({"tenant": "atlas", "resource": "read", "key": "a b"}), "key"),
        (json!({"tenant": "atlas", "resource": "read", "key": "k".repeat(129)}), "key"),
        (json!({"tenant": "atlas", "resource": "read", "key": 7}), "key"),
        (json!({"tenant": "atlas", "resource": "read", "key": "carol", "cost": 4}), "cost"),
    ] {
        let r = a.http.post("/v1/acquire", &body).await.expect(422);
        assert_eq!(r.body["field"], json!(field), "{body}: {}", r.body);
    }
    assert_eq!(w.bucket_tokens("read", "carol").await, None, "a refused request creates no bucket");

    // The allocator's accounting counts exactly the admits: the refused
    // key's requests spent nothing of the tenant's quota.
    assert_eq!(tally.admitted(), 5);
    assert_eq!(tally.count(429, "per_key_limited"), 5);
    w.wait_accounting("atlas", "read", &tally.by_window).await;
    assert_eq!(w.bucket_tokens("read", "alice").await, Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exhausted_quota_leaves_the_keys_bucket_as_it_was() {
    let w = World::start().await;
    w.policy(
        "atlas",
        "write",
        json!({"limit": 5, "window_secs": 3600, "fail_mode": "strict",
               "per_key": {"rate_per_sec": 0.001, "burst": 100}}),
    )
    .await;
    let a = w.agent("eu", "eu-1", None, &[]).await;
    let mut tally = Tally::default();
    let mut refused = 0;
    let deadline = Instant::now() + Duration::from_secs(30);
    while refused < 5 {
        assert!(Instant::now() < deadline, "the quota never said exhausted: {tally:?}");
        let r = acquire_as(&a.http, "write", "alice").await;
        if r.status == 429 {
            assert_eq!(r.body["error"], json!("quota_exhausted"), "{}", r.body);
            assert_eq!(r.body["limit"], json!("write"));
            // The quota is the tighter limit now: the headers say so.
            assert!(r.header("ratelimit").is_some_and(|v| v.starts_with("\"atlas/write\";r=0;")));
            refused += 1;
        } else {
            assert_eq!(r.status, 200, "{}", r.body);
        }
        tally.add(&r);
    }
    assert_eq!(tally.admitted(), 5, "{tally:?}");
    // Only the five admits were debited from the key: 100 - 5.
    assert_eq!(w.bucket_tokens("write", "alice").await, Some(95));
    w.wait_accounting("atlas", "write", &tally.by_window).await;
}

/// Admits of one key through two replicas whose clocks are 60 s apart:
/// the burst, then the rate, within 2 % over several seconds (the bucket
/// refills on the region's Redis clock, not on either agent's).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keys_bucket_gives_its_burst_then_its_rate_whatever_the_replicas_clocks() {
    const RATE: f64 = 200.0;
    const BURST: i64 = 50;
    let w = World::start().await;
    w.policy(
        "atlas",
        "search",
        json!({"limit": 1_000_000, "window_secs": 3600, "per_key": {"rate_per_sec": RATE, "burst": BURST}}),
    )
    .await;
    let ahead = w.agent("eu", "eu-1", None, &[("AGENT_TEST_CLOCK_OFFSET_MS", "30000")]).await;
    let behind = w.agent("eu", "eu-2", None, &[("AGENT_TEST_CLOCK_OFFSET_MS", "-30000")]).await;
    // Both replicas know the policy before the clock starts (another key).
    acquire_as(&ahead.http, "search", "warm").await.expect(200);
    acquire_as(&behind.http, "search", "warm").await.expect(200);

    let started = Instant::now();
    let run = Duration::from_secs(4);
    let mut clients = Vec::new();
    for i in 0..8 {
        let http = if i % 2 == 0 { ahead.http.clone() } else { behind.http.clone() };
        clients.push(tokio::spawn(async move {
            let mut t = Tally::default();
            while started.elapsed() < run {
                let r = acquire_as(&http, "search", "dave").await;
                assert!(r.status == 200 || r.status == 429, "{}: {}", r.status, r.body);
                if r.status == 429 {
                    assert_eq!(r.body["error"], json!("per_key_limited"), "{}", r.body);
                }
                t.add(&r);
            }
            t
        }));
    }
    let mut tally = Tally::default();
    for c in clients {
        tally.merge(&c.await.expect("client"));
    }
    let elapsed = started.elapsed().as_secs_f64();
    let expected = BURST as f64 + RATE * elapsed;
    let admitted = tally.admitted() as f64;
    eprintln!("per-key bucket: admitted {admitted} in {elapsed:.3} s, expected {expected:.1} (burst {BURST} + {RATE}/s)");
    assert!(
        (admitted - expected).abs() <= expected * 0.02,
        "admitted {admitted} in {elapsed:.3} s, expected {expected:.1} ± 2 %: {tally:?}"
    );
    assert!(tally.count(429, "per_key_limited") > 0, "the key was never limited: {tally:?}");
}

/// Shadow mode: twin quotas, one enforced and one with `enforce: false`,
/// get the same requests (a per-key cap and a quota both run out). The
/// shadow twin refuses nobody, and refuses "in shadow" exactly the requests
/// its enforced twin refuses, naming the same limit; the allocator's window
/// accounting and the agent's metrics count them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shadow_policy_refuses_nobody_and_counts_exactly_what_its_enforced_twin_refuses() {
    let w = World::start().await;
    let policy = |enforce: bool| {
        json!({"limit": 25, "window_secs": 3600, "fail_mode": "strict", "enforce": enforce,
               "per_key": {"rate_per_sec": 0.001, "burst": 2}})
    };
    w.policy("atlas", "twin-on", policy(true)).await;
    let p = w.policy("atlas", "twin-shadow", policy(false)).await;
    assert_eq!(p["enforce"], json!(false));
    let a = w.agent("eu", "eu-1", None, &[]).await;

    // Ten keys twice (20 admits), twice more (their buckets are empty: 20
    // per-key refusals), then ten fresh keys: 5 admits empty the quota of
    // 25 and 5 quota refusals.
    let mut keys: Vec<String> = Vec::new();
    for _ in 0..4 {
        keys.extend((0..10).map(|i| format!("u{i}")));
    }
    keys.extend((0..10).map(|i| format!("v{i}")));
    let mut on = Vec::new();
    let mut tally = Tally::default();
    for k in &keys {
        let r = acquire_as(&a.http, "twin-on", k).await;
        on.push(match r.status {
            200 => None,
            429 => Some(r.body["limit"].as_str().expect("limit").to_string()),
            s => panic!("enforced twin answered {s}: {}", r.body),
        });
        tally.add(&r);
    }
    let mut shadow_tally = Tally::default();
    for (k, enforced) in keys.iter().zip(&on) {
        let r = acquire_as(&a.http, "twin-shadow", k).await.expect(200);
        assert_eq!(r.body["allowed"], json!(true));
        let refused = r.body["shadow_refused"].as_bool().expect("shadow_refused");
        let limit = r.body["limit"].as_str().map(str::to_string);
        let want =
            enforced.as_ref().map(|l| if l == "twin-on" { "twin-shadow".to_string() } else { l.clone() });
        assert_eq!((refused, limit), (want.is_some(), want), "key {k}: {}", r.body);
        if !refused {
            shadow_tally.add(&r);
        }
    }
    let per_key = on.iter().filter(|l| l.as_deref() == Some("per_key")).count();
    let quota = on.iter().filter(|l| l.as_deref() == Some("twin-on")).count();
    assert_eq!((per_key, quota), (20, 5), "enforced twin: {on:?}");

    // The allocator counts the same admits for both, and the shadow
    // refusals of the shadow twin per window.
    w.wait_accounting("atlas", "twin-on", &tally.by_window).await;
    w.wait_accounting("atlas", "twin-shadow", &shadow_tally.by_window).await;
    let counted = quota_tests::wait::poll(Duration::from_secs(20), Duration::from_millis(50), || async {
        let ws = w.windows("atlas", "twin-shadow").await;
        let n: i64 = ws.iter().map(|x| x["shadow_refused"].as_i64().unwrap_or(0)).sum();
        if n == 25 {
            Ok(())
        } else {
            Err(n)
        }
    })
    .await;
    assert_eq!(counted, Ok(()), "shadow refusals in the window accounting");
    let enforced_windows = w.windows("atlas", "twin-on").await;
    assert!(enforced_windows.iter().all(|x| x["shadow_refused"] == json!(0)), "{enforced_windows:?}");

    let metrics = a.http.get("/metrics").await.expect(200);
    let text = metrics.body.as_str().expect("metrics text");
    for (limit, n) in [("per_key", 20.0), ("quota", 5.0)] {
        let name = format!("agent_shadow_refusals_total{{limit=\"{limit}\"}}");
        assert_eq!(quota_tests::http::metric(text, &name), Some(n), "{name}");
    }
}
