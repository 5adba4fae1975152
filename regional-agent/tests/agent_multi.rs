//! Several quotas of one tenant in one decision (`resources`): every limit
//! allows and is debited, or nothing is (F08, F18), with the key's buckets
//! checked first. Real allocator on PostgreSQL, Redis and agents as
//! processes.

mod common;

use common::World;
use quota_tests::http::{Http, Resp};
use serde_json::{json, Value};

async fn acquire_both(http: &Http, resources: &[(&str, i64)], key: Option<&str>) -> Resp {
    let mut body = json!({
        "tenant": "atlas",
        "resources": resources.iter().map(|(r, c)| json!({"resource": r, "cost": c})).collect::<Vec<_>>(),
    });
    if let Some(k) = key {
        body["key"] = json!(k);
    }
    http.post("/v1/acquire", &body).await
}

/// The result of `resource` in an admit's `results`.
fn result_of<'a>(r: &'a Resp, resource: &str) -> &'a Value {
    r.body["results"]
        .as_array()
        .and_then(|a| a.iter().find(|p| p["resource"] == json!(resource)))
        .unwrap_or_else(|| panic!("no result for {resource}: {}", r.body))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_quotas_under_concurrency_are_debited_together_or_not_at_all() {
    let w = World::start().await;
    common::multi_quota_all_or_nothing(&w).await;
}

/// The seeds' example (seed 000): read is 20/s per tenant and 8/s per user,
/// write 2/s and 1/s; a write also reads. A user over its write cap gets
/// 429 `per_key` naming write, and neither quota nor the read bucket moves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_over_one_quotas_cap_debits_no_quota_and_no_other_bucket() {
    let w = World::start().await;
    w.policy(
        "atlas",
        "read",
        json!({"limit": 1000, "window_secs": 3600, "per_key": {"rate_per_sec": 0.001, "burst": 8}}),
    )
    .await;
    w.policy(
        "atlas",
        "write",
        json!({"limit": 1000, "window_secs": 3600, "per_key": {"rate_per_sec": 0.001, "burst": 1}}),
    )
    .await;
    let a = w.agent("eu", "eu-1", None, &[]).await;
    let both = [("read", 1), ("write", 1)];

    let first = acquire_both(&a.http, &both, Some("alice")).await.expect(200);
    assert_eq!(result_of(&first, "read")["key_remaining"], json!(7), "{}", first.body);
    assert_eq!(result_of(&first, "write")["key_remaining"], json!(0), "{}", first.body);
    // The headers describe the most restrictive limit: none has fewer
    // units left than alice's empty write bucket.
    let rl = first.header("ratelimit").unwrap_or_default();
    assert!(rl.contains(";r=0;"), "RateLimit: {rl}");

    for _ in 0..3 {
        let r = acquire_both(&a.http, &both, Some("alice")).await.expect(429);
        assert_eq!(r.body["error"], json!("per_key_limited"), "{}", r.body);
        assert_eq!(r.body["limit"], json!("per_key"));
        assert_eq!(r.body["resource"], json!("write"));
    }
    // Alice's read bucket kept its 7 (the write refusal came before any
    // debit), and she may still read alone.
    assert_eq!(w.bucket_tokens("read", "alice").await, Some(7));
    let read =
        a.http.post("/v1/acquire", &json!({"tenant": "atlas", "resource": "read", "key": "alice"})).await;
    assert_eq!(read.expect(200).body["key_remaining"], json!(6));
    // Bob is a different principal.
    acquire_both(&a.http, &both, Some("bob")).await.expect(200);

    // The allocator counts 3 reads and 2 writes: the refusals debited no quota.
    w.wait_consumed("read", 3).await;
    w.wait_consumed("write", 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_names_its_quotas_one_way_and_each_once() {
    let w = World::start().await;
    w.policy("atlas", "read", json!({"limit": 1000, "window_secs": 3600})).await;
    let a = w.agent("eu", "eu-1", None, &[]).await;
    let cases = [
        (json!({"tenant": "atlas", "resource": "read", "resources": [{"resource": "read"}]}), "resources"),
        (json!({"tenant": "atlas", "resources": []}), "resources"),
        (json!({"tenant": "atlas", "resources": [{"resource": "read"}, {"resource": "read"}]}), "resources"),
        (json!({"tenant": "atlas", "resources": [{"resource": "read", "cost": 0}]}), "resources"),
        (json!({"tenant": "atlas", "resources": [{"resource": "read", "colour": 1}]}), "resources"),
        (json!({"tenant": "atlas", "resources": [{"resource": "read"}], "cost": 2}), "cost"),
        (json!({"tenant": "atlas"}), "resource"),
    ];
    for (body, field) in cases {
        let r = a.http.post("/v1/acquire", &body).await.expect(422);
        assert_eq!(r.body["field"], json!(field), "{body}: {}", r.body);
    }
    let nine: Vec<Value> = (0..9).map(|i| json!({"resource": format!("r{i}")})).collect();
    let r = a.http.post("/v1/acquire", &json!({"tenant": "atlas", "resources": nine})).await.expect(422);
    assert_eq!(r.body["field"], json!("resources"));
    // An unknown quota among known ones: 404 naming it, nothing debited.
    let r = acquire_both(&a.http, &[("read", 1), ("nope", 1)], None).await.expect(404);
    assert!(r.body["message"].as_str().unwrap_or_default().contains("atlas/nope"), "{}", r.body);
    // A request id stands for its quotas and costs.
    let body = |c: i64| {
        json!({"tenant": "atlas", "request_id": "r-1",
            "resources": [{"resource": "read", "cost": c}]})
    };
    let first = a.http.post("/v1/acquire", &body(2)).await.expect(200);
    let again = a.http.post("/v1/acquire", &body(2)).await.expect(200);
    assert_eq!(first.body["remaining"], again.body["remaining"], "the repeat answers the first decision");
    let other = a.http.post("/v1/acquire", &body(3)).await.expect(409);
    assert!(other.body["message"].as_str().unwrap_or_default().contains("cost 2"), "{}", other.body);
}
