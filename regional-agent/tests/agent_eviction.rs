//! The eviction policy guard end to end: an agent admits only from a Redis
//! whose `maxmemory-policy` is `noeviction` (any other policy may evict the
//! counters and fences that keep a token from being spent twice), says why
//! and how to fix it, and notices a policy changed at run time within the
//! check period.

mod common;

use common::{acquire, World};
use quota_tests::agent::AgentProc;
use quota_tests::http::{metric, Http};
use quota_tests::redis::TestRedis;
use quota_tests::wait;
use serde_json::json;
use std::time::{Duration, Instant};

/// The agent's default check period (`--redis-policy-check-ms`).
const CHECK_PERIOD: Duration = Duration::from_millis(5000);

async fn policy_ok(http: &Http) -> Option<f64> {
    let text = http.get("/metrics").await.body;
    metric(text.as_str().unwrap_or_default(), "agent_redis_eviction_policy_ok")
}

fn config_set(redis: &TestRedis, policy: &str) {
    let client = redis::Client::open(redis.url.as_str()).expect("redis url");
    let mut c = client.get_connection_with_timeout(Duration::from_secs(2)).expect("connect");
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory-policy")
        .arg(policy)
        .query(&mut c)
        .expect("CONFIG SET");
}

/// Asserts the agent refuses with a 503 `store_unavailable` naming `policy`
/// and the fix, on `/v1/acquire` and `/readyz`.
async fn assert_refuses(a: &AgentProc, policy: &str) {
    let r = acquire(&a.http, "atlas", "read").await;
    assert_eq!((r.status, r.error()), (503, "store_unavailable"), "{}", r.body);
    let msg = r.body["message"].as_str().unwrap_or_default();
    assert!(msg.contains(policy) && msg.contains("set maxmemory-policy noeviction"), "{msg}");
    assert!(r.header("retry-after").and_then(|v| v.parse::<i64>().ok()).is_some_and(|s| s >= 1));
    let ready = a.http.get("/readyz").await;
    assert_eq!((ready.status, ready.error()), (503, "store_unavailable"), "{}", ready.body);
    assert!(ready.body["message"].as_str().is_some_and(|m| m.contains(policy)), "{}", ready.body);
    assert_eq!(policy_ok(&a.http).await, Some(0.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_evicting_maxmemory_policy_refuses_admission_naming_the_policy_until_set_to_noeviction() {
    let w = World::start_with_redis(TestRedis::start_local(&["--maxmemory-policy", "allkeys-lru"])).await;
    w.policy("atlas", "read", json!({"limit": 100, "window_secs": 3600})).await;
    let a = w.agent("eu", "eu-1", None, &[]).await;
    assert_refuses(&a, "allkeys-lru").await;
    assert!(a.log().contains("set maxmemory-policy noeviction"), "the log says how to fix it");

    // A volatile-* policy evicts only keys with a TTL, which is every key
    // the agent writes: refused as well.
    let volatile = TestRedis::start_local(&["--maxmemory-policy", "volatile-lru"]);
    let b = quota_tests::agent::AgentProc::spawn(
        common::bin(),
        quota_tests::agent::AgentOpts::new("us", "us-1", &w.stack.alloc.base, &volatile.url),
    )
    .await;
    assert_refuses(&b, "volatile-lru").await;

    // Fixed at run time: admitted within the check period, no restart.
    config_set(&volatile, "noeviction");
    let fixed = Instant::now();
    wait::until("admission once the policy is noeviction", CHECK_PERIOD + Duration::from_secs(2), || async {
        (acquire(&b.http, "atlas", "read").await.status == 200).then_some(())
    })
    .await;
    println!("volatile-lru → noeviction: admitting after {:?}", fixed.elapsed());
    a.http.get("/readyz").await.expect(503);
    b.http.get("/readyz").await.expect(200);
    assert_eq!(policy_ok(&b.http).await, Some(1.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn noeviction_admits_and_switching_to_allkeys_lru_at_run_time_stops_admission_within_the_check_period()
{
    let w = World::start_with_redis(TestRedis::start_local(&["--maxmemory-policy", "noeviction"])).await;
    w.policy("atlas", "read", json!({"limit": 100, "window_secs": 3600})).await;
    let a = w.agent("eu", "eu-1", None, &[]).await;
    acquire(&a.http, "atlas", "read").await.expect(200);
    a.http.get("/readyz").await.expect(200);
    assert_eq!(policy_ok(&a.http).await, Some(1.0));

    config_set(&w.redis, "allkeys-lru");
    let changed = Instant::now();
    wait::until("refusal after CONFIG SET allkeys-lru", CHECK_PERIOD + Duration::from_secs(1), || async {
        (acquire(&a.http, "atlas", "read").await.status == 503).then_some(())
    })
    .await;
    let took = changed.elapsed();
    println!("noeviction → allkeys-lru: refusing after {took:?} (check period {CHECK_PERIOD:?})");
    assert_refuses(&a, "allkeys-lru").await;
    let log = a.log();
    assert_eq!(
        log.matches("not admitting from the region's Redis").count(),
        1,
        "logged once per change, not per request:\n{log}"
    );
}
