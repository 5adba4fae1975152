//! Retention of everything (issue #15): report records, pools with their
//! region rows and gone agents are deleted in batches beyond their horizon;
//! a report replayed after its record went is refused, never applied twice;
//! `/v1/windows` still answers for windows whose summary is kept; an agent
//! that comes back after its row went gets a higher epoch than ever (I4).

use allocator::retention::{self, Retention};
use chrono::{Duration, Utc};
use quota_tests::db::{self, Table};
use quota_tests::fixtures::{clocked_quota, grant, grant_body, register, window_of as window};
use serde_json::{json, Value};

fn report(agent: &str, epoch: i64, id: &str, window_start: &Value, consumed: i64) -> Value {
    json!({"region": "eu", "agent": agent, "epoch": epoch, "report_id": id,
        "items": [{"tenant": "atlas", "resource": "read", "window_start": window_start,
                   "consumed": consumed, "fallback_admitted": 0}]})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn old_reports_pools_and_gone_agents_are_deleted_in_batches_and_a_replay_is_refused() {
    let real_now = Utc::now();
    // Ten days ago: eu-1 and eu-gone (registered twice) appear; eu-gone is
    // granted and reports three times, then is never heard of again.
    let policy = json!({"limit": 1000, "window_secs": 60, "fallback_per_region": 5});
    let (_db, clock, alloc, http, e1) = clocked_quota(real_now - Duration::days(10), policy).await;
    let pg = alloc.state.db.clone();
    register(&http, "eu", "eu-gone").await;
    let gone_epoch = register(&http, "eu", "eu-gone").await;
    assert_eq!(gone_epoch, 2);
    let mut ws10 = json!(null);
    for seq in 0..3 {
        let body = grant_body("atlas", "read", "eu", "eu-gone", gone_epoch, seq, 10, 1.0);
        ws10 = grant(&http, &body).await.expect(200).body["window_start"].clone();
    }
    for i in 0..3 {
        let r = report("eu-gone", gone_epoch, &format!("old10-{i}"), &ws10, 1);
        http.post("/v1/reports", &r).await.expect(200);
    }
    // Eight days ago: eu-1 is granted and reports 7 consumed.
    clock.set_now(real_now - Duration::days(8));
    let ws8 = grant(&http, &grant_body("atlas", "read", "eu", "eu-1", e1, 0, 10, 1.0)).await.expect(200).body
        ["window_start"]
        .clone();
    let old8 = report("eu-1", e1, "old8", &ws8, 7);
    http.post("/v1/reports", &old8).await.expect(200);
    // Now: eu-1 is active.
    clock.set_now(Utc::now());
    let ws_now =
        grant(&http, &grant_body("atlas", "read", "eu", "eu-1", e1, 1, 10, 1.0)).await.expect(200).body
            ["window_start"]
            .clone();
    let recent = report("eu-1", e1, "recent", &ws_now, 2);
    http.post("/v1/reports", &recent).await.expect(200);
    assert_eq!(db::rows(&pg, Table::Report).await, 5);
    assert_eq!(db::rows(&pg, Table::Pool).await, 3);

    // Reports, leases and agents beyond 7 days, pools beyond 9 days; two
    // rows per statement, so four old reports take several batches.
    let mut cfg = Retention::from_hours(168, 216, 2).unwrap();
    cfg.pause = std::time::Duration::from_millis(1);
    let purged = retention::sweep(&pg, &alloc.state.db_clock, &cfg).await.unwrap();
    assert_eq!((purged.reports, purged.leases, purged.pools, purged.agents), (4, 4, 1, 1), "{purged:?}");
    let left = db::report_ids(&pg).await;
    assert_eq!(left, vec!["recent".to_string()]);
    let agents = db::agent_names(&pg).await;
    assert_eq!(agents, vec!["eu-1".to_string()], "eu-gone is gone, eu-1 is active");
    assert_eq!(db::oldest_window_regions(&pg).await, 1);

    // The summary of the window 8 days ago still answers; the one of 10
    // days ago is gone with its region rows.
    let w8 = window(&http, &ws8).await;
    assert_eq!((w8["window_start"].clone(), w8["consumed"].as_i64()), (ws8.clone(), Some(7)), "{w8}");
    let w10 = window(&http, &ws10).await;
    assert_ne!(w10["window_start"], ws10, "the 10-day-old window's summary was deleted: {w10}");

    // A replay of a deleted report is refused, not applied a second time.
    let r = http.post("/v1/reports", &old8).await.expect(422);
    assert_eq!((r.error(), r.body["item"].as_u64()), ("report_expired", Some(0)), "{}", r.body);
    assert_eq!(window(&http, &ws8).await["consumed"].as_i64(), Some(7));
    // A kept report is still idempotent.
    assert_eq!(http.post("/v1/reports", &recent).await.expect(200).body["accepted"], 1);
    assert_eq!(window(&http, &ws_now).await["consumed"].as_i64(), Some(2));

    // eu-gone comes back: its old epoch is stale (so it registers again,
    // not 404), and its epoch continues above every epoch it had.
    let body = grant_body("atlas", "read", "eu", "eu-gone", gone_epoch, 9, 10, 1.0);
    assert_eq!(grant(&http, &body).await.expect(409).error(), "stale_epoch");
    assert_eq!(register(&http, "eu", "eu-gone").await, 3, "above the region's floor of 2");
    // A second sweep finds nothing more.
    assert_eq!(retention::sweep(&pg, &alloc.state.db_clock, &cfg).await.unwrap(), Default::default());
}
