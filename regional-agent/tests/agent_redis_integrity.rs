//! The bound across what real Redis deployments do (issue 14, I6, I8,
//! F04, F10, F14, F15, F33): a Redis back from an older snapshot, names
//! without a policy, replicas with skewed clocks during a partition, and
//! the lifecycle of every key.

mod common;

use common::{acquire, Tally, World};
use quota_tests::http::Http;
use quota_tests::proxy::{Fault, FaultProxy};
use serde_json::json;
use std::time::Duration;

/// A connection to the test's Redis.
async fn redis_conn(url: &str) -> redis::aio::MultiplexedConnection {
    let c = redis::Client::open(url).expect("redis url");
    // SAVE and KEYS on a busy test machine may take longer than the
    // client's default response timeout.
    let cfg = redis::AsyncConnectionConfig::new().set_response_timeout(Some(Duration::from_secs(10)));
    c.get_multiplexed_async_connection_with_config(&cfg).await.expect("redis connection")
}

async fn redis_cmd<T: redis::FromRedisValue>(url: &str, cmd: &mut redis::Cmd) -> T {
    let mut c = redis_conn(url).await;
    cmd.query_async(&mut c).await.expect("redis command")
}

/// Every key of the test's Redis.
async fn keys(url: &str) -> Vec<String> {
    redis_cmd(url, redis::cmd("KEYS").arg("*")).await
}

/// Acquires on `http` until `n` are admitted or a refusal comes.
async fn admit_until(http: &Http, resource: &str, n: i64, t: &mut Tally) -> i64 {
    let mut got = 0;
    while got < n {
        let r = acquire(http, "atlas", resource).await;
        assert_ne!(r.status, 500, "{}", r.body);
        t.add(&r);
        if r.status != 200 {
            break;
        }
        got += 1;
    }
    got
}

/// Acquires on both agents in turn until each has refused `refusals` times in a row.
async fn drain_both(a: &Http, b: &Http, resource: &str, t: &mut Tally, refusals: usize) {
    let mut refused = [0usize; 2];
    let mut i = 0usize;
    while refused.iter().any(|r| *r < refusals) {
        let which = i % 2;
        i += 1;
        if refused[which] >= refusals {
            continue;
        }
        let http = if which == 0 { a } else { b };
        let r = acquire(http, "atlas", resource).await;
        assert_ne!(r.status, 500, "{}", r.body);
        t.add(&r);
        if r.status == 200 {
            refused[which] = 0;
        } else {
            refused[which] += 1;
            tokio::time::sleep(Duration::from_millis(30)).await;
        }
        assert!(i < 20_000, "the agents never stopped admitting: {t:?}");
    }
}

/// The ledger (allocator accounting) never counts more than the clients
/// saw; with a rollback it may count less (counters dropped as untrusted).
async fn ledger_never_counts_twice(w: &World, resource: &str, tally: &Tally) {
    // Give the outboxes time to drain what they hold.
    let expected = tally.by_window.clone();
    // Settled: two reads in a row the same; after 10 s, the latest read.
    let last = std::cell::RefCell::new(Default::default());
    let latest = &last;
    let settled =
        quota_tests::wait::poll(Duration::from_secs(10), Duration::from_millis(700), || async move {
            let now = w.admitted_by_window("atlas", resource).await;
            if *latest.borrow() == now && !now.is_empty() {
                return Ok(now);
            }
            *latest.borrow_mut() = now;
            Err(())
        })
        .await
        .unwrap_or_else(|()| last.take());
    for (ws, (c, f)) in &settled {
        let (lc, lf) = expected.get(ws).copied().unwrap_or_default();
        assert!(c + f <= lc + lf, "window {ws}: the ledger counts {c}+{f} > clients {lc}+{lf}");
    }
}

