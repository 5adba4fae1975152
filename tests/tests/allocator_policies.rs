//! Policies: validation, versions, If-Match, and I9 (a change applies to the
//! open window at once and to every later window, nothing deleted by hand).

use quota_tests::db::{self, Table};
use quota_tests::fixtures::{grant, grant_body, pool_rows, put_policy, register, table_counts, Stack};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn policy_versions_increase_and_get_returns_the_policy_in_force() {
    let s = Stack::start().await;
    let p1 = put_policy(&s.http, "atlas", "read", json!({"limit": 1000, "window_secs": 60})).await;
    assert_eq!(p1["version"], 1);
    assert_eq!(p1["chunk_min"], 10);
    assert_eq!(p1["chunk_max"], 100);
    assert_eq!(p1["lease_ttl_secs"], 30);
    assert_eq!(p1["fallback_per_region"], 10);
    assert_eq!(p1["fail_mode"], "bounded");
    assert_eq!(p1["on_stale"], "keep");
    let p2 = put_policy(
        &s.http,
        "atlas",
        "read",
        json!({"limit": 500, "window_secs": 60, "fail_mode": "strict", "on_stale": "fail_mode"}),
    )
    .await;
    assert_eq!(p2["version"], 2);
    assert_eq!(p2["fallback_per_region"], 0);
    assert_eq!(p2["on_stale"], "fail_mode");
    let got = s.http.get("/v1/policies/atlas/read").await.expect(200);
    assert_eq!(got.body, p2);
    let r = s.http.get("/v1/policies/atlas/write").await.expect(404);
    assert_eq!(r.error(), "unknown_quota");
    let versions = db::rows(&s.alloc.state.db, Table::PolicyVersion).await;
    assert_eq!(versions, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn if_match_refuses_a_concurrent_edit_with_412() {
    let s = Stack::start().await;
    put_policy(&s.http, "atlas", "read", json!({"limit": 1000, "window_secs": 60})).await;
    let ok = s
        .http
        .put_with("/v1/policies/atlas/read", &json!({"limit": 900, "window_secs": 60}), &[("if-match", "1")])
        .await
        .expect(200);
    assert_eq!(ok.body["version"], 2);
    let r = s
        .http
        .put_with("/v1/policies/atlas/read", &json!({"limit": 800, "window_secs": 60}), &[("if-match", "1")])
        .await
        .expect(412);
    assert_eq!(r.error(), "version_mismatch");
    assert_eq!(s.http.get("/v1/policies/atlas/read").await.body["limit"], 900);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_policies_are_422_naming_the_field_and_change_nothing() {
    let s = Stack::start().await;
    put_policy(&s.http, "atlas", "read", json!({"limit": 1000, "window_secs": 60})).await;
    let before = table_counts(&s.alloc.state.db).await;
    let cases = [
        (json!({"limit": 1000, "window_secs": 7}), "window_secs"),
        (json!({"limit": 1000, "window_secs": 172800}), "window_secs"),
        (json!({"limit": 0, "window_secs": 60}), "limit"),
        (json!({"limit": -5, "window_secs": 60}), "limit"),
        (json!({"limit": 100, "window_secs": 60, "chunk_min": 50, "chunk_max": 10}), "chunk_min"),
        (json!({"limit": 100, "window_secs": 60, "chunk_max": 101}), "chunk_max"),
        (json!({"limit": 100, "window_secs": 60, "lease_ttl_secs": 0}), "lease_ttl_secs"),
        (json!({"limit": 100, "window_secs": 60, "fail_mode": "lenient"}), "fail_mode"),
        (json!({"limit": 100, "window_secs": 60, "on_stale": "sometimes"}), "on_stale"),
        (
            json!({"limit": 100, "window_secs": 60, "fail_mode": "strict", "fallback_per_region": 3}),
            "fallback_per_region",
        ),
        (json!({"limit": "100", "window_secs": 60}), "limit"),
        (json!({"limit": 1e30, "window_secs": 60}), "limit"),
        (json!({"limit": 100, "window_secs": 60, "colour": "blue"}), "colour"),
        (
            json!({"limit": 100, "window_secs": 60, "per_key": {"rate_per_sec": 0, "burst": 5}}),
            "per_key.rate_per_sec",
        ),
        (
            json!({"limit": 100, "window_secs": 60, "per_key": {"rate_per_sec": 1, "burst": 0}}),
            "per_key.burst",
        ),
        (json!({"limit": 100, "window_secs": 60, "per_key": {"rate_per_sec": 1}}), "burst"),
        (json!({"limit": 100, "window_secs": 60, "per_key": {"rate_per_sec": 1, "burst": 2, "x": 1}}), "x"),
    ];
    for (body, field) in cases {
        let r = s.http.put("/v1/policies/atlas/read", &body).await;
        assert_eq!(r.status, 422, "{body}: {}", r.body);
        assert!(r.body["message"].as_str().unwrap().contains(field), "{body}: {}", r.body);
    }
    let r = s
        .http
        .put(&format!("/v1/policies/{}/read", "x".repeat(65)), &json!({"limit": 1, "window_secs": 60}))
        .await
        .expect(422);
    assert!(r.body["message"].as_str().unwrap().contains("tenant"));
    assert_eq!(table_counts(&s.alloc.state.db).await, before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn i9_raising_and_lowering_the_limit_applies_to_the_open_window_at_once() {
    let s = Stack::start().await;
    put_policy(&s.http, "atlas", "read", json!({"limit": 100, "window_secs": 3600, "chunk_max": 100})).await;
    let epoch = register(&s.http, "eu", "eu-1").await;
    let r = grant(&s.http, &grant_body("atlas", "read", "eu", "eu-1", epoch, 1, 100, 10.0)).await.expect(200);
    assert_eq!(r.body["tokens"], 100);
    assert_eq!(
        grant(&s.http, &grant_body("atlas", "read", "eu", "eu-1", epoch, 2, 50, 10.0)).await.body["tokens"],
        0
    );

    // Raise: more is available in the same window, at once.
    put_policy(&s.http, "atlas", "read", json!({"limit": 300, "window_secs": 3600, "chunk_max": 100})).await;
    let r = grant(&s.http, &grant_body("atlas", "read", "eu", "eu-1", epoch, 3, 100, 10.0)).await.expect(200);
    assert_eq!(r.body["tokens"], 100);
    assert_eq!(r.body["policy_version"], 2);
    assert_eq!(r.body["pool"], json!({"limit": 300, "granted": 200, "available": 100}));

    // Lower below what is granted: issued leases stay, new grants get nothing.
    put_policy(&s.http, "atlas", "read", json!({"limit": 150, "window_secs": 3600, "chunk_max": 100})).await;
    let r = grant(&s.http, &grant_body("atlas", "read", "eu", "eu-1", epoch, 4, 10, 10.0)).await.expect(200);
    assert_eq!(r.body["tokens"], 0);
    assert_eq!(r.body["pool"]["limit"], 150);
    let (pools, leased) = pool_rows(&s.alloc.state.db, "atlas", "read").await;
    assert_eq!(pools, vec![(150, 200, 0)], "no lease revoked, limit current");
    assert_eq!(leased, 200);

    // Returns below the new limit make room again under the lowered limit.
    let first = grant(&s.http, &grant_body("atlas", "read", "eu", "eu-1", epoch, 1, 100, 10.0)).await;
    let first_id = first.body["lease_id"].as_str().unwrap();
    s.http
        .post(&format!("/v1/leases/{first_id}/release"), &json!({"epoch": epoch, "unspent": 100}))
        .await
        .expect(200);
    let r = grant(&s.http, &grant_body("atlas", "read", "eu", "eu-1", epoch, 5, 100, 10.0)).await.expect(200);
    assert_eq!(r.body["tokens"], 50, "limit 150 - (200 - 100) held");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn i9_a_pool_created_for_the_next_window_takes_a_later_change() {
    let s = Stack::start().await;
    put_policy(&s.http, "atlas", "read", json!({"limit": 100, "window_secs": 3600})).await;
    // A future pool exists (e.g. from a prefetch); make one directly.
    let now = chrono::Utc::now().timestamp();
    let next = (now / 3600 + 1) * 3600;
    db::insert_pool(&s.alloc.state.db, "atlas", "read", next, 3600, 100).await;
    put_policy(&s.http, "atlas", "read", json!({"limit": 700, "window_secs": 3600})).await;
    let (pools, _) = pool_rows(&s.alloc.state.db, "atlas", "read").await;
    assert_eq!(pools, vec![(700, 0, 0)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_per_key_bucket_is_kept_with_its_version_and_told_with_every_grant() {
    let s = Stack::start().await;
    let body = json!({"limit": 1000, "window_secs": 60, "per_key": {"rate_per_sec": 8.5, "burst": 8}});
    let p1 = put_policy(&s.http, "atlas", "read", body).await;
    assert_eq!(p1["per_key"], json!({"rate_per_sec": 8.5, "burst": 8}));
    assert_eq!(s.http.get("/v1/policies/atlas/read").await.expect(200).body, p1);
    let epoch = register(&s.http, "eu", "eu-1").await;
    let g1 = grant(&s.http, &grant_body("atlas", "read", "eu", "eu-1", epoch, 1, 10, 1.0)).await.expect(200);
    assert_eq!(g1.body["per_key"], json!({"rate_per_sec": 8.5, "burst": 8}));

    // Dropped in version 2: later grants say so; a replay of the first
    // grant answers exactly as first granted (version 1, its bucket).
    let p2 = put_policy(&s.http, "atlas", "read", json!({"limit": 1000, "window_secs": 60})).await;
    assert!(p2.get("per_key").is_none(), "{p2}");
    let g2 = grant(&s.http, &grant_body("atlas", "read", "eu", "eu-1", epoch, 2, 10, 1.0)).await.expect(200);
    assert!(g2.body.get("per_key").is_none(), "{}", g2.body);
    assert_eq!(g2.body["policy_version"], 2);
    let replay =
        grant(&s.http, &grant_body("atlas", "read", "eu", "eu-1", epoch, 1, 10, 1.0)).await.expect(200);
    assert_eq!(replay.body["per_key"], g1.body["per_key"]);
    assert_eq!(replay.body["policy_version"], 1);

    let v = s.http.get("/v1/policies/atlas/read/versions").await.expect(200);
    let versions = v.body["versions"].as_array().expect("versions");
    assert_eq!(versions[0]["per_key_rate_milli"], 8500);
    assert_eq!(versions[0]["per_key_burst"], 8);
    assert!(versions[1].get("per_key_rate_milli").is_none(), "{}", versions[1]);
}
