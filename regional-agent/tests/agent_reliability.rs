//! Nothing lost around the outbox and the allocator (issue 15): request ids
//! tied to their request, refusals classified (dead letters), outboxes of
//! replaced agents sent by the region, a token rotation, heal within a
//! second, and a bounded shutdown with Redis and the allocator gone.

mod common;

use common::{acquire, bin, Tally, World};
use quota_tests::agent::{AgentOpts, AgentProc};
use quota_tests::app::{Options, TestAllocator};
use quota_tests::http::Http;
use quota_tests::proxy::{host_port, Fault, FaultProxy};
use quota_tests::wait;
use serde_json::{json, Value};
use std::cell::RefCell;
use std::time::{Duration, Instant};

async fn redis_conn(url: &str) -> redis::aio::MultiplexedConnection {
    let client = redis::Client::open(url).expect("redis url");
    client.get_multiplexed_async_connection().await.expect("redis connection")
}

/// The agent's outbox list of one quota (the key layout of `keys.rs`,
/// written out so a change of it is a visible test change).
fn outbox_key(tenant: &str, resource: &str, agent: &str) -> String {
    format!("q:{{{}:{tenant}}}:{}:{resource}:ob:{agent}", tenant.len(), resource.len())
}

/// Entries in eu-1's outboxes of the first `n` quotas of `names`.
async fn outbox_entries(
    conn: &mut redis::aio::MultiplexedConnection,
    names: &[String],
    n: usize,
) -> redis::RedisResult<i64> {
    let mut total = 0;
    for q in names.iter().take(n) {
        total += redis::cmd("LLEN").arg(outbox_key("atlas", q, "eu-1")).query_async::<i64>(conn).await?;
    }
    Ok(total)
}

async fn status(http: &Http) -> Value {
    http.get("/v1/status").await.expect(200).body
}

