//! `POST /v1/acquire` end to end: a real allocator on PostgreSQL, Redis and
//! agents as processes.

mod common;

use common::{acquire, Tally, World};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ratelimit_r_is_never_0_on_an_admit_while_the_pool_has_room() {
    // Leases of 5 out of 1000: the region's balance runs to 0 every fifth
    // admit, while the pool still holds most of its tokens.
    let w = World::start().await;
    w.policy("atlas", "read", json!({"limit": 1000, "window_secs": 3600, "chunk_min": 1, "chunk_max": 5}))
        .await;
    let a = w.agent("eu", "eu-1", None, &[]).await;
    let mut balance_hit_0 = 0;
    for n in 1..=40 {
        let r = acquire(&a.http, "atlas", "read").await.expect(200);
        if r.body["remaining"] == json!(0) {
            balance_hit_0 += 1;
        }
        let rl = r.header("ratelimit").unwrap_or_default().to_string();
        let shown: i64 = rl.split(";r=").nth(1).and_then(|v| v.split(';').next()?.parse().ok()).expect(&rl);
        assert!(shown > 0, "admit {n}: {rl} with {} of 1000 spent", n);
        assert!(shown <= 1000 - n, "admit {n}: {rl} shows more than the pool can hold");
    }
    assert!(balance_hit_0 > 0, "the region's balance never ran out: the test did not test");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_answer_names_the_policy_version_that_decided() {
    // Leases of at most 5: the agent asks again every few admits and so
    // learns a new version soon after it is published.
    let w = World::start().await;
    let v1 = json!({"limit": 1000, "window_secs": 3600, "chunk_min": 1, "chunk_max": 5});
    w.policy("atlas", "read", v1.clone()).await;
    w.policy("atlas", "write", v1).await;
    let a = w.agent("eu", "eu-1", None, &[]).await;
    let version = |r: &quota_tests::http::Resp| {
        let header = r.header("quota-policy-version").and_then(|v| v.parse::<i64>().ok());
        assert!(header.is_some(), "no Quota-Policy-Version on {} {}", r.status, r.body);
        header
    };

    let r = acquire(&a.http, "atlas", "read").await.expect(200);
    assert_eq!(r.body["policy_version"], 1, "{}", r.body);
    assert_eq!(version(&r), Some(1));

    // Version 2 spends out what is already leased: once the agent has
    // learned it, its answers name it, and the refusal that follows too.
    w.policy("atlas", "read", json!({"limit": 8, "window_secs": 3600, "chunk_min": 1, "chunk_max": 5})).await;
    let seen = std::sync::Mutex::new(Vec::new());
    let (http, seen_ref) = (&a.http, &seen);
    let refusal = quota_tests::wait::poll(
        std::time::Duration::from_secs(10),
        std::time::Duration::from_millis(20),
        || async move {
            let r = acquire(http, "atlas", "read").await;
            let v = version(&r);
            if r.status == 200 {
                assert_eq!(r.body["policy_version"].as_i64(), v, "body and header agree: {}", r.body);
            }
            seen_ref.lock().unwrap().push((r.status, v));
            if r.status == 429 {
                Ok(r)
            } else {
                Err(())
            }
        },
    )
    .await
    .unwrap_or_else(|()| panic!("no 429 under version 2 within 10 s: {:?}", seen.lock().unwrap()));
    let seen = seen.into_inner().unwrap();
    assert_eq!(refusal.body["error"], "quota_exhausted", "{}", refusal.body);
    assert_eq!(version(&refusal), Some(2), "the refusal names the version that refused");
    // Versions only move forward along the answers.
    let versions: Vec<i64> = seen.iter().filter_map(|(_, v)| *v).collect();
    assert!(versions.windows(2).all(|p| p[0] <= p[1]), "{seen:?}");

    // Several quotas: each part names its own policy's version.
    let r = a
        .http
        .post("/v1/acquire", &json!({"tenant": "atlas", "resources": [{"resource": "write"}]}))
        .await
        .expect(200);
    assert_eq!(r.body["results"][0]["policy_version"], 1, "{}", r.body);
    assert_eq!(r.body["policy_version"], 1, "{}", r.body);

    // The agent counts decisions and refusals per version.
    let text = a.http.get("/metrics").await.expect(200).body.as_str().unwrap_or_default().to_string();
    for series in [
        "agent_quota_decisions_total{quota=\"atlas/read\",version=\"1\"}",
        "agent_quota_decisions_total{quota=\"atlas/read\",version=\"2\"}",
        "agent_quota_refusals_total{quota=\"atlas/read\",code=\"quota_exhausted\",version=\"2\"}",
    ] {
        assert!(text.lines().any(|l| l.starts_with(series)), "{series} missing:\n{text}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquire_admits_from_a_lease_and_bad_input_is_refused_without_charge() {
    let w = World::start().await;
    w.policy("atlas", "read", json!({"limit": 100, "window_secs": 3600})).await;
    let a = w.agent("eu", "eu-1", None, &[]).await;

    let r = acquire(&a.http, "atlas", "read").await.expect(200);
    assert_eq!(r.body["allowed"], json!(true));
    assert_eq!(r.body["source"], json!("lease"));
    assert!(r.body["window_start"].is_string(), "{}", r.body);
    let first_remaining = r.body["remaining"].as_i64().expect("remaining");
    assert_eq!(r.header("ratelimit-policy"), Some("\"atlas/read\";q=100;w=3600"));
    // `remaining` is the region's balance; `r` what the quota can still
    // admit as the agent knows it: that balance plus the pool's unleased
    // rest, 99 of 100 after one admit (one agent, one window).
    assert!(first_remaining < 99, "{}", r.body);
    assert!(
        r.header("ratelimit").is_some_and(|v| v.starts_with("\"atlas/read\";r=99;t=")),
        "{:?}",
        r.header("ratelimit")
    );

    // A repeated request id returns the first decision and charges nothing.
    let body = json!({"tenant": "atlas", "resource": "read", "request_id": "req-1"});
    let d1 = a.http.post("/v1/acquire", &body).await.expect(200);
    let d2 = a.http.post("/v1/acquire", &body).await.expect(200);
    assert_eq!(d1.body, d2.body);

    let bad = [
        (
            a.http.raw("POST", "/v1/acquire", Some("application/json"), b"{not json".to_vec()).await,
            400,
            "malformed_json",
        ),
        (
            a.http.post("/v1/acquire", &json!({"tenant": "atlas", "resource": "read", "cost": 0})).await,
            422,
            "invalid_field",
        ),
        (
            a.http.post("/v1/acquire", &json!({"tenant": "atlas", "resource": "read", "cost": -3})).await,
            422,
            "invalid_field",
        ),
        (
            a.http.post("/v1/acquire", &json!({"tenant": "atlas", "resource": "read", "cost": 101})).await,
            422,
            "invalid_field",
        ),
        (
            a.http.post("/v1/acquire", &json!({"tenant": "atlas", "resource": "read", "cost": "x"})).await,
            422,
            "invalid_field",
        ),
        (
            a.http.post("/v1/acquire", &json!({"tenant": "x".repeat(65), "resource": "read"})).await,
            422,
            "invalid_field",
        ),
        (
            a.http
                .post(
                    "/v1/acquire",
                    &json!({"tenant": "atlas", "resource": "read", "request_id": "r".repeat(129)}),
                )
                .await,
            422,
            "invalid_field",
        ),
        (
            a.http.post("/v1/acquire", &json!({"tenant": "atlas", "resource": "read", "extra": 1})).await,
            422,
            "invalid_field",
        ),
        (a.http.post("/v1/acquire", &json!({"tenant": "atlas"})).await, 422, "invalid_field"),
        (
            a.http.post("/v1/acquire", &json!({"tenant": "nobody", "resource": "read"})).await,
            404,
            "unknown_quota",
        ),
    ];
    for (i, (r, status, code)) in bad.iter().enumerate() {
        assert_eq!((r.status, r.error()), (*status, *code), "case {i}: {}", r.body);
        assert!(
            r.header("ratelimit-policy").is_some() && r.header("ratelimit").is_some(),
            "case {i} headers"
        );
    }

    let r = acquire(&a.http, "atlas", "read").await.expect(200);
    let status = a.http.get("/v1/status").await.expect(200);
    assert_eq!(status.body["quotas"][0]["mode"], json!("leased"), "{}", status.body);

    // Nothing was charged for the refusals or the repeated request id: the
    // allocator learns exactly three admits.
    let mut tally = Tally::default();
    tally.by_window.insert(common::norm(r.body["window_start"].as_str().unwrap()), (3, 0));
    w.wait_accounting("atlas", "read", &tally.by_window).await;

    let m = a.http.get("/metrics").await.expect(200);
    let text = m.body.as_str().unwrap_or_default().to_string();
    assert!(text.contains("agent_acquire_total{outcome=\"invalid_field\"} 8"), "{text}");
    assert!(text.contains("agent_acquire_seconds_count"), "{text}");
    a.http.get("/healthz").await.expect(200);
    a.http.get("/readyz").await.expect(200);
}

/// I5: two replicas of one region, 64 concurrent clients: exactly as many
/// 200s as tokens the allocator granted to the region, none spent twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_and_64_clients_admit_exactly_the_tokens_granted() {
    let w = World::start().await;
    common::i5_two_replicas_64_clients(&w).await;
}

/// A lease spent to zero leaves the live set at once: the spend script scans
/// the live leases on every decision, so a busy region that goes through
/// many small leases must not pay for each of them until it expires.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spent_out_leases_leave_the_live_set() {
    let w = World::start().await;
    w.policy(
        "atlas",
        "small",
        json!({"limit": 10_000, "window_secs": 3600, "chunk_min": 5, "chunk_max": 5, "lease_ttl_secs": 3600}),
    )
    .await;
    let a = w.agent("eu", "eu-1", None, &[]).await;
    let mut tally = Tally::default();
    for _ in 0..60 {
        tally.add(&acquire(&a.http, "atlas", "small").await);
    }
    assert_eq!(tally.admitted(), 60, "every request admitted: {tally:?}");

    let prefix = regional_agent::keys::Keys::new("").quota("atlas", "small");
    let client = redis::Client::open(w.redis_url()).expect("redis url");
    let mut conn = client.get_multiplexed_async_connection().await.expect("redis");
    let live: i64 =
        redis::cmd("ZCARD").arg(format!("{prefix}idx")).query_async(&mut conn).await.expect("ZCARD");
    let books: Vec<String> =
        redis::cmd("KEYS").arg(format!("{prefix}l:*")).query_async(&mut conn).await.expect("KEYS");
    // 60 admits from leases of 5 tokens: at least 12 leases were credited,
    // and only the ones still holding tokens (the current one and a renewal
    // ahead of need) may be live.
    assert!(books.len() >= 12, "lease books: {books:?}");
    assert!(live <= 3, "{live} leases still live after {} were credited", books.len());
    // A finished lease's book is kept only long enough to recognise a
    // replayed grant, not for the counters' week.
    let mut finished = 0;
    for b in &books {
        let done: Option<String> =
            redis::cmd("HGET").arg(b).arg("done").query_async(&mut conn).await.expect("HGET");
        if done.is_some() {
            let ttl: i64 = redis::cmd("PTTL").arg(b).query_async(&mut conn).await.expect("PTTL");
            assert!((1..=600_000).contains(&ttl), "book {b} of a finished lease kept for {ttl} ms");
            finished += 1;
        }
    }
    assert!(finished >= 10, "{finished} finished books of {}", books.len());
}

/// Leases shorter than the window are renewed once as they near their end,
/// not on every renewer tick of their last horizon: only tokens that outlive
/// the horizon count, so a fresh lease stops the renewals.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_leases_are_renewed_once_not_stacked() {
    let w = World::start().await;
    w.policy("atlas", "short", json!({"limit": 1_000_000, "window_secs": 3600, "lease_ttl_secs": 2})).await;
    let a = w.agent("eu", "eu-1", None, &[]).await;
    let prefix = regional_agent::keys::Keys::new("").quota("atlas", "short");
    let client = redis::Client::open(w.redis_url()).expect("redis url");
    let mut conn = client.get_multiplexed_async_connection().await.expect("redis");

    let mut tally = Tally::default();
    let mut most_live = 0i64;
    let started = std::time::Instant::now();
    let mut n = 0u32;
    // About 50 requests per second for 5 s: two and a half lease lives.
    while started.elapsed() < std::time::Duration::from_secs(5) {
        tally.add(&acquire(&a.http, "atlas", "short").await);
        n += 1;
        if n.is_multiple_of(5) {
            let live: i64 =
                redis::cmd("ZCARD").arg(format!("{prefix}idx")).query_async(&mut conn).await.expect("ZCARD");
            most_live = most_live.max(live);
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert_eq!(tally.admitted(), n as i64, "every request admitted: {tally:?}");
    assert!(most_live <= 3, "{most_live} leases live at once");
}

/// A request that waits for a renewal and tries the spend again is one
/// request of demand: counted per try, a region's demand estimate (and so
/// its lease size) grows with every wait, and the tokens it over-asks for
/// are stranded at the window end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_that_waits_counts_its_demand_once() {
    let w = World::start().await;
    w.policy("atlas", "tiny", json!({"limit": 5, "window_secs": 3600})).await;
    let a = w.agent("eu", "eu-1", None, &[]).await;
    let mut tally = Tally::default();
    for _ in 0..5 {
        tally.add(&acquire(&a.http, "atlas", "tiny").await);
    }
    assert_eq!(tally.admitted(), 5, "{tally:?}");
    // The pool is empty now; these find no token, wait for the renewer to
    // learn that, and try again before they answer 429.
    let refused = futures::future::join_all((0..8).map(|_| acquire(&a.http, "atlas", "tiny"))).await;
    for r in &refused {
        tally.add(r);
    }
    assert_eq!(tally.count(429, "quota_exhausted"), 8, "{tally:?}");

    // Refusals answered from the negative cache are counted by the
    // renewer's next round: 13 requests, 13 tokens of demand, once each.
    let prefix = regional_agent::keys::Keys::new("").quota("atlas", "tiny");
    let client = redis::Client::open(w.redis_url()).expect("redis url");
    let demand = || {
        let (client, key) = (client.clone(), format!("{prefix}dem"));
        async move {
            let mut conn = client.get_multiplexed_async_connection().await.expect("redis");
            redis::cmd("GET").arg(&key).query_async::<i64>(&mut conn).await.expect("GET")
        }
    };
    quota_tests::wait::until("13 tokens of demand", std::time::Duration::from_secs(5), || async {
        (demand().await >= 13).then_some(())
    })
    .await;
    assert_eq!(demand().await, 13, "13 requests were made");
}

/// Concurrent requests on one quota are decided in shared runs of the spend
/// script, and sharing a run changes no decision: a request id sent twice at
/// once is admitted once and both answers are the first decision, and the
/// allocator learns exactly the distinct admits. The burst comes right after
/// the quota's first request, before the agent has a demand reading: it is
/// still all admitted (asks were once clamped to one token then, and the
/// burst was answered 429 from a pool of 100,000).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_share_spend_runs_and_each_request_id_is_admitted_once() {
    let w = World::start().await;
    w.policy("atlas", "busy", json!({"limit": 100000, "window_secs": 3600})).await;
    let a = w.agent("eu", "eu-1", None, &[]).await;
    acquire(&a.http, "atlas", "busy").await.expect(200);
    let metric = |text: &str, name: &str| quota_tests::http::metric(text, name).unwrap_or(0.0);
    let before = a.http.get("/metrics").await.expect(200).body.as_str().unwrap_or_default().to_string();

    // 32 clients in 16 pairs; both clients of a pair send the same 25 ids.
    let tasks: Vec<_> = (0..32)
        .map(|i| {
            let http = a.http.clone();
            tokio::spawn(async move {
                let mut answers = Vec::new();
                for n in 0..25 {
                    let id = format!("p{}-{n}", i / 2);
                    let body = json!({"tenant": "atlas", "resource": "busy", "request_id": id});
                    answers.push((id, http.post("/v1/acquire", &body).await));
                }
                answers
            })
        })
        .collect();
    let mut first: std::collections::BTreeMap<String, serde_json::Value> = Default::default();
    let mut tally = Tally::default();
    for t in tasks {
        for (id, r) in t.await.unwrap() {
            let r = r.expect(200);
            match first.get(&id) {
                Some(seen) => assert_eq!(seen, &r.body, "request id {id} answered twice differently"),
                None => {
                    tally.add(&r);
                    first.insert(id, r.body.clone());
                }
            }
        }
    }
    assert_eq!(first.len(), 400);

    let after = a.http.get("/metrics").await.expect(200).body.as_str().unwrap_or_default().to_string();
    let decisions = metric(&after, "agent_acquire_total{outcome=\"lease\"}")
        - metric(&before, "agent_acquire_total{outcome=\"lease\"}");
    let runs = metric(&after, "agent_spend_runs_total") - metric(&before, "agent_spend_runs_total");
    assert_eq!(decisions, 800.0, "{after}");
    assert!(runs > 0.0 && runs < 0.9 * decisions, "{runs} runs for {decisions} decisions: no run was shared");

    // The first admit's window plus the 400 distinct ids.
    let ws = tally.by_window.keys().next().cloned().expect("a window");
    tally.by_window.get_mut(&ws).unwrap().0 += 1;
    w.wait_accounting("atlas", "busy", &tally.by_window).await;
}

