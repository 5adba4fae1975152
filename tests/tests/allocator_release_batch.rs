//! `POST /v1/leases/release`: several releases in one request, each
//! decided as `POST /v1/leases/{lease_id}/release` would decide it
//! (idempotent per lease, epoch-fenced, I4) and answered item by item with
//! the single form's status and body; the batch's own bounds refused as a
//! whole.

use quota_tests::fixtures::{grant, grant_body, pool_rows, put_policy, register, table_counts, Stack};
use serde_json::{json, Value};

/// A stack with two quotas and one lease of `tokens` on each, granted to
/// `eu-1`; answers the stack, the epoch and the lease ids.
async fn leased(tokens: i64) -> (Stack, i64, String, String) {
    let s = Stack::start().await;
    for resource in ["read", "write"] {
        put_policy(
            &s.http,
            "atlas",
            resource,
            json!({"limit": 1000, "window_secs": 3600, "chunk_min": 1, "chunk_max": 200, "lease_ttl_secs": 600}),
        )
        .await;
    }
    let epoch = register(&s.http, "eu", "eu-1").await;
    let read =
        grant(&s.http, &grant_body("atlas", "read", "eu", "eu-1", epoch, 1, tokens, 1.0)).await.expect(200);
    let write =
        grant(&s.http, &grant_body("atlas", "write", "eu", "eu-1", epoch, 2, tokens, 1.0)).await.expect(200);
    let id = |r: &Value| r["lease_id"].as_str().expect("lease_id").to_string();
    (s, epoch, id(&read.body), id(&write.body))
}

fn item(lease_id: &str, epoch: i64, unspent: i64) -> Value {
    json!({"lease_id": lease_id, "epoch": epoch, "unspent": unspent})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_batch_answers_item_by_item_with_the_single_forms_codes() {
    let (s, old, read, write) = leased(50).await;
    // A new epoch: the old one is fenced out (I4), the new one may release
    // its predecessor's leases.
    let epoch = register(&s.http, "eu", "eu-1").await;
    let unknown = uuid::Uuid::new_v4().to_string();
    let batch = json!({"items": [
        item(&read, epoch, 20),
        item(&write, old, 10),
        item(&unknown, epoch, 1),
        item(&write, epoch, 51),
    ]});
    let r = s.http.post("/v1/leases/release", &batch).await.expect(200);
    let answers = r.body["items"].as_array().expect("items");
    let statuses: Vec<i64> = answers.iter().map(|a| a["status"].as_i64().unwrap()).collect();
    assert_eq!(statuses, [200, 409, 404, 422], "{}", r.body);
    assert_eq!(answers[0]["lease"]["lease_id"], read.as_str());
    assert_eq!(answers[0]["lease"]["returned"], 20, "{}", answers[0]);
    assert_eq!(answers[1]["error"]["error"], "stale_epoch");
    assert_eq!(answers[2]["error"]["error"], "unknown_lease");
    assert_eq!(answers[3]["error"]["error"], "invalid_field");
    assert_eq!(answers[3]["error"]["field"], "items[3].unspent", "{}", answers[3]);
    assert_eq!(answers[3]["error"]["item"], 3);
    // Only the accepted item changed a pool: read got 20 back, write none.
    assert_eq!(pool_rows(&s.alloc.state.db, "atlas", "read").await.0, vec![(1000, 50, 20)]);
    assert_eq!(pool_rows(&s.alloc.state.db, "atlas", "write").await.0, vec![(1000, 50, 0)]);

    // Idempotent per item: the same release again returns nothing more, a
    // different unspent for a released lease is a mismatch for that item
    // only, and the single form agrees with the batch.
    let again = json!({"items": [item(&read, epoch, 20), item(&read, epoch, 5), item(&write, epoch, 10)]});
    let r = s.http.post("/v1/leases/release", &again).await.expect(200);
    let statuses: Vec<i64> =
        r.body["items"].as_array().unwrap().iter().map(|a| a["status"].as_i64().unwrap()).collect();
    assert_eq!(statuses, [200, 409, 200], "{}", r.body);
    assert_eq!(r.body["items"][1]["error"]["error"], "idempotency_mismatch");
    assert_eq!(r.body["items"][2]["lease"]["returned"], 10);
    assert_eq!(pool_rows(&s.alloc.state.db, "atlas", "read").await.0, vec![(1000, 50, 20)]);
    assert_eq!(pool_rows(&s.alloc.state.db, "atlas", "write").await.0, vec![(1000, 50, 10)]);
    let single = s
        .http
        .post(&format!("/v1/leases/{write}/release"), &json!({"epoch": epoch, "unspent": 10}))
        .await
        .expect(200);
    assert_eq!(single.body["returned"], 10);

    // The ledger has one release per lease, and the refusals.
    let ledger = s.http.get("/v1/ledger?tenant=atlas&resource=write&limit=100").await.expect(200).body;
    let kinds: Vec<&str> =
        ledger["events"].as_array().unwrap().iter().filter_map(|e| e["kind"].as_str()).collect();
    assert_eq!(kinds.iter().filter(|k| **k == "released").count(), 1, "{kinds:?}");
    assert!(kinds.contains(&"refused"), "the stale release is in the ledger: {kinds:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_batch_out_of_bounds_is_refused_whole_and_changes_nothing() {
    let (s, epoch, read, _) = leased(100).await;
    let before = table_counts(&s.alloc.state.db).await;

    let r = s.http.post("/v1/leases/release", &json!({"items": []})).await.expect(422);
    assert_eq!(r.body["field"], "items", "{}", r.body);
    let many: Vec<Value> = (0..65).map(|_| item(&read, epoch, 1)).collect();
    let r = s.http.post("/v1/leases/release", &json!({"items": many})).await.expect(422);
    assert_eq!(r.body["field"], "items", "{}", r.body);
    assert!(r.body["message"].as_str().unwrap().contains("64"), "{}", r.body);
    // A malformed item names its place; fields beside items are refused.
    let r = s
        .http
        .post("/v1/leases/release", &json!({"items": [{"lease_id": "nope", "epoch": 1, "unspent": 0}]}))
        .await
        .expect(422);
    assert!(r.body["message"].as_str().unwrap().contains("items[0]"), "{}", r.body);
    let r = s
        .http
        .post("/v1/leases/release", &json!({"items": [item(&read, epoch, 1)], "epoch": 1}))
        .await
        .expect(422);
    assert_eq!(r.body["error"], "invalid_field", "{}", r.body);
    assert_eq!(table_counts(&s.alloc.state.db).await, before);

    // 64 items is the bound: the same release 64 times is applied once.
    let full: Vec<Value> = (0..64).map(|_| item(&read, epoch, 30)).collect();
    let r = s.http.post("/v1/leases/release", &json!({"items": full})).await.expect(200);
    let answers = r.body["items"].as_array().unwrap();
    assert_eq!(answers.len(), 64);
    assert!(answers.iter().all(|a| a["status"] == 200 && a["lease"]["returned"] == 30), "{}", r.body);
    assert_eq!(pool_rows(&s.alloc.state.db, "atlas", "read").await.0, vec![(1000, 100, 30)]);
}