/// Rollback: mid-window, `SAVE` while a lease holds unspent tokens, admit
/// more (the pool runs out), kill Redis and restart it from the snapshot.
/// On a strict policy the clients never see more than G; two replicas,
/// only one of which touched the quota after the snapshot; the ledger
/// never counts an admit twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_back_from_an_older_snapshot_never_admits_beyond_g() {
    let mut w = World::start().await;
    let g = 400;
    w.policy(
        "atlas",
        "snap",
        json!({"limit": g, "window_secs": 3600, "fail_mode": "strict", "chunk_max": 100}),
    )
    .await;
    let a = w.agent("eu", "eu-1", None, &[]).await;
    let b = w.agent("eu", "eu-2", None, &[]).await;
    let mut tally = Tally::default();
    // Both replicas admit; then snapshot while a lease still holds tokens.
    admit_until(&a.http, "snap", 40, &mut tally).await;
    admit_until(&b.http, "snap", 40, &mut tally).await;
    let left = quota_tests::wait::until("a lease with unspent tokens", Duration::from_secs(10), || {
        let http = a.http.clone();
        async move {
            let s = http.get("/v1/status").await.body;
            let left = s["quotas"][0]["lease_tokens"].as_i64().unwrap_or(0);
            (left > 0).then_some(left)
        }
    })
    .await;
    let _: String = redis_cmd(&w.redis.url, &mut redis::cmd("SAVE")).await;
    // Only replica a touches the quota after the snapshot: it spends the
    // rest of the pool.
    drain_both(&a.http, &a.http, "snap", &mut tally, 5).await;
    assert_eq!(tally.admitted(), g, "the pool is spent before the crash: {tally:?}");
    w.redis.restart_from_snapshot();
    // Both replicas now face a Redis in which `left` tokens look unspent.
    drain_both(&a.http, &b.http, "snap", &mut tally, 20).await;
    assert!(
        tally.admitted() <= g,
        "strict G={g}: clients saw {} admitted after a rollback (a lease showed {left} unspent at the snapshot): {tally:?}",
        tally.admitted()
    );
    // The rollback was detected and counted.
    let m = a.http.get("/metrics").await.body.as_str().unwrap_or_default().to_string();
    let m2 = b.http.get("/metrics").await.body.as_str().unwrap_or_default().to_string();
    // The counter starts at 0 (so that increase() sees the first event): read its value.
    let counted = |text: &str| quota_tests::http::metric(text, "agent_redis_rollbacks_total").unwrap_or(0.0);
    assert!(counted(&m) + counted(&m2) > 0.0, "no rollback counted:\n{m}\n{m2}");
    ledger_never_counts_twice(&w, "snap", &tally).await;
}

/// The same on a bounded policy while the allocator is unreachable: the
/// fallback counter rolled back by the snapshot counts as spent, so the
/// region never admits more than its allowance in the window.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolled_back_fallback_counter_counts_as_spent() {
    let allowance = 30;
    let window = 20;
    // The first window ends a few seconds in (time to start both agents and
    // admit), not at the next real boundary.
    let mut w = World::start_clocked(window, Duration::from_secs(5)).await;
    w.policy(
        "atlas",
        "fb",
        json!({"limit": 1000, "window_secs": window, "chunk_min": 1, "chunk_max": 5, "fallback_per_region": allowance}),
    )
    .await;
    let sw = FaultProxy::in_front_of(&w.stack.alloc.base).await.expect("fault proxy");
    let a = w.agent("eu", "eu-1", Some(&sw.http_url()), &[]).await;
    let b = w.agent("eu", "eu-2", Some(&sw.http_url()), &[]).await;
    let mut tally = Tally::default();
    admit_until(&a.http, "fb", 5, &mut tally).await;
    admit_until(&b.http, "fb", 5, &mut tally).await;
    // A region first seen empty counts its first window's fallback as
    // spent (the crate doc): the partition comes in the next window.
    let next = w.clock.next_window(window, Duration::from_millis(300)).await;
    admit_until(&a.http, "fb", 3, &mut tally).await;
    sw.set(Fault::Blackhole);
    // Spend the leases, then some of the fallback.
    let mut during = Tally::default();
    while during.fallback() < 10 {
        let r = acquire(&a.http, "atlas", "fb").await;
        assert_ne!(r.status, 500, "{}", r.body);
        during.add(&r);
        assert!(during.statuses.values().sum::<i64>() < 5_000, "no fallback admits: {during:?}");
    }
    let _: String = redis_cmd(&w.redis.url, &mut redis::cmd("SAVE")).await;
    drain_both(&a.http, &a.http, "fb", &mut during, 5).await;
    assert_eq!(during.fallback(), allowance, "the allowance is spent before the crash: {during:?}");
    w.redis.restart_from_snapshot();
    drain_both(&a.http, &b.http, "fb", &mut during, 10).await;
    assert!(w.clock.now().timestamp() < next + window, "the phase outgrew its window");
    tally.merge(&during);
    for (ws, (_, fb)) in &tally.by_window {
        assert!(*fb <= allowance, "window {ws}: {fb} fallback admits > allowance {allowance}: {tally:?}");
    }
    sw.set(Fault::Pass);
    ledger_never_counts_twice(&w, "fb", &tally).await;
}