/// A flood on a quota whose pool the allocator said is spent is refused
/// from the replica's memory (the negative cache): a few spend script runs
/// in all, not one per attempt, every attempt still 429 `quota_exhausted`
/// with `Retry-After`, and every attempt still counted as demand.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_on_a_spent_quota_costs_a_few_script_runs_and_still_counts_as_demand() {
    let w = World::start().await;
    w.policy("atlas", "tiny", json!({"limit": 5, "window_secs": 3600})).await;
    let a = w.agent("eu", "eu-1", None, &[]).await;
    for _ in 0..5 {
        acquire(&a.http, "atlas", "tiny").await.expect(200);
    }
    // The first refusal learns from the allocator that the pool is spent.
    let first = acquire(&a.http, "atlas", "tiny").await;
    assert_eq!((first.status, first.error()), (429, "quota_exhausted"), "{}", first.body);
    let metric = |text: &str, name: &str| quota_tests::http::metric(text, name).unwrap_or(0.0);
    let scrape =
        || async { a.http.get("/metrics").await.expect(200).body.as_str().unwrap_or_default().to_string() };
    let before = scrape().await;
    let started = std::time::Instant::now();
    const FLOOD: usize = 300;
    let answers = futures::future::join_all((0..4).map(|_| {
        let http = a.http.clone();
        async move {
            let mut v = Vec::new();
            for _ in 0..FLOOD / 4 {
                v.push(acquire(&http, "atlas", "tiny").await);
            }
            v
        }
    }))
    .await;
    let took = started.elapsed();
    let after = scrape().await;
    for r in answers.iter().flatten() {
        assert_eq!((r.status, r.error()), (429, "quota_exhausted"), "{}", r.body);
        assert!(r.headers.contains_key("retry-after"), "{:?}", r.headers);
    }
    let runs = metric(&after, "agent_spend_runs_total") - metric(&before, "agent_spend_runs_total");
    // At most one run per hold (at least 250 ms each), plus the one that
    // renews a hold as it ends.
    let bound = (took.as_millis() / 250) as f64 + 2.0;
    assert!(runs <= bound, "{runs} script runs for {FLOOD} refusals in {took:?} (bound {bound})");
    let held = metric(&after, "agent_negative_cache_refusals_total{limit=\"quota\"}");
    assert!(held >= FLOOD as f64 - runs, "{held} refusals from memory: {after}");

    // Demand: 5 admits, the first refusal and the flood, one token each,
    // counted once each (the held ones by the renewer's next round).
    let prefix = regional_agent::keys::Keys::new("").quota("atlas", "tiny");
    let client = redis::Client::open(w.redis_url()).expect("redis url");
    let want = 6 + FLOOD as i64;
    quota_tests::wait::until(
        "the held refusals counted as demand",
        std::time::Duration::from_secs(10),
        || {
            let (client, key) = (client.clone(), format!("{prefix}dem"));
            async move {
                let mut conn = client.get_multiplexed_async_connection().await.ok()?;
                let demand: i64 = redis::cmd("GET").arg(&key).query_async(&mut conn).await.ok()?;
                (demand == want).then_some(())
            }
        },
    )
    .await;
}
