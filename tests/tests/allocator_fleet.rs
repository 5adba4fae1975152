//! `PUT /v1/agents/{region}/{agent}/status`: a good status is stored as the
//! agent's one row (replaced, never appended); a bad one is refused with a
//! 4xx naming the problem and stores nothing; an old one is deleted by the
//! retention job.

use allocator::retention::{self, Retention};
use chrono::{Duration, Utc};
use quota_tests::app::TestAllocator;
use quota_tests::fixtures::{clocked, put_policy, register};
use quota_tests::http::Http;
use serde_json::{json, Value};

fn status(epoch: i64, quotas: Vec<Value>) -> Value {
    json!({"epoch": epoch, "allocator_reachable": true, "outbox_depth": 3, "dead_letters": null,
           "quotas_total": quotas.len(), "quotas": quotas})
}

fn quota(tenant: &str) -> Value {
    json!({"tenant": tenant, "resource": "read", "mode": "leased",
           "window_start": "2026-12-04T10:00:00Z", "quota_exhausted": 2, "unavailable": 1})
}

async fn rows(db: &sqlx::PgPool) -> Vec<(String, i64, i64)> {
    quota_tests::db::agent_statuses(db).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_status_replaces_the_agents_row_and_a_bad_one_is_refused_naming_the_problem() {
    let db = quota_tests::pg::TestDb::start().await;
    let alloc = TestAllocator::spawn(&db.url).await;
    let http = Http::new(&alloc.base);
    let pg = alloc.state.db.clone();
    put_policy(&http, "atlas", "read", json!({"limit": 100, "window_secs": 60})).await;
    register(&http, "eu", "eu-1").await;
    let epoch = register(&http, "eu", "eu-1").await;
    let path = "/v1/agents/eu/eu-1/status";

    http.put(path, &status(epoch, vec![quota("atlas")])).await.expect(204);
    let mut again = status(epoch, vec![]);
    again["outbox_depth"] = json!(0);
    http.put(path, &again).await.expect(204);
    assert_eq!(rows(&pg).await, vec![("eu-1".to_string(), epoch, 0)], "one row, replaced");

    let many: Vec<Value> = (0..201).map(|i| quota(&format!("t{i}"))).collect();
    let mut negative = status(epoch, vec![quota("atlas")]);
    negative["quotas"][0]["unavailable"] = json!(-1);
    let mut unknown_field = status(epoch, vec![]);
    unknown_field["colour"] = json!("red");
    let mut bad_mode = status(epoch, vec![quota("atlas")]);
    bad_mode["quotas"][0]["mode"] = json!("asleep");
    let cases: Vec<(&str, Value, u16, &str, &str)> = vec![
        ("more than 200 quotas", status(epoch, many), 422, "invalid_field", "quotas"),
        (
            "a quota twice",
            status(epoch, vec![quota("atlas"), quota("atlas")]),
            422,
            "invalid_field",
            "quotas[1]",
        ),
        ("a negative count", negative, 422, "invalid_field", "quotas[0].unavailable"),
        ("an unknown field", unknown_field, 422, "invalid_field", ""),
        ("an unknown mode", bad_mode, 422, "invalid_field", ""),
        ("an epoch never issued", status(epoch + 1, vec![]), 422, "invalid_field", "epoch"),
        ("a stale epoch", status(epoch - 1, vec![]), 409, "stale_epoch", ""),
    ];
    for (what, body, code, error, field) in cases {
        let r = http.put(path, &body).await;
        assert_eq!((r.status, r.error()), (code, error), "{what}: {}", r.body);
        if !field.is_empty() {
            assert_eq!(r.body["field"], field, "{what}: {}", r.body);
        }
    }
    let r = http.put("/v1/agents/eu/nobody/status", &status(1, vec![])).await;
    assert_eq!((r.status, r.error()), (404, "unknown_agent"), "{}", r.body);
    let r = http.put("/v1/agents/e%20u/eu-1/status", &status(epoch, vec![])).await;
    assert_eq!((r.status, r.body["field"].as_str()), (422, Some("region")), "{}", r.body);
    assert_eq!(rows(&pg).await, vec![("eu-1".to_string(), epoch, 0)], "nothing refused was stored");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn statuses_not_refreshed_within_the_horizon_are_deleted() {
    let (_db, clock, alloc, http) = clocked(None).await;
    let pg = alloc.state.db.clone();
    clock.set_now(Utc::now() - Duration::days(8));
    let gone = register(&http, "eu", "eu-gone").await;
    http.put("/v1/agents/eu/eu-gone/status", &status(gone, vec![])).await.expect(204);
    clock.set_now(Utc::now());
    let live = register(&http, "eu", "eu-1").await;
    http.put("/v1/agents/eu/eu-1/status", &status(live, vec![])).await.expect(204);

    let mut cfg = Retention::from_hours(168, 0, 1).unwrap();
    cfg.pause = std::time::Duration::from_millis(1);
    let purged = retention::sweep(&pg, &alloc.state.db_clock, &cfg).await.unwrap();
    assert_eq!(purged.agent_statuses, 1, "{purged:?}");
    assert_eq!(rows(&pg).await, vec![("eu-1".to_string(), live, 3)]);
}
