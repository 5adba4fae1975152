//! Bad input answers the documented 4xx naming the problem, never a 500,
//! and never changes state.

use quota_tests::db::{self, Table};
use quota_tests::fixtures::{grant_body, put_policy, register, table_counts, Stack};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_grant_requests_get_the_right_4xx_and_change_nothing() {
    let s = Stack::start().await;
    put_policy(&s.http, "atlas", "read", json!({"limit": 1000, "window_secs": 60})).await;
    let epoch = register(&s.http, "eu", "eu-1").await;
    let good = grant_body("atlas", "read", "eu", "eu-1", epoch, 1, 10, 5.0);
    let before = table_counts(&s.alloc.state.db).await;
    let ledger_before = db::rows(&s.alloc.state.db, Table::LedgerEvent).await;

    // Malformed JSON.
    for raw in ["{", "not json", "{\"tenant\": }", ""] {
        let r = s.http.raw("POST", "/v1/grants", Some("application/json"), raw.as_bytes().to_vec()).await;
        assert_eq!(r.status, 400, "{raw:?}: {}", r.body);
        assert_eq!(r.error(), "malformed_json");
    }
    // Not JSON at all.
    let r = s.http.raw("POST", "/v1/grants", Some("text/plain"), good.to_string().into_bytes()).await;
    assert_eq!(r.status, 415, "{}", r.body);

    // Wrong types, negative and huge numbers, missing and unknown fields, bad ids.
    let mut cases: Vec<(serde_json::Value, &str)> = Vec::new();
    let with = |k: &str, v: serde_json::Value| {
        let mut b = good.clone();
        b[k] = v;
        b
    };
    cases.push((with("want", json!("ten")), "want"));
    cases.push((with("want", json!(-1)), "want"));
    cases.push((with("want", json!(0)), "want"));
    cases.push((with("want", json!(1e300)), "want"));
    cases.push((with("want", json!(9_223_372_036_854_775_807i64)), "want"));
    cases.push((with("seq", json!(-3)), "seq"));
    cases.push((with("epoch", json!(0)), "epoch"));
    cases.push((with("demand_per_sec", json!(-1.0)), "demand_per_sec"));
    cases.push((with("demand_per_sec", json!(1e20)), "demand_per_sec"));
    cases.push((with("window", json!("previous")), "window"));
    cases.push((with("tenant", json!("x".repeat(65))), "tenant"));
    cases.push((with("region", json!("eu/west")), "region"));
    cases.push((with("agent", json!("")), "agent"));
    cases.push((with("colour", json!("blue")), "colour"));
    let mut missing = good.clone();
    missing.as_object_mut().unwrap().remove("want");
    cases.push((missing, "want"));
    for (body, field) in cases {
        let r = s.http.post("/v1/grants", &body).await;
        assert_eq!(r.status, 422, "{body}: {}", r.body);
        assert_eq!(r.error(), "invalid_field");
        assert!(r.body["message"].as_str().unwrap().contains(field), "{field}: {}", r.body);
    }

    // Unknown quota.
    let r = s.http.post("/v1/grants", &with("resource", json!("write"))).await.expect(404);
    assert_eq!(r.error(), "unknown_quota");

    // 65 KiB body.
    let mut big = good.clone();
    big["tenant"] = json!("a".repeat(65 * 1024));
    let r = s.http.raw("POST", "/v1/grants", Some("application/json"), big.to_string().into_bytes()).await;
    assert_eq!(r.status, 413, "{}", r.body);
    assert_eq!(r.error(), "payload_too_large");

    assert_eq!(table_counts(&s.alloc.state.db).await, before, "bad input changes nothing");
    let ledger_after = db::rows(&s.alloc.state.db, Table::LedgerEvent).await;
    assert_eq!(ledger_after, ledger_before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_release_report_and_read_requests_are_4xx() {
    let s = Stack::start().await;
    put_policy(&s.http, "atlas", "read", json!({"limit": 1000, "window_secs": 60})).await;
    let epoch = register(&s.http, "eu", "eu-1").await;
    let lease = s
        .http
        .post("/v1/grants", &grant_body("atlas", "read", "eu", "eu-1", epoch, 1, 10, 5.0))
        .await
        .expect(200);
    let lease_id = lease.body["lease_id"].as_str().unwrap().to_string();
    let ws = lease.body["window_start"].clone();
    let before = table_counts(&s.alloc.state.db).await;

    let r = s
        .http
        .post("/v1/leases/not-a-uuid/release", &json!({"epoch": epoch, "unspent": 1}))
        .await
        .expect(422);
    assert!(r.body["message"].as_str().unwrap().contains("lease_id"));
    let r = s
        .http
        .post(&format!("/v1/leases/{}/release", uuid::Uuid::new_v4()), &json!({"epoch": epoch, "unspent": 1}))
        .await
        .expect(404);
    assert_eq!(r.error(), "unknown_lease");
    let r = s
        .http
        .post(&format!("/v1/leases/{lease_id}/release"), &json!({"epoch": epoch, "unspent": 11}))
        .await
        .expect(422);
    assert!(r.body["message"].as_str().unwrap().contains("unspent"));
    s.http
        .post(&format!("/v1/leases/{lease_id}/release"), &json!({"epoch": epoch, "unspent": -1}))
        .await
        .expect(422);

    let report = |items: serde_json::Value| json!({"region": "eu", "agent": "eu-1", "epoch": epoch, "report_id": "r1", "items": items});
    let item = |consumed: serde_json::Value, ws: serde_json::Value| json!([{"tenant": "atlas", "resource": "read", "window_start": ws, "consumed": consumed, "fallback_admitted": 0}]);
    s.http.post("/v1/reports", &report(item(json!(-1), ws.clone()))).await.expect(422);
    s.http.post("/v1/reports", &report(item(json!(1), json!("yesterday")))).await.expect(422);
    let r =
        s.http.post("/v1/reports", &report(item(json!(1), json!("2026-01-01T00:00:30Z")))).await.expect(422);
    assert!(r.body["message"].as_str().unwrap().contains("window_start"), "{}", r.body);
    let unknown = json!([{"tenant": "atlas", "resource": "nope", "window_start": ws, "consumed": 1, "fallback_admitted": 0}]);
    s.http.post("/v1/reports", &report(unknown)).await.expect(404);
    let many: Vec<_> = (0..501).map(|_| json!({"tenant": "atlas", "resource": "read", "window_start": ws, "consumed": 1, "fallback_admitted": 0})).collect();
    s.http.post("/v1/reports", &report(json!(many))).await.expect(422);

    let r = s.http.get("/v1/windows/atlas/read?from=yesterday").await.expect(422);
    assert!(r.body["message"].as_str().unwrap().contains("from"));
    s.http.get("/v1/windows/atlas/nope").await.expect(404);
    s.http.get("/v1/ledger?limit=0").await.expect(422);
    s.http.get("/v1/ledger?limit=5000").await.expect(422);
    s.http.get("/v1/ledger?cursor=-1").await.expect(422);
    s.http.get("/v1/ledger?region=a%20b").await.expect(422);
    s.http.get("/v1/ledger?bogus=1").await.expect(422);
    let r = s.http.get("/v1/nothing-here").await.expect(404);
    assert_eq!(r.error(), "not_found");
    s.http.post("/v1/agents/register", &json!({"region": "eu"})).await.expect(422);

    assert_eq!(table_counts(&s.alloc.state.db).await, before, "bad input changes nothing");
}
