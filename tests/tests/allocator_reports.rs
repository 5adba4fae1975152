//! Report plausibility (issue #15): one bad item refuses the whole report
//! with the item named (index and field) and nothing applied; items of
//! windows in the future or beyond the retention horizon are refused on the
//! database's clock; a good report stays idempotent by `report_id`.

use chrono::{DateTime, Duration, Utc};
use quota_tests::db::Table;
use quota_tests::fixtures::{grant, grant_body, put_policy, register, table_counts, Stack};
use serde_json::{json, Value};

fn item(resource: &str, window_start: DateTime<Utc>, consumed: i64) -> Value {
    json!({"tenant": "atlas", "resource": resource, "window_start": window_start.to_rfc3339(),
           "consumed": consumed, "fallback_admitted": 0})
}

fn report(epoch: i64, id: &str, items: Vec<Value>) -> Value {
    json!({"region": "eu", "agent": "eu-1", "epoch": epoch, "report_id": id, "items": items})
}

async fn consumed(db: &sqlx::PgPool) -> i64 {
    quota_tests::db::consumed_total(db).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_report_item_is_named_and_nothing_of_the_report_is_applied() {
    let s = Stack::start().await;
    for r in ["read", "write"] {
        put_policy(&s.http, "atlas", r, json!({"limit": 1000, "window_secs": 60})).await;
    }
    let epoch = register(&s.http, "eu", "eu-1").await;
    let g = grant(&s.http, &grant_body("atlas", "read", "eu", "eu-1", epoch, 1, 10, 1.0)).await.expect(200);
    let ws: DateTime<Utc> = g.body["window_start"].as_str().unwrap().parse().unwrap();
    let db = s.alloc.state.db.clone();
    let before = table_counts(&db).await;
    let events = quota_tests::db::rows(&db, Table::LedgerEvent).await;

    // A window an hour ahead of the database's clock, among good items.
    let future = ws + Duration::hours(1);
    let r = s
        .http
        .post(
            "/v1/reports",
            &report(
                epoch,
                "r-future",
                vec![item("read", ws, 5), item("write", ws, 3), item("read", future, 1)],
            ),
        )
        .await
        .expect(422);
    assert_eq!(r.error(), "invalid_field", "{}", r.body);
    assert_eq!(r.body["item"], 2, "{}", r.body);
    assert_eq!(r.body["field"], "items[2].window_start", "{}", r.body);

    // A window beyond the retention horizon (168 h by default).
    let old = ws - Duration::days(8);
    let r = s
        .http
        .post("/v1/reports", &report(epoch, "r-old", vec![item("read", ws, 5), item("write", old, 3)]))
        .await
        .expect(422);
    assert_eq!(r.error(), "report_expired", "{}", r.body);
    assert_eq!(r.body["item"], 1, "{}", r.body);

    // Validation, a window start off the window grid, an unknown quota:
    // each names its item.
    let mut bad_id = item("read", ws, 1);
    bad_id["tenant"] = json!("no/slash");
    let r = s
        .http
        .post("/v1/reports", &report(epoch, "r-id", vec![item("read", ws, 1), bad_id]))
        .await
        .expect(422);
    assert_eq!((r.body["item"].as_u64(), r.body["field"].as_str()), (Some(1), Some("items[1].tenant")));
    let off_grid = ws + Duration::seconds(7);
    let r = s
        .http
        .post("/v1/reports", &report(epoch, "r-grid", vec![item("write", off_grid, 1), item("read", ws, 1)]))
        .await
        .expect(422);
    assert_eq!((r.body["item"].as_u64(), r.body["field"].as_str()), (Some(0), Some("items[0].window_start")));
    let r = s
        .http
        .post("/v1/reports", &report(epoch, "r-quota", vec![item("read", ws, 1), item("nope", ws, 1)]))
        .await
        .expect(404);
    assert_eq!((r.error(), r.body["item"].as_u64()), ("unknown_quota", Some(1)));

    assert_eq!(table_counts(&db).await, before, "a refused report changes nothing");
    let after = quota_tests::db::rows(&db, Table::LedgerEvent).await;
    assert_eq!(after, events, "a refused report appends nothing to the ledger");

    // The good items alone apply once; a replay answers the same count.
    let good = report(epoch, "r-good", vec![item("read", ws, 5), item("write", ws, 3)]);
    assert_eq!(s.http.post("/v1/reports", &good).await.expect(200).body["accepted"], 2);
    assert_eq!(s.http.post("/v1/reports", &good).await.expect(200).body["accepted"], 2);
    assert_eq!(consumed(&db).await, 8, "applied exactly once");
    // The id of a refused report was never recorded: the sender can fix it.
    let fixed = report(epoch, "r-future", vec![item("read", ws, 1)]);
    assert_eq!(s.http.post("/v1/reports", &fixed).await.expect(200).body["accepted"], 1);
    assert_eq!(consumed(&db).await, 9);
}
