//! `POST /v1/grants` with `items`: each item decided as the single form
//! would decide it (I1–I4) and answered item by item with the single
//! form's status and body; the batch's own bounds refused as a whole.

use quota_tests::fixtures::{grant, grant_body, pool_rows, put_policy, register, table_counts, Stack};
use serde_json::{json, Value};

async fn stack_with_policy() -> Stack {
    let s = Stack::start().await;
    put_policy(
        &s.http,
        "atlas",
        "read",
        json!({"limit": 1000, "window_secs": 3600, "chunk_min": 1, "chunk_max": 200, "lease_ttl_secs": 600}),
    )
    .await;
    put_policy(
        &s.http,
        "atlas",
        "write",
        json!({"limit": 100, "window_secs": 3600, "chunk_min": 1, "chunk_max": 100, "lease_ttl_secs": 600}),
    )
    .await;
    s
}

fn items(bodies: &[Value]) -> Value {
    json!({ "items": bodies })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_answers_item_by_item_with_the_single_forms_codes() {
    let s = stack_with_policy().await;
    let epoch = register(&s.http, "eu", "eu-1").await;
    let old = epoch;
    let epoch = register(&s.http, "eu", "eu-1").await;
    let batch = items(&[
        grant_body("atlas", "read", "eu", "eu-1", epoch, 1, 50, 10.0),
        grant_body("atlas", "write", "eu", "eu-1", epoch, 2, 30, 10.0),
        grant_body("atlas", "nope", "eu", "eu-1", epoch, 3, 5, 10.0),
        grant_body("atlas", "read", "eu", "eu-1", old, 4, 5, 10.0),
        grant_body("atlas", "read", "eu", "eu-1", epoch, 5, 0, 10.0),
    ]);
    let r = grant(&s.http, &batch).await.expect(200);
    let answers = r.body["items"].as_array().expect("items");
    assert_eq!(answers.len(), 5, "{}", r.body);
    let statuses: Vec<i64> = answers.iter().map(|a| a["status"].as_i64().unwrap()).collect();
    assert_eq!(statuses, [200, 200, 404, 409, 422], "{}", r.body);
    assert_eq!(answers[0]["grant"]["tokens"], 50);
    assert_eq!(answers[0]["grant"]["resource"], "read");
    assert_eq!(answers[0]["replayed"], false);
    assert_eq!(answers[1]["grant"]["tokens"], 30);
    assert_eq!(answers[2]["error"]["error"], "unknown_quota");
    assert_eq!(answers[3]["error"]["error"], "stale_epoch");
    assert_eq!(answers[4]["error"]["error"], "invalid_field");
    assert_eq!(answers[4]["error"]["field"], "items[4].want", "{}", answers[4]);
    assert_eq!(answers[4]["error"]["item"], 4);

    // The pools hold exactly what the answers granted.
    assert_eq!(pool_rows(&s.alloc.state.db, "atlas", "read").await.0[0].1, 50);
    assert_eq!(pool_rows(&s.alloc.state.db, "atlas", "write").await.0[0].1, 30);

    // I3 per item: the same batch again replays the leases and debits
    // nothing; the single form replays them too.
    let again = grant(&s.http, &batch).await.expect(200);
    let replay = &again.body["items"][0];
    assert_eq!(replay["replayed"], true);
    assert_eq!(replay["grant"]["lease_id"], answers[0]["grant"]["lease_id"]);
    assert_eq!(again.body["items"][1]["grant"]["lease_id"], answers[1]["grant"]["lease_id"]);
    assert_eq!(pool_rows(&s.alloc.state.db, "atlas", "read").await.0[0].1, 50);
    let single = grant(&s.http, &batch["items"][1]).await.expect(200);
    assert_eq!(single.headers.get("idempotent-replayed").map(|v| v.to_str().unwrap()), Some("true"));
    assert_eq!(single.body["lease_id"], answers[1]["grant"]["lease_id"]);

    // A known key with another body is refused for that item only.
    let mixed = items(&[
        grant_body("atlas", "read", "eu", "eu-1", epoch, 1, 51, 10.0),
        grant_body("atlas", "read", "eu", "eu-1", epoch, 6, 7, 10.0),
    ]);
    let r = grant(&s.http, &mixed).await.expect(200);
    assert_eq!(r.body["items"][0]["status"], 409, "{}", r.body);
    assert_eq!(r.body["items"][0]["error"]["error"], "idempotency_mismatch");
    assert_eq!(r.body["items"][1]["status"], 200);
    assert_eq!(r.body["items"][1]["grant"]["tokens"], 7);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_out_of_bounds_is_refused_whole_and_changes_nothing() {
    let s = stack_with_policy().await;
    let epoch = register(&s.http, "eu", "eu-1").await;
    let before = table_counts(&s.alloc.state.db).await;

    let r = grant(&s.http, &items(&[])).await.expect(422);
    assert_eq!(r.body["field"], "items", "{}", r.body);

    let many: Vec<Value> =
        (0..65).map(|n| grant_body("atlas", "read", "eu", "eu-1", epoch, n, 1, 1.0)).collect();
    let r = grant(&s.http, &items(&many)).await.expect(422);
    assert_eq!(r.body["field"], "items", "{}", r.body);
    assert!(r.body["message"].as_str().unwrap().contains("64"), "{}", r.body);

    // A malformed item names its place and field.
    let r = grant(&s.http, &json!({"items": [{"tenant": "atlas"}]})).await.expect(422);
    assert!(r.body["message"].as_str().unwrap().contains("items[0]"), "{}", r.body);
    // Fields beside items are not a batch.
    let r = grant(&s.http, &json!({"items": [], "tenant": "atlas"})).await.expect(422);
    assert_eq!(r.body["error"], "invalid_field", "{}", r.body);

    assert_eq!(table_counts(&s.alloc.state.db).await, before);

    // 64 items is the bound, and every one is granted.
    let full: Vec<Value> =
        (0..64).map(|n| grant_body("atlas", "read", "eu", "eu-1", epoch, 100 + n, 1, 1.0)).collect();
    let r = grant(&s.http, &items(&full)).await.expect(200);
    let answers = r.body["items"].as_array().unwrap();
    assert_eq!(answers.len(), 64);
    assert!(answers.iter().all(|a| a["status"] == 200 && a["grant"]["tokens"] == 1), "{}", r.body);
    assert_eq!(pool_rows(&s.alloc.state.db, "atlas", "read").await, (vec![(1000, 64, 0)], 64));
}
