//! Partitions between an agent and the allocator (a proxy that accepts and
//! never answers), and the outbox drain after heal (I6, I7).

mod common;

use common::{acquire, hammer, Tally, World};
use quota_tests::proxy::{Fault, FaultProxy};
use serde_json::json;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bounded_partition_admits_at_most_the_fallback_allowance_and_heals_exactly() {
    // The first window ends a few seconds in (time to start the agent and
    // admit), not at the next real 30 s boundary.
    let w = World::start_clocked(30, Duration::from_secs(4)).await;
    w.policy(
        "atlas",
        "p",
        json!({"limit": 60, "window_secs": 30, "chunk_max": 60, "fallback_per_region": 7}),
    )
    .await;
    let sw = FaultProxy::in_front_of(&w.stack.alloc.base).await.expect("fault proxy");
    let a = w.agent("eu", "eu-1", Some(&sw.http_url()), &[]).await;
    // The first touch of a new region marks its first window's fallback as
    // spent (the safe side); start the partition in a later window.
    let mut tally = Tally::default();
    tally.merge(&hammer(&a.http, "p", (0, ""), 3).await);
    w.clock.next_window(30, Duration::ZERO).await;
    tally.merge(&hammer(&a.http, "p", (0, ""), 3).await);
    sw.set(Fault::Blackhole);
    let during = hammer(&a.http, "p", (503, "allocator_unreachable"), 400).await;
    assert!(during.count(429, "quota_exhausted") == 0, "no 429 while unreachable: {during:?}");
    tally.merge(&during);
    let status = a.http.get("/v1/status").await.expect(200);
    assert_eq!(status.body["allocator_reachable"], json!(false));
    for (ws, (_, fb)) in &tally.by_window {
        assert!(*fb <= 7, "window {ws} admitted {fb} from fallback: {tally:?}");
    }
    assert!(during.fallback() > 0, "fallback was used: {during:?}");
    sw.set(Fault::Pass);
    w.wait_accounting("atlas", "p", &tally.by_window).await;
    for win in w.windows("atlas", "p").await {
        assert_eq!(win["bound_held"], json!(true), "{win}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strict_partition_answers_503_and_heals_exactly() {
    let w = World::start().await;
    w.policy(
        "atlas",
        "s",
        json!({"limit": 1000, "window_secs": 3600, "chunk_max": 20, "fail_mode": "strict"}),
    )
    .await;
    let sw = FaultProxy::in_front_of(&w.stack.alloc.base).await.expect("fault proxy");
    let a = w.agent("eu", "eu-1", Some(&sw.http_url()), &[]).await;
    let mut tally = hammer(&a.http, "s", (0, ""), 5).await;
    sw.set(Fault::Blackhole);
    let during = hammer(&a.http, "s", (503, "allocator_unreachable"), 200).await;
    assert_eq!(during.fallback(), 0, "{during:?}");
    assert!(during.count(503, "allocator_unreachable") >= 3, "{during:?}");
    tally.merge(&during);
    sw.set(Fault::Pass);
    // After heal the agent admits from leases again.
    let healed = quota_tests::wait::until("admits after heal", Duration::from_secs(15), || {
        let http = a.http.clone();
        async move {
            let r = acquire(&http, "atlas", "s").await;
            (r.status == 200).then_some(r)
        }
    })
    .await;
    assert_eq!(healed.body["source"], json!("lease"));
    tally.add(&healed);
    w.wait_accounting("atlas", "s", &tally.by_window).await;
}

/// The region's fallback clock (the allocator-clock offset a credit records
/// in the quota's `clk` key, see `credit.lua`) never lags the allocator's
/// clock, however slow the grant: counted from the answer's arrival, a slow
/// grant set it behind by the grant's duration, and a fallback admit sent
/// just after a window's end landed in the ended window's allowance (seen
/// once in the partition chaos scenario). Allocator, agent and Redis share
/// this host's clock, so the true offset is 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_grant_never_sets_the_fallback_clock_behind_the_allocator() {
    let w = World::start().await;
    w.policy("atlas", "slow", json!({"limit": 1000, "window_secs": 3600, "chunk_max": 20})).await;
    let sw = FaultProxy::in_front_of(&w.stack.alloc.base).await.expect("fault proxy");
    let a = w.agent("eu", "eu-1", Some(&sw.http_url()), &[]).await;
    // Every chunk each way waits 150 ms: a grant takes at least 300 ms.
    sw.set(Fault::Latency(150));
    quota_tests::wait::until("an admit from a slow grant", Duration::from_secs(20), || {
        let http = a.http.clone();
        async move { (acquire(&http, "atlas", "slow").await.status == 200).then_some(()) }
    })
    .await;
    let client = redis::Client::open(w.redis.url.as_str()).expect("redis url");
    let mut conn = client.get_multiplexed_async_connection().await.expect("redis connection");
    let key = format!("{}clk", regional_agent::keys::Keys::new("").quota("atlas", "slow"));
    let clk: i64 = redis::cmd("GET").arg(&key).query_async(&mut conn).await.expect("clk offset recorded");
    // Behind by 150 ms or more before the fix; ahead by at most the round
    // trip (two 150 ms delays plus the allocator's work) now.
    assert!(clk >= -20, "the fallback clock lags the allocator's by {} ms", -clk);
    assert!(clk <= 5_000, "the fallback clock leads the allocator's by {clk} ms");
}
