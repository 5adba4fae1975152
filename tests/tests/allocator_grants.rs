//! Grants against a real PostgreSQL: I1 under concurrency with several
//! allocator replicas, I2 clamp, I3 replay and mismatch, I4 stale epochs.

use chrono::Duration;
use quota_tests::app::{Options, TestAllocator};
use quota_tests::fixtures::{
    at, clocked, grant, grant_body, pool_rows, put_policy, register, table_counts, Stack,
};
use quota_tests::http::Http;
use rand::Rng;
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn i1_four_allocators_500_concurrent_grants_never_oversubscribe_the_pool() {
    let db = quota_tests::pg::TestDb::start().await;
    let mut allocs = Vec::new();
    for _ in 0..4 {
        allocs.push(
            TestAllocator::spawn_with(&db.url, Options { max_connections: Some(8), ..Default::default() })
                .await,
        );
    }
    let http: Vec<Http> = allocs.iter().map(|a| Http::new(&a.base)).collect();
    put_policy(
        &http[0],
        "atlas",
        "read",
        json!({"limit": 1000, "window_secs": 3600, "chunk_min": 1, "chunk_max": 200, "lease_ttl_secs": 3600}),
    )
    .await;
    let mut epochs = Vec::new();
    for i in 0..10 {
        epochs.push(register(&http[i % 4], &format!("r{}", i % 3), &format!("a{i}")).await);
    }
    let mut tasks = Vec::new();
    for n in 0..500 {
        let h = http[n % 4].clone();
        let agent = n % 10;
        let epoch = epochs[agent];
        let want = rand::rng().random_range(1..=60);
        tasks.push(tokio::spawn(async move {
            let body = grant_body(
                "atlas",
                "read",
                &format!("r{}", agent % 3),
                &format!("a{agent}"),
                epoch,
                n as i64,
                want,
                50.0,
            );
            // Like an agent, retry the same key on 503 (pool or lock wait
            // timed out under this load): a retry is idempotent (I3).
            let mut r = grant(&h, &body).await;
            for attempt in 1..=40 {
                if r.status != 503 {
                    break;
                }
                tokio::time::sleep(std::time::Duration::from_millis(25 * attempt.min(8))).await;
                r = grant(&h, &body).await;
            }
            let r = r.expect(200);
            let tokens = r.body["tokens"].as_i64().unwrap();
            assert!(tokens >= 0 && tokens <= want, "{}", r.body);
            tokens
        }));
    }
    let mut total = 0;
    for t in tasks {
        total += t.await.unwrap();
    }
    assert!(total <= 1000, "granted {total} > G");
    let (pools, leased) = pool_rows(&allocs[0].state.db, "atlas", "read").await;
    assert_eq!(pools.len(), 1);
    let (limit, granted, returned) = pools[0];
    assert_eq!(limit, 1000);
    assert_eq!(granted, total, "pool row must match the answers");
    assert_eq!(leased, total, "pool row must match the lease rows");
    assert_eq!(returned, 0);
    // With 500 requests of up to 60 each, demand far exceeds G: the pool is used up.
    assert_eq!(total, 1000, "the pool should be fully granted under this load");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn i2_lease_is_clamped_to_the_window_end() {
    let (_db, clock, alloc, http) = clocked(Some(at("2026-12-02T10:00:30Z"))).await;
    put_policy(&http, "atlas", "read", json!({"limit": 1000, "window_secs": 60, "lease_ttl_secs": 30})).await;
    let epoch = register(&http, "eu", "eu-1").await;
    // 300 ms before a UTC minute ends, set just before the grant: the
    // start-up above can take longer than that on a loaded machine.
    clock.set_now(at("2026-12-02T10:00:59.700Z"));
    let r = grant(&http, &grant_body("atlas", "read", "eu", "eu-1", epoch, 1, 50, 10.0)).await.expect(200);
    let expires_at = at(r.body["expires_at"].as_str().unwrap());
    let window_end = at(r.body["window_end"].as_str().unwrap());
    assert_eq!(window_end, at("2026-12-02T10:01:00Z"));
    assert_eq!(r.body["window_start"], "2026-12-02T10:00:00Z");
    assert_eq!(expires_at, window_end, "ttl 30 s must be clamped to the window end");
    let in_ms = r.body["expires_in_ms"].as_i64().unwrap();
    assert!((0..=300).contains(&in_ms), "expires_in_ms {in_ms} must be relative to the window end");

    // Mid-window the ttl applies.
    clock.set_now(at("2026-12-02T10:05:10Z"));
    let r = grant(&http, &grant_body("atlas", "read", "eu", "eu-1", epoch, 2, 50, 10.0)).await.expect(200);
    let issued = at("2026-12-02T10:05:10Z");
    let expires_at = at(r.body["expires_at"].as_str().unwrap());
    assert!(
        expires_at - issued >= Duration::seconds(30) && expires_at - issued < Duration::seconds(31),
        "{}",
        r.body
    );

    // Every lease row satisfies the clamp (also enforced by a check constraint).
    assert_eq!(quota_tests::db::leases_past_window_end(&alloc.state.db).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn i2_next_window_only_within_the_last_lease_ttl_and_clamped_to_its_end() {
    let (_db, clock, _alloc, http) = clocked(Some(at("2026-12-02T10:00:20Z"))).await;
    put_policy(&http, "atlas", "read", json!({"limit": 1000, "window_secs": 60, "lease_ttl_secs": 10})).await;
    let epoch = register(&http, "eu", "eu-1").await;
    let mut body = grant_body("atlas", "read", "eu", "eu-1", epoch, 1, 50, 10.0);
    body["window"] = json!("next");
    let r = grant(&http, &body).await.expect(422);
    assert_eq!(r.error(), "invalid_field");
    assert!(r.body["message"].as_str().unwrap().contains("window"), "{}", r.body);

    clock.set_now(at("2026-12-02T10:00:55Z"));
    body["seq"] = json!(2);
    let r = grant(&http, &body).await.expect(200);
    assert_eq!(r.body["window_start"], "2026-12-02T10:01:00Z");
    assert_eq!(r.body["window_end"], "2026-12-02T10:02:00Z");
    let expires_at = at(r.body["expires_at"].as_str().unwrap());
    // The life of a prefetched lease counts from the start of its window.
    assert_eq!(expires_at, at("2026-12-02T10:01:10Z"), "{}", r.body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn i3_replay_returns_the_same_lease_and_debits_nothing_and_mismatch_is_refused() {
    let s = Stack::start().await;
    put_policy(&s.http, "atlas", "read", json!({"limit": 1000, "window_secs": 3600})).await;
    let epoch = register(&s.http, "eu", "eu-1").await;
    let body = grant_body("atlas", "read", "eu", "eu-1", epoch, 7, 80, 10.0);
    let first = grant(&s.http, &body).await.expect(200);
    assert!(first.header("idempotent-replayed").is_none());
    let replay = grant(&s.http, &body).await.expect(200);
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    for field in [
        "lease_id",
        "tokens",
        "expires_at",
        "window_start",
        "window_end",
        "pool",
        "policy_version",
        "seq",
        "epoch",
    ] {
        assert_eq!(first.body[field], replay.body[field], "{field}");
    }
    assert!(replay.body["expires_in_ms"].as_i64() <= first.body["expires_in_ms"].as_i64());
    let (pools, leased) = pool_rows(&s.alloc.state.db, "atlas", "read").await;
    assert_eq!(pools[0].1, 80, "a replay debits nothing");
    assert_eq!(leased, 80);

    let before = table_counts(&s.alloc.state.db).await;
    let mut other = body.clone();
    other["want"] = json!(81);
    let r = grant(&s.http, &other).await.expect(409);
    assert_eq!(r.error(), "idempotency_mismatch");
    assert_eq!(table_counts(&s.alloc.state.db).await, before, "a mismatch changes nothing");

    // Concurrent replays of one key still produce one lease.
    let body = grant_body("atlas", "read", "eu", "eu-1", epoch, 8, 10, 10.0);
    let answers = futures::future::join_all((0..16).map(|_| grant(&s.http, &body))).await;
    let ids: std::collections::BTreeSet<String> = answers
        .iter()
        .map(|r| r.clone().expect(200).body["lease_id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(ids.len(), 1);
    let (pools, _) = pool_rows(&s.alloc.state.db, "atlas", "read").await;
    assert_eq!(pools[0].1, 90);

    let events = s.http.get("/v1/ledger?tenant=atlas&resource=read").await.expect(200);
    let kinds: Vec<&str> =
        events.body["events"].as_array().unwrap().iter().map(|e| e["kind"].as_str().unwrap()).collect();
    assert_eq!(kinds.iter().filter(|k| **k == "granted").count(), 2);
    assert_eq!(kinds.iter().filter(|k| **k == "replayed").count(), 16);
    assert!(kinds.contains(&"refused"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn i4_stale_epoch_is_refused_for_grant_release_and_report_and_changes_nothing() {
    let s = Stack::start().await;
    put_policy(&s.http, "atlas", "read", json!({"limit": 1000, "window_secs": 3600})).await;
    let old = register(&s.http, "eu", "eu-1").await;
    let lease =
        grant(&s.http, &grant_body("atlas", "read", "eu", "eu-1", old, 1, 50, 10.0)).await.expect(200);
    let lease_id = lease.body["lease_id"].as_str().unwrap().to_string();
    let window_start = lease.body["window_start"].clone();
    let new = register(&s.http, "eu", "eu-1").await;
    assert!(new > old);
    let before = table_counts(&s.alloc.state.db).await;

    let r = grant(&s.http, &grant_body("atlas", "read", "eu", "eu-1", old, 2, 50, 10.0)).await.expect(409);
    assert_eq!(r.error(), "stale_epoch");
    let r = s
        .http
        .post(&format!("/v1/leases/{lease_id}/release"), &json!({"epoch": old, "unspent": 10}))
        .await
        .expect(409);
    assert_eq!(r.error(), "stale_epoch");
    let report = json!({"region": "eu", "agent": "eu-1", "epoch": old, "report_id": "r-1",
        "items": [{"tenant": "atlas", "resource": "read", "window_start": window_start, "consumed": 5, "fallback_admitted": 0}]});
    let r = s.http.post("/v1/reports", &report).await.expect(409);
    assert_eq!(r.error(), "stale_epoch");
    assert_eq!(table_counts(&s.alloc.state.db).await, before, "stale requests change nothing");

    let refused = s.http.get("/v1/ledger?region=eu").await.expect(200);
    let reasons: Vec<&str> = refused.body["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["kind"] == "refused")
        .map(|e| e["reason"].as_str().unwrap())
        .collect();
    assert_eq!(reasons, ["stale_epoch", "stale_epoch", "stale_epoch"]);

    // The current epoch may release its predecessor's lease.
    let r = s
        .http
        .post(&format!("/v1/leases/{lease_id}/release"), &json!({"epoch": new, "unspent": 10}))
        .await
        .expect(200);
    assert_eq!(r.body["returned"], 10);
    // An epoch never issued is not accepted either.
    let r =
        grant(&s.http, &grant_body("atlas", "read", "eu", "eu-1", new + 5, 3, 50, 10.0)).await.expect(422);
    assert!(r.body["message"].as_str().unwrap().contains("never issued"));
    let r = grant(&s.http, &grant_body("atlas", "read", "eu", "ghost", 1, 3, 50, 10.0)).await.expect(404);
    assert_eq!(r.error(), "unknown_agent");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn empty_pool_answers_zero_tokens_with_retry_after() {
    let s = Stack::start().await;
    put_policy(&s.http, "atlas", "read", json!({"limit": 100, "window_secs": 3600, "chunk_max": 100})).await;
    let epoch = register(&s.http, "eu", "eu-1").await;
    grant(&s.http, &grant_body("atlas", "read", "eu", "eu-1", epoch, 1, 100, 10.0)).await.expect(200);
    let r = grant(&s.http, &grant_body("atlas", "read", "eu", "eu-1", epoch, 2, 10, 10.0)).await.expect(200);
    assert_eq!(r.body["tokens"], 0);
    assert_eq!(r.body["pool"], json!({"limit": 100, "granted": 100, "available": 0}));
    assert!(r.body["retry_after_ms"].as_i64().unwrap() >= 1);
}
