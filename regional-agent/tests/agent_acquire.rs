//! `POST /v1/acquire` end to end: a real allocator on PostgreSQL, Redis and
//! agents as processes.

mod common;

use common::{acquire, Tally, World};
use serde_json::json;

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
    assert!(r
        .header("ratelimit")
        .is_some_and(|v| v.starts_with(&format!("\"atlas/read\";r={first_remaining};t="))));

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
