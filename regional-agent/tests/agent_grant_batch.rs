//! Renewals in batches: the grants an agent needs for many quotas at once
//! leave as few `POST /v1/grants` requests with `items`, and every quota is
//! served as if each had its own request. Real allocator on PostgreSQL,
//! Redis and the agent as a process.

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