/// F14: thousands of acquires for names without a policy answer 404 and
/// leave no Redis key, no registry entry and no task; a real quota then
/// answers 200, also after the agent restarts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_quota_names_leave_nothing_behind() {
    let w = World::start().await;
    w.policy("atlas", "real", json!({"limit": 1000, "window_secs": 3600})).await;
    let mut a = w.agent("eu", "eu-1", None, &[]).await;
    assert_eq!(acquire(&a.http, "atlas", "real").await.status, 200);
    let before = keys(&w.redis.url).await.len();
    let names = 3_000;
    let mut tasks = Vec::new();
    for c in 0..4 {
        let http = a.http.clone();
        tasks.push(tokio::spawn(async move {
            for i in (c..names).step_by(4) {
                let body = json!({"tenant": "churn", "resource": format!("typo-{i}")});
                // On a loaded machine the one grant that tells the agent the
                // name is unknown may time out (503, nothing decided); the
                // name must still end in 404 and leave nothing behind.
                let mut r = http.post("/v1/acquire", &body).await;
                for _ in 0..5 {
                    if (r.status, r.error()) != (503, "allocator_unreachable") {
                        break;
                    }
                    r = http.post("/v1/acquire", &body).await;
                }
                assert_eq!((r.status, r.error()), (404, "unknown_quota"), "{}", r.body);
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    // A repeated unknown name is answered from the negative cache.
    let r = acquire(&a.http, "churn", "typo-1").await;
    assert_eq!((r.status, r.error()), (404, "unknown_quota"));
    let ks = keys(&w.redis.url).await;
    assert!(!ks.iter().any(|k| k.contains("churn")), "keys of unknown names: {:?}", &ks[..ks.len().min(10)]);
    assert!(ks.len() <= before + 2, "{} keys before, {} after the churn", before, ks.len());
    let text = a.http.get("/metrics").await.body.as_str().unwrap_or_default().to_string();
    let held = quota_tests::http::metric(&text, "agent_quotas").unwrap_or(-1.0);
    assert!((0.0..=2.0).contains(&held), "the agent holds {held} quotas after the churn");
    // A new real quota still answers 200, also after a restart.
    w.policy("atlas", "new", json!({"limit": 1000, "window_secs": 3600})).await;
    assert_eq!(acquire(&a.http, "atlas", "new").await.status, 200);
    a.stop(libc::SIGTERM);
    a.start().await;
    for resource in ["real", "new"] {
        let r = acquire(&a.http, "atlas", resource).await;
        assert_eq!(r.status, 200, "{resource} after restart: {}", r.body);
    }
    let r = acquire(&a.http, "churn", "typo-7").await;
    assert_eq!((r.status, r.error()), (404, "unknown_quota"));
}

/// I8: two replicas of one region whose clocks are 30 s ahead and behind,
/// cut off from the allocator: per real window at most the region's
/// fallback allowance is admitted (one counter per real window, taken from
/// the region's one clock, not from each replica's).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn skewed_replicas_share_one_fallback_counter_per_real_window() {
    let allowance = 12;
    let window = 20;
    // The allocator's window ends a few seconds in (time to start both
    // agents and admit), not at the next real boundary; the replicas' own
    // clocks are 30 s off the allocator's, as before.
    let w = World::start_clocked(window, Duration::from_secs(5)).await;
    w.policy(
        "atlas",
        "skew",
        json!({"limit": 1000, "window_secs": window, "chunk_min": 1, "chunk_max": 5, "fallback_per_region": allowance}),
    )
    .await;
    let sw = FaultProxy::in_front_of(&w.stack.alloc.base).await.expect("fault proxy");
    let skewed = |ms| w.clock.agent_env(ms);
    let (var, ahead_ms) = skewed(30_000);
    let ahead = w.agent("eu", "eu-1", Some(&sw.http_url()), &[(&var, &ahead_ms)]).await;
    let (var, behind_ms) = skewed(-30_000);
    let behind = w.agent("eu", "eu-2", Some(&sw.http_url()), &[(&var, &behind_ms)]).await;
    let mut warm = Tally::default();
    admit_until(&ahead.http, "skew", 3, &mut warm).await;
    admit_until(&behind.http, "skew", 3, &mut warm).await;
    // Line up with the start of a real window so the partition phase fits in it.
    let next = w.clock.next_window(window, Duration::from_millis(500)).await;
    sw.set(Fault::Blackhole);
    let mut during = Tally::default();
    let mut fallback_in_real_window = 0;
    let mut refused = [0; 2];
    let mut i = 0;
    while refused.iter().any(|r| *r < 5) {
        let sent = w.clock.now().timestamp();
        assert!(sent < next + window - 1, "the partition phase outgrew its window: {during:?}");
        let which = i % 2;
        i += 1;
        let http = if which == 0 { &ahead.http } else { &behind.http };
        let r = acquire(http, "atlas", "skew").await;
        assert_ne!(r.status, 500, "{}", r.body);
        during.add(&r);
        if r.status == 200 {
            refused[which] = 0;
            if r.body["source"] == "fallback" {
                fallback_in_real_window += 1;
            }
        } else {
            refused[which] += 1;
        }
    }
    assert!(fallback_in_real_window > 0, "no fallback admit at all: {during:?}");
    assert!(
        fallback_in_real_window <= allowance,
        "{fallback_in_real_window} fallback admits in one real window > allowance {allowance}: {during:?}"
    );
    sw.set(Fault::Pass);
}

/// F04: every key either has a TTL that fits its purpose or is bounded by
/// the live quotas and agents: after a churn of agent ids and quotas, only
/// the region's incarnation key and outbox lists with undelivered entries
/// live without a TTL, and no `fb:` counter outlives its window by much.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_key_expires_or_is_bounded_after_a_churn_of_agents_and_quotas() {
    let w = World::start().await;
    let window = 60;
    for r in ["k1", "k2", "k3"] {
        w.policy(
            "atlas",
            r,
            json!({"limit": 1000, "window_secs": window, "chunk_max": 20, "fallback_per_region": 5}),
        )
        .await;
    }
    let sw = FaultProxy::in_front_of(&w.stack.alloc.base).await.expect("fault proxy");
    for id in 0..4 {
        let mut a = w.agent("eu", &format!("eu-pod-{id}"), Some(&sw.http_url()), &[]).await;
        let mut t = Tally::default();
        for r in ["k1", "k2", "k3"] {
            admit_until(&a.http, r, 3, &mut t).await;
        }
        if id == 3 {
            // Fallback admits make `fb:` counters.
            sw.set(Fault::Blackhole);
            for _ in 0..200 {
                let r = acquire(&a.http, "atlas", "k1").await;
                if r.status == 200 && r.body["source"] == "fallback" {
                    break;
                }
            }
            sw.set(Fault::Pass);
        }
        for i in 0..300 {
            let _ = a
                .http
                .post("/v1/acquire", &json!({"tenant": "gone", "resource": format!("x{id}-{i}")}))
                .await;
        }
        a.stop(libc::SIGTERM);
    }
    let mut c = redis_conn(&w.redis.url).await;
    let ks = keys(&w.redis.url).await;
    assert!(!ks.iter().any(|k| k.contains("gone")), "keys of unknown names");
    let mut without_ttl = Vec::new();
    for k in &ks {
        let ttl: i64 = redis::cmd("PTTL").arg(k).query_async(&mut c).await.unwrap();
        if ttl == -1 {
            without_ttl.push(k.clone());
        }
        if k.contains(":fb:") {
            assert!(ttl <= (window + 61) * 1000, "{k} lives {ttl} ms, longer than its window");
        }
        if k.contains(":fence:") {
            assert!(ttl > 0 && ttl <= 2 * 86_400_000, "{k}: {ttl}");
        }
    }
    for k in &without_ttl {
        let allowed = k.ends_with(":inc") && k.starts_with("r:") || k.contains(":ob:");
        assert!(allowed, "{k} has no TTL (all without: {without_ttl:?})");
    }
}
