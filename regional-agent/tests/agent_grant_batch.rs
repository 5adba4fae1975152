//! Renewals and releases in batches: the grants an agent needs for many
//! quotas at once leave as few `POST /v1/grants` requests with `items`, the
//! releases of many quotas' expired leases as few `POST /v1/leases/release`
//! requests, and every quota is served as if each had its own request. Real
//! allocator on PostgreSQL, Redis and the agent as a process.

mod common;

use common::World;
use serde_json::json;

/// A counter's value in Prometheus text, 0 when absent.
fn counter(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|rest| rest.trim().parse::<f64>().ok()))
        .unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_quotas_due_at_once_are_granted_in_batches() {
    const QUOTAS: usize = 32;
    let w = World::start().await;
    for i in 0..QUOTAS {
        w.policy("atlas", &format!("q{i}"), json!({"limit": 1000, "window_secs": 3600})).await;
    }
    let a = w.agent("eu", "eu-1", None, &[]).await;

    // Every quota's first request waits for its first grant: 32 grants due
    // at once.
    let names: Vec<String> = (0..QUOTAS).map(|i| format!("q{i}")).collect();
    let answers = futures::future::join_all(names.iter().map(|n| common::acquire(&a.http, "atlas", n))).await;
    for (i, r) in answers.iter().enumerate() {
        assert_eq!(r.status, 200, "q{i}: {}", r.body);
        assert_eq!(r.body["source"], "lease", "q{i}: {}", r.body);
    }

    let metrics = w.stack.http.get("/metrics").await.expect(200);
    let text = metrics.body.as_str().expect("Prometheus text").to_string();
    let batches = counter(&text, "allocator_grant_batches_total");
    let items = counter(&text, "allocator_grant_batch_items_total");
    assert!(batches >= 1.0, "no batch reached the allocator:\n{text}");
    assert!(items >= 2.0 * batches, "a batch carries several grants: {items} items in {batches} batches");
    // Fewer requests than grants: at most one single request per quota
    // besides the batched items.
    let grants = counter(&text, "allocator_grants_total{outcome=\"granted\"}");
    assert!(grants >= QUOTAS as f64, "{grants} grants for {QUOTAS} quotas");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_leases_of_many_quotas_are_released_in_batches() {
    const QUOTAS: usize = 8;
    let w = World::start().await;
    for i in 0..QUOTAS {
        // Leases living a second: each expires with tokens unspent, which
        // its release gives back.
        w.policy(
            "atlas",
            &format!("r{i}"),
            json!({"limit": 1000, "window_secs": 3600, "chunk_min": 10, "chunk_max": 100, "lease_ttl_secs": 1}),
        )
        .await;
    }
    let a = w.agent("eu", "eu-1", None, &[]).await;
    let names: Vec<String> = (0..QUOTAS).map(|i| format!("r{i}")).collect();

    // A lease is retired by the next decision that scans its quota: a
    // request every 200 ms on each quota, until every quota's ledger shows
    // a release applied.
    let released = |n: String| {
        let http = w.stack.http.clone();
        async move {
            let ledger =
                http.get(&format!("/v1/ledger?tenant=atlas&resource={n}&limit=1000")).await.expect(200).body;
            ledger["events"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|e| e["kind"] == "released" && e["tokens"].as_i64() > Some(0))
        }
    };
    let deadline = std::time::Duration::from_secs(20);
    quota_tests::wait::poll(deadline, std::time::Duration::from_millis(200), || async {
        for n in &names {
            let r = common::acquire(&a.http, "atlas", n).await;
            assert_eq!(r.status, 200, "{n}: {}", r.body);
        }
        let done = futures::future::join_all(names.iter().map(|n| released(n.clone()))).await;
        if done.iter().all(|d| *d) {
            Ok(())
        } else {
            Err(done)
        }
    })
    .await
    .unwrap_or_else(|done| panic!("quotas with a release applied after {deadline:?}: {done:?}\n{}", a.log()));

    // Several releases went in one request.
    let text = w.stack.http.get("/metrics").await.expect(200).body.as_str().unwrap_or_default().to_string();
    let batches = counter(&text, "allocator_release_batches_total");
    let items = counter(&text, "allocator_release_batch_items_total");
    assert!(batches >= 1.0, "no release batch reached the allocator:\n{text}");
    assert!(items >= 2.0 * batches, "a batch carries several releases: {items} items in {batches} batches");
}
