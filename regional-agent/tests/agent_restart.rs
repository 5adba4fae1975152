//! Process and store failures: an agent killed with SIGKILL and restarted
//! (new epoch, nothing lost or double-counted, I4, I7), and the region's
//! Redis restarting empty during a window (I6 still holds).

mod common;

use common::{acquire, Tally, World};
use quota_tests::fixtures::{grant, grant_body};
use quota_tests::proxy::{Fault, FaultProxy};
use serde_json::json;
use std::time::Duration;

async fn admit_n(http: &quota_tests::http::Http, resource: &str, n: usize) -> Tally {
    let mut t = Tally::default();
    for _ in 0..n {
        let r = acquire(http, "atlas", resource).await;
        assert_eq!(r.status, 200, "{}", r.body);
        t.add(&r);
    }
    t
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_and_restart_gets_a_new_epoch_and_loses_nothing() {
    let w = World::start().await;
    w.policy("atlas", "k", json!({"limit": 1000, "window_secs": 3600})).await;
    let mut a = w.agent("eu", "eu-1", None, &[]).await;
    let old_epoch = a.epoch().await;
    let mut tally = admit_n(&a.http, "k", 50).await;
    a.stop(libc::SIGKILL);
    let new_epoch = a.start().await;
    assert!(new_epoch > old_epoch, "{new_epoch} > {old_epoch}");
    // The old incarnation's requests are refused.
    let r = grant(&w.stack.http, &grant_body("atlas", "k", "eu", "eu-1", old_epoch, 999, 5, 1.0)).await;
    assert_eq!((r.status, r.error()), (409, "stale_epoch"), "{}", r.body);
    tally.merge(&admit_n(&a.http, "k", 30).await);
    assert_eq!(tally.admitted(), 80);
    w.wait_accounting("atlas", "k", &tally.by_window).await;
    // A graceful stop drains what is left; a restart then reports nothing twice.
    tally.merge(&admit_n(&a.http, "k", 5).await);
    let status = a.stop(libc::SIGTERM).expect("exit status");
    assert!(status.success(), "{status}: {}", a.log());
    w.wait_accounting("atlas", "k", &tally.by_window).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_restarting_empty_keeps_the_fallback_bound() {
    // The region's first window ends a few seconds in (time to start the
    // agent and admit), not at the next real UTC minute.
    let mut w = World::start_clocked(60, Duration::from_secs(4)).await;
    let allowance = 5;
    w.policy(
        "atlas",
        "r",
        json!({"limit": 1000, "window_secs": 60, "chunk_max": 10, "fallback_per_region": allowance}),
    )
    .await;
    let sw = FaultProxy::in_front_of(&w.stack.alloc.base).await.expect("fault proxy");
    let a = w.agent("eu", "eu-1", Some(&sw.http_url()), &[]).await;
    let mut tally = admit_n(&a.http, "r", 3).await;
    let epoch = a.epoch().await;
    // Leave the region's first window (its fallback is treated as spent).
    w.clock.next_window(60, Duration::ZERO).await;
    tally.merge(&admit_n(&a.http, "r", 3).await);
    sw.set(Fault::Blackhole);
    let mut during = Tally::default();
    for _ in 0..300 {
        let r = acquire(&a.http, "atlas", "r").await;
        during.add(&r);
        if r.status == 503 && during.count(503, "allocator_unreachable") >= 3 {
            break;
        }
    }
    assert!(during.fallback() > 0, "{during:?}");
    w.redis.restart_empty();
    for _ in 0..50 {
        let r = acquire(&a.http, "atlas", "r").await;
        assert_ne!(r.status, 500, "{}", r.body);
        during.add(&r);
    }
    tally.merge(&during);
    for (ws, (lease, fb)) in &tally.by_window {
        assert!(*fb <= allowance, "window {ws}: {fb} fallback admits > {allowance}: {tally:?}");
        assert!(lease + fb <= 1000 + allowance, "I6 in window {ws}");
    }
    sw.set(Fault::Pass);
    quota_tests::wait::until("a new epoch after the data loss", Duration::from_secs(20), || {
        let http = a.http.clone();
        async move { (http.get("/v1/status").await.body["epoch"].as_i64().unwrap_or(0) > epoch).then_some(()) }
    })
    .await;
    // Admission resumes from new leases.
    quota_tests::wait::until("admits after heal", Duration::from_secs(15), || {
        let http = a.http.clone();
        async move { (acquire(&http, "atlas", "r").await.status == 200).then_some(()) }
    })
    .await;
}