async fn metrics_value(http: &Http, name: &str) -> Option<f64> {
    let text = http.get("/metrics").await.body;
    quota_tests::http::metric(text.as_str().unwrap_or_default(), &format!("{name} "))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_id_is_tied_to_its_resource_and_cost() {
    let w = World::start().await;
    for r in ["a", "b"] {
        w.policy("atlas", r, json!({"limit": 1000, "window_secs": 3600, "chunk_max": 50})).await;
    }
    let a = w.agent("eu", "eu-1", None, &[]).await;
    let ask = |resource: &str, cost: i64| json!({"tenant": "atlas", "resource": resource, "cost": cost, "request_id": "order-7"});
    let first = a.http.post("/v1/acquire", &ask("a", 2)).await.expect(200);
    let again = a.http.post("/v1/acquire", &ask("a", 2)).await.expect(200);
    assert_eq!(first.body["remaining"], again.body["remaining"], "a repeat answers the first decision");
    for (resource, cost) in [("a", 3), ("b", 2), ("b", 1)] {
        let r = a.http.post("/v1/acquire", &ask(resource, cost)).await;
        assert_eq!((r.status, r.error()), (409, "request_id_mismatch"), "{resource} {cost}: {}", r.body);
        assert!(r.body["message"].as_str().unwrap_or_default().contains("\"a\""), "{}", r.body);
    }
    // Only `a` was charged, once: 2 tokens.
    let mut expected = Tally::default();
    let ws = common::norm(first.body["window_start"].as_str().unwrap_or_default());
    expected.by_window.insert(ws, (2, 0));
    w.wait_accounting("atlas", "a", &expected.by_window).await;
    assert!(w.admitted_by_window("atlas", "b").await.is_empty(), "b was never charged");
    // The claim lives until the window's end plus the margin, not longer.
    let mut conn = redis_conn(&w.redis.url).await;
    let pttl: i64 =
        redis::cmd("PTTL").arg("t:{5:atlas}:rid:7:order-7").query_async(&mut conn).await.expect("PTTL");
    let now = chrono::Utc::now().timestamp_millis();
    let to_end = 3_600_000 - now.rem_euclid(3_600_000);
    assert!(pttl > 0 && pttl <= to_end + 10_000 + 50, "claim ttl {pttl} ms, window ends in {to_end} ms");
    // A refused request does not hold its id: a strict quota at its limit.
    w.policy("atlas", "c", json!({"limit": 1, "window_secs": 3600, "chunk_max": 1})).await;
    let c1 = json!({"tenant": "atlas", "resource": "c", "request_id": "c-1"});
    let c2 = json!({"tenant": "atlas", "resource": "c", "request_id": "c-2"});
    a.http.post("/v1/acquire", &c1).await.expect(200);
    let refused = a.http.post("/v1/acquire", &c2).await;
    assert!(matches!(refused.status, 429 | 503), "{}", refused.body);
    let mut retry = c2.clone();
    retry["resource"] = json!("a");
    a.http.post("/v1/acquire", &retry).await.expect(200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_for_good_go_to_dead_letters_and_a_bad_item_alone() {
    let w = World::start().await;
    w.policy("atlas", "p", json!({"limit": 1000, "window_secs": 60, "chunk_max": 50})).await;
    let a = w.agent("eu", "eu-1", None, &[]).await;
    let ok = acquire(&a.http, "atlas", "p").await.expect(200);
    let ws =
        chrono::DateTime::parse_from_rfc3339(ok.body["window_start"].as_str().unwrap()).unwrap().timestamp();
    let mut tally = Tally::default();
    tally.add(&ok);
    // Entries the allocator must refuse: a report whose first item is of a
    // window in the future (named by the allocator) and whose second is
    // good, and a release of a lease that never existed.
    let mut conn = redis_conn(&w.redis.url).await;
    let ob = outbox_key("atlas", "p", "eu-1");
    let report = json!({"k": "rep", "rid": "injected-1", "items": [[ws + 3600, 5, 0], [ws, 4, 0]]});
    let release = json!({"k": "rel", "id": uuid::Uuid::new_v4().to_string(), "u": 3});
    let _: i64 = redis::cmd("RPUSH")
        .arg(&ob)
        .arg(report.to_string())
        .arg(release.to_string())
        .query_async(&mut conn)
        .await
        .expect("RPUSH");
    // The good item is applied (4 more consumed), the bad one is not.
    tally.by_window.values_mut().for_each(|v| v.0 += 4);
    w.wait_accounting("atlas", "p", &tally.by_window).await;
    let s = quota_tests::wait::until("two dead letters", Duration::from_secs(10), || {
        let http = a.http.clone();
        async move {
            let s = status(&http).await;
            (s["dead_letters"] == json!(2)).then_some(s)
        }
    })
    .await;
    let letters = s["recent_dead_letters"].as_array().cloned().unwrap_or_default();
    let codes: Vec<&str> = letters.iter().map(|l| l["error"].as_str().unwrap_or_default()).collect();
    assert!(codes.contains(&"unknown_lease") && codes.contains(&"invalid_field"), "{letters:?}");
    let item = letters.iter().find(|l| l["error"] == "invalid_field").unwrap();
    assert_eq!(item["entry"]["items"], json!([[ws + 3600, 5, 0]]), "only the bad item: {item}");
    let left: i64 = redis::cmd("LLEN").arg(&ob).query_async(&mut conn).await.expect("LLEN");
    assert_eq!(left, 0, "nothing stuck in the outbox");
    assert_eq!(metrics_value(&a.http, "agent_outbox_dead_letters_total").await, Some(2.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_replaced_during_a_partition_loses_no_report() {
    let w = World::start().await;
    w.policy("atlas", "p", json!({"limit": 10000, "window_secs": 3600, "chunk_max": 200})).await;
    let sw = FaultProxy::in_front_of(&w.stack.alloc.base).await.expect("fault proxy");
    let mut old = w.agent("eu", "eu-old", Some(&sw.http_url()), &[]).await;
    let mut tally = Tally::default();
    for _ in 0..30 {
        tally.add(&acquire(&old.http, "atlas", "p").await.expect(200));
    }
    // Leases in hand; the allocator becomes unreachable; admits from them
    // are cut into the old pod's outbox and cannot be sent.
    sw.set(Fault::Blackhole);
    for _ in 0..200 {
        let r = acquire(&old.http, "atlas", "p").await;
        tally.add(&r);
        if r.status != 200 {
            break;
        }
    }
    let mut conn = redis_conn(&w.redis.url).await;
    let ob = outbox_key("atlas", "p", "eu-old");
    let depth = quota_tests::wait::until("old pod's outbox holds a report", Duration::from_secs(10), || {
        let mut c = conn.clone();
        let ob = ob.clone();
        async move {
            let n: i64 = redis::cmd("LLEN").arg(&ob).query_async(&mut c).await.ok()?;
            (n > 0).then_some(n)
        }
    })
    .await;
    assert!(depth > 0);
    // The pod is killed and replaced under a new name; the network heals.
    old.stop(libc::SIGKILL);
    sw.set(Fault::Pass);
    let new = w.agent("eu", "eu-new", None, &[]).await;
    for _ in 0..10 {
        tally.add(&acquire(&new.http, "atlas", "p").await.expect(200));
    }
    // The replacement adopts the old pod's outbox once its liveness expires
    // (10 s): the allocator's accounting then equals the clients' count.
    let (w_ref, expected) = (&w, &tally.by_window);
    let matched = wait::poll(Duration::from_secs(40), Duration::from_millis(200), || async move {
        let got = w_ref.admitted_by_window("atlas", "p").await;
        if &got == expected {
            Ok(())
        } else {
            Err(got)
        }
    })
    .await;
    if let Err(got) = matched {
        panic!("accounting {got:?} never matched {:?}", tally.by_window);
    }
    let n: i64 = redis::cmd("LLEN").arg(&ob).query_async(&mut conn).await.expect("LLEN");
    assert_eq!(n, 0, "the old pod's outbox was sent");
    assert!(new.log().contains("adopting the outbox of a gone agent"), "{}", new.log());
    assert_eq!(status(&new.http).await["dead_letters"], json!(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_rotation_loses_nothing() {
    let w = World::start().await;
    w.policy("atlas", "p", json!({"limit": 100000, "window_secs": 3600, "chunk_min": 1, "chunk_max": 100}))
        .await;
    let with = |token: &str| Options { agent_token: Some(token.into()), ..Default::default() };
    let first = TestAllocator::spawn_with(&w.stack.db.url, with("right-token")).await;
    let sw = FaultProxy::in_front_of(&first.base).await.expect("fault proxy");
    let a = w.agent("eu", "eu-1", Some(&sw.http_url()), &[("QUOTA_AGENT_TOKEN", "right-token")]).await;
    let mut tally = Tally::default();
    for _ in 0..20 {
        tally.add(&acquire(&a.http, "atlas", "p").await.expect(200));
    }
    // The allocator restarts with another agent token for 5 s.
    first.stop().await;
    let wrong = TestAllocator::spawn_with(&w.stack.db.url, with("another-token")).await;
    sw.set_upstreams(vec![host_port(&wrong.base)]);
    let until = Instant::now() + Duration::from_secs(5);
    while Instant::now() < until {
        let r = acquire(&a.http, "atlas", "p").await;
        assert_ne!(r.status, 500, "{}", r.body);
        tally.add(&r);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    wrong.stop().await;
    let right = TestAllocator::spawn_with(&w.stack.db.url, with("right-token")).await;
    sw.set_upstreams(vec![host_port(&right.base)]);
    quota_tests::wait::until("admits again", Duration::from_secs(10), || {
        let http = a.http.clone();
        async move { (acquire(&http, "atlas", "p").await.status == 200).then_some(()) }
    })
    .await;
    // That admit is not in the tally: count afresh from the allocator after
    // a few more counted ones.
    let r = acquire(&a.http, "atlas", "p").await.expect(200);
    tally.add(&r);
    tally.by_window.values_mut().for_each(|v| v.0 += 1);
    w.wait_accounting("atlas", "p", &tally.by_window).await;
    let s = status(&a.http).await;
    assert_eq!(s["dead_letters"], json!(0), "{s}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_region_admits_from_a_fresh_lease_within_a_second_of_heal() {
    let w = World::start().await;
    w.policy(
        "atlas",
        "s",
        json!({"limit": 100000, "window_secs": 3600, "chunk_min": 1, "chunk_max": 20, "fail_mode": "strict"}),
    )
    .await;
    let sw = FaultProxy::in_front_of(&w.stack.alloc.base).await.expect("fault proxy");
    let a = w.agent("eu", "eu-1", Some(&sw.http_url()), &[]).await;
    for _ in 0..5 {
        acquire(&a.http, "atlas", "s").await.expect(200);
    }
    sw.set(Fault::Blackhole);
    // Long enough for the breaker and every backoff to reach their caps.
    let until = Instant::now() + Duration::from_secs(6);
    let mut during = Tally::default();
    while Instant::now() < until {
        during.add(&acquire(&a.http, "atlas", "s").await);
    }
    assert_eq!(during.count(429, "quota_exhausted"), 0, "no 429 while unreachable: {during:?}");
    assert!(during.count(503, "allocator_unreachable") > 0, "{during:?}");
    sw.set(Fault::Pass);
    let healed = Instant::now();
    // Every answer until the first 200, for the report.
    let after = RefCell::new(Tally::default());
    let (http, seen) = (&a.http, &after);
    let admitted = wait::poll(Duration::from_secs(5), Duration::from_millis(10), || async move {
        let r = acquire(http, "atlas", "s").await;
        seen.borrow_mut().add(&r);
        (r.status == 200).then(|| healed.elapsed()).ok_or(())
    })
    .await;
    let after = after.into_inner();
    let first_admit = admitted.unwrap_or_else(|()| panic!("no admit 5 s after heal: {after:?}"));
    println!(
        "first admit {} ms after heal; answers before it: {:?}",
        first_admit.as_millis(),
        after.statuses
    );
    assert!(first_admit < Duration::from_secs(1), "first admit {first_admit:?} after heal: {after:?}");
    assert_eq!(after.count(429, "quota_exhausted"), 0, "a 429 while the pool had tokens: {after:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_is_bounded_with_redis_and_the_allocator_gone() {
    let w = World::start().await;
    const QUOTAS: usize = 2000;
    // Policies straight into the allocator, a few at a time.
    let names: Vec<String> = (0..QUOTAS).map(|i| format!("q{i}")).collect();
    for chunk in names.chunks(50) {
        let puts = chunk.iter().map(|n| {
            let http = w.stack.http.clone();
            let n = n.clone();
            async move {
                http.put(
                    &format!("/v1/policies/atlas/{n}"),
                    &json!({"limit": 1000, "window_secs": 3600, "chunk_max": 20}),
                )
                .await
                .expect(200);
            }
        });
        futures::future::join_all(puts).await;
    }
    let sw = FaultProxy::in_front_of(&w.stack.alloc.base).await.expect("fault proxy");
    let mut a = w.agent("eu", "eu-1", Some(&sw.http_url()), &[]).await;
    for chunk in names.chunks(16) {
        let asks = chunk.iter().map(|n| {
            let http = a.http.clone();
            let n = n.clone();
            async move {
                // A first acquire waits for one grant; on a loaded machine
                // that grant may miss the allocator timeout (503): retry.
                let mut status = 0;
                for _ in 0..5 {
                    status = acquire(&http, "atlas", &n).await.status;
                    if status != 503 {
                        break;
                    }
                }
                status
            }
        });
        let statuses = futures::future::join_all(asks).await;
        assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
    }
    let mut conn = redis_conn(&w.redis.url).await;
    quota_tests::wait::until("2000 quotas in the agent's set", Duration::from_secs(30), || {
        let mut c = conn.clone();
        async move {
            let n: i64 = redis::cmd("SCARD").arg("a:{2:eu/4:eu-1}:quotas").query_async(&mut c).await.ok()?;
            (n >= QUOTAS as i64).then_some(())
        }
    })
    .await;
    // Leases in hand for a few quotas (demand measured), then admits the
    // allocator cannot hear about: the outbox holds them.
    // A 503 here is a grant that missed the allocator timeout on a loaded
    // machine (the breaker then opens for at most 500 ms): ask again until
    // admitted, within a deadline.
    for _ in 0..3 {
        for n in names.iter().take(40) {
            quota_tests::wait::until("an admit of a leased quota", Duration::from_secs(20), || {
                let http = a.http.clone();
                async move { (acquire(&http, "atlas", n).await.status == 200).then_some(()) }
            })
            .await;
        }
    }
    quota_tests::wait::until("leases for the first quotas", Duration::from_secs(20), || {
        let http = a.http.clone();
        async move {
            let s = status(&http).await;
            let with = s["quotas"]
                .as_array()?
                .iter()
                .filter(|q| q["lease_tokens"].as_i64().unwrap_or(0) > 0)
                .count();
            (with >= 20).then_some(())
        }
    })
    .await;
    sw.set(Fault::Blackhole);
    for n in names.iter().take(40) {
        let _ = acquire(&a.http, "atlas", n).await;
    }
    quota_tests::wait::until("entries in the outboxes", Duration::from_secs(20), || {
        let mut c = conn.clone();
        let names = names.clone();
        async move { (outbox_entries(&mut c, &names, 40).await.ok()? > 0).then_some(()) }
    })
    .await;
    // Redis stops answering (SIGSTOP: connections hang) and the allocator
    // is partitioned: SIGTERM must still end the process within 6 s (+1 s
    // for the machine).
    w.redis.signal(libc::SIGSTOP);
    let t = Instant::now();
    let exit = a.stop(libc::SIGTERM).expect("exit status");
    let took = t.elapsed();
    w.redis.signal(libc::SIGCONT);
    println!("stopped {} ms after SIGTERM ({exit})", took.as_millis());
    assert!(exit.success(), "exited by itself: {exit}");
    assert!(took < Duration::from_secs(7), "stopped {took:?} after SIGTERM");
    // What it could not send is still in Redis for the region.
    let left = outbox_entries(&mut conn, &names, 40).await.expect("LLEN");
    assert!(left > 0, "the unsent entries stayed in Redis");
    // A second signal ends a stop that is waiting at once.
    sw.set(Fault::Pass);
    a.start().await;
    w.redis.signal(libc::SIGSTOP);
    a.signal(libc::SIGTERM);
    // It stops serving once the first signal's stop is under way (and
    // waiting on the stopped Redis); the task that handles a second signal
    // was spawned just before.
    wait::until("the agent's stop under way", Duration::from_secs(10), || {
        let http = a.http.clone();
        async move { http.get_status("/healthz").await.is_none().then_some(()) }
    })
    .await;
    let t = Instant::now();
    let _ = a.stop(libc::SIGTERM);
    let second = t.elapsed();
    w.redis.signal(libc::SIGCONT);
    assert!(second < Duration::from_secs(1), "second signal: exited {second:?} after it");
    // And a fresh start sends everything: nothing was lost.
    let b = AgentProc::spawn(bin(), AgentOpts::new("eu", "eu-1", &w.stack.alloc.base, &w.redis.url)).await;
    let names = &names;
    let drained = wait::poll(Duration::from_secs(30), Duration::from_millis(200), || {
        let mut c = conn.clone();
        async move {
            let n = outbox_entries(&mut c, names, 40).await.expect("LLEN");
            if n == 0 {
                Ok(())
            } else {
                Err(n)
            }
        }
    })
    .await;
    if let Err(n) = drained {
        let log = b.log();
        let tail: Vec<&str> = log.lines().rev().take(40).collect();
        panic!("{n} entries left 30 s after a restart; log tail (newest first): {tail:#?}");
    }
}
