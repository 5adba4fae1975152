//! Operator reads that stay true in time (issue #20), against a real
//! PostgreSQL: the ledger keeps up while other connections hold long
//! transactions open, a forgotten ledger writer is cut off after its timeout
//! without the cursor skipping anything, every read says how fresh it is,
//! and `explain ?at=` answers as of its instant.

use chrono::{DateTime, Utc};
use quota_tests::db;
use quota_tests::fixtures::{at, clocked_quota, grant, grant_body, put_policy, register, report_body, Stack};
use quota_tests::http::Http;
use quota_tests::wait;
use serde_json::{json, Value};
use sqlx::{Connection, Executor, PgConnection};
use std::collections::BTreeSet;
use std::time::{Duration, Instant};

/// What docs/operating.md (Ledger freshness) promises when no transaction
/// that wrote ledger events is open: an event is on the next read. The polls allow for a loaded machine.
const LIVE_BOUND: Duration = Duration::from_secs(3);

/// Reads the ledger from `cursor` to its end, returning the events and the
/// `as_of` of the last page.
async fn read_on(http: &Http, cursor: &mut String) -> (Vec<Value>, Option<DateTime<Utc>>) {
    let mut out = Vec::new();
    loop {
        let page = http.get(&format!("/v1/ledger?tenant=atlas&limit=50&cursor={cursor}")).await.expect(200);
        let as_of = page.body["as_of"].as_str().map(at);
        let events = page.body["events"].as_array().unwrap().clone();
        if let Some(c) = page.body["next_cursor"].as_str() {
            *cursor = c.to_string();
        }
        if events.is_empty() {
            return (out, as_of);
        }
        out.extend(events);
    }
}

/// Waits until an event matching `pred` is on the ledger after `cursor`,
/// then moves the cursor past what was read, adds the ids read to `seen`
/// (to check nothing repeats) and returns how long it took.
async fn until_in_ledger(
    http: &Http,
    cursor: &mut String,
    seen: &mut Vec<i64>,
    what: &str,
    pred: impl Fn(&Value) -> bool + Clone,
) -> Duration {
    let started = Instant::now();
    let (events, next) = wait::until(what, LIVE_BOUND, || {
        let (http, mut c, pred) = (http.clone(), cursor.clone(), pred.clone());
        async move {
            let (events, as_of) = read_on(&http, &mut c).await;
            assert!(as_of.is_some(), "every ledger page says how fresh it is");
            events.iter().any(pred).then_some((events, c))
        }
    })
    .await;
    *cursor = next;
    seen.extend(events.iter().map(|e| e["id"].as_i64().unwrap()));
    started.elapsed()
}

/// How another connection keeps a transaction open during the scenario.
#[derive(Debug, Clone, Copy)]
enum Holder {
    /// In the allocator's database: a temporary table (as an analytics
    /// session makes), then a long-running statement.
    RunningHere,
    /// In the allocator's database: a write to another table, then idle.
    IdleHere,
    /// In another database of the same server: an xid, then idle.
    IdleElsewhere,
}

/// Grants, a release and a report made while `holder` keeps a transaction
/// with an xid open each show up in the ledger within [`LIVE_BOUND`], the
/// cursor serves each event once, and `as_of` of the ledger and of the
/// windows keeps moving.
async fn ledger_keeps_up_while(holder: Holder) {
    let s = Stack::start().await;
    put_policy(&s.http, "atlas", "read", json!({"limit": 1000, "window_secs": 3600})).await;
    let epoch = register(&s.http, "eu", "eu-1").await;

    let mut other = match holder {
        Holder::IdleElsewhere => {
            s.alloc.state.db.execute("create database analytics").await.unwrap();
            let url = s.db.url.rsplit_once('/').map(|(base, _)| format!("{base}/analytics")).unwrap();
            PgConnection::connect(&url).await.unwrap()
        }
        _ => PgConnection::connect(&s.db.url).await.unwrap(),
    };
    other.execute("begin").await.unwrap();
    match holder {
        Holder::RunningHere => other
            .execute("create temp table scratch as select g from generate_series(1, 10) g")
            .await
            .unwrap(),
        Holder::IdleHere => {
            other.execute("create table scratch (x int); insert into scratch values (1)").await.unwrap()
        }
        Holder::IdleElsewhere => other.execute("select pg_current_xact_id()").await.unwrap(),
    };
    let other_xid = db::current_xact_id(&mut other).await;
    let other_pid = db::backend_pid(&mut other).await;
    // The scenario bites: the cluster's snapshot xmin is held at the other
    // transaction, which is what the cursor used to wait for.
    let xmin = db::snapshot_xmin(&s.alloc.state.db).await;
    assert!(xmin <= other_xid, "{holder:?}");
    // The connection itself moves into the task that runs the long statement.
    let (running, idle) = match holder {
        Holder::RunningHere => (
            Some(tokio::spawn(async move {
                other.execute("select pg_sleep(6)").await.unwrap();
                other
            })),
            None,
        ),
        _ => (None, Some(other)),
    };

    let mut cursor = String::new();
    let mut seen: Vec<i64> = Vec::new();
    let (before, _) = read_on(&s.http, &mut cursor).await;
    seen.extend(before.iter().map(|e| e["id"].as_i64().unwrap()));

    let mut leases = Vec::new();
    for seq in 0..3 {
        let g =
            grant(&s.http, &grant_body("atlas", "read", "eu", "eu-1", epoch, seq, 5, 5.0)).await.expect(200);
        let lease = g.body["lease_id"].as_str().unwrap().to_string();
        let took = until_in_ledger(&s.http, &mut cursor, &mut seen, "the grant in the ledger", |e| {
            e["kind"] == "granted" && e["lease_id"] == json!(lease)
        })
        .await;
        assert!(took <= LIVE_BOUND, "{holder:?}: grant took {took:?}");
        leases.push((lease, g.body["window_start"].clone()));
    }
    let (lease, window_start) = &leases[0];
    s.http
        .post(&format!("/v1/leases/{lease}/release"), &json!({"epoch": epoch, "unspent": 2}))
        .await
        .expect(200);
    until_in_ledger(&s.http, &mut cursor, &mut seen, "the release in the ledger", |e| {
        e["kind"] == "released" && e["lease_id"] == json!(lease)
    })
    .await;
    let before_report = Utc::now();
    s.http.post("/v1/reports", &report_body("eu", epoch, "live-r1", window_start, 3, 0)).await.expect(200);
    until_in_ledger(&s.http, &mut cursor, &mut seen, "the report in the ledger", |e| {
        e["kind"] == "reported" && e["detail"]["report_id"] == "live-r1"
    })
    .await;
    // Freshness is stated and current: the report committed after
    // `before_report`, and both reads say they reflect at least that.
    let page = s.http.get(&format!("/v1/ledger?tenant=atlas&cursor={cursor}")).await.expect(200);
    assert!(at(page.body["as_of"].as_str().unwrap()) >= before_report, "{}", page.body);
    let w = s.http.get("/v1/windows/atlas/read").await.expect(200);
    assert!(at(w.body["as_of"].as_str().unwrap()) >= before_report, "{}", w.body);
    assert_eq!(w.body["windows"][0]["granted"], 15);

    // All of that happened while the other transaction was still open.
    let state = db::backend_state(&s.alloc.state.db, other_pid).await;
    let expected = match holder {
        Holder::RunningHere => "active",
        _ => "idle in transaction",
    };
    assert_eq!(state.as_deref(), Some(expected), "{holder:?}");

    // Nothing was served twice, and when the other transaction ends the
    // cursor still has every event of the tenant exactly once.
    let mut other = match (running, idle) {
        (Some(task), _) => task.await.unwrap(),
        (None, Some(other)) => other,
        (None, None) => unreachable!("one of the two holds the connection"),
    };
    other.execute("commit").await.unwrap();
    let (rest, _) = read_on(&s.http, &mut cursor).await;
    seen.extend(rest.iter().map(|e| e["id"].as_i64().unwrap()));
    let unique: BTreeSet<i64> = seen.iter().copied().collect();
    assert_eq!(unique.len(), seen.len(), "{holder:?}: an event was served twice");
    let all = db::ledger_ids(&s.alloc.state.db, "atlas").await;
    assert_eq!(unique, all.into_iter().collect::<BTreeSet<_>>(), "{holder:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ledger_keeps_up_while_a_long_query_with_a_temp_table_runs_in_the_same_database() {
    ledger_keeps_up_while(Holder::RunningHere).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ledger_keeps_up_while_a_connection_that_wrote_another_table_sits_idle_in_transaction() {
    ledger_keeps_up_while(Holder::IdleHere).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ledger_keeps_up_while_a_connection_to_another_database_sits_idle_in_transaction() {
    ledger_keeps_up_while(Holder::IdleElsewhere).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forgotten_ledger_writer_is_cut_off_after_its_timeout_and_the_cursor_never_serves_its_event() {
    let s = Stack::start().await;
    put_policy(&s.http, "atlas", "read", json!({"limit": 1000, "window_secs": 3600})).await;
    let epoch = register(&s.http, "eu", "eu-1").await;
    let mut cursor = String::new();
    read_on(&s.http, &mut cursor).await;

    // A session writes a ledger event by hand and forgets its transaction.
    // The trigger caps how long it may then sit idle; the session lowers the
    // 30 s default so the test does not wait that long.
    let mut writer = PgConnection::connect(&s.db.url).await.unwrap();
    writer.execute("set quota.ledger_writer_timeout = '2s'").await.unwrap();
    writer.execute("begin").await.unwrap();
    let stuck = db::insert_reported_event(&mut writer, "atlas", Some("read"), Some("eu")).await;
    let opened = Instant::now();
    let g = grant(&s.http, &grant_body("atlas", "read", "eu", "eu-1", epoch, 1, 5, 5.0)).await.expect(200);
    let lease = json!(g.body["lease_id"]);

    // While it is open the cursor may not pass it (its event could still
    // commit), and the page says it is not fresher than the writer's start.
    let page = s.http.get(&format!("/v1/ledger?tenant=atlas&cursor={cursor}")).await.expect(200);
    assert_eq!(page.body["events"], json!([]), "nothing past an open ledger writer");
    let as_of = at(page.body["as_of"].as_str().unwrap());
    assert!(as_of <= Utc::now() - chrono::Duration::milliseconds(1), "{}", page.body);

    // PostgreSQL ends the idle writer after its timeout; then the grant
    // appears, and the writer's event never does.
    let mut seen = Vec::new();
    let events = wait::until("the grant after the writer was cut off", Duration::from_secs(15), || {
        let (http, mut c, lease) = (s.http.clone(), cursor.clone(), lease.clone());
        async move {
            let (events, _) = read_on(&http, &mut c).await;
            events.iter().any(|e| e["lease_id"] == lease).then_some(events)
        }
    })
    .await;
    let waited = opened.elapsed();
    assert!(waited >= Duration::from_secs(2), "not before the writer's timeout: {waited:?}");
    assert!(waited <= Duration::from_secs(2) + LIVE_BOUND * 2, "{waited:?}");
    seen.extend(events.iter().map(|e| e["id"].as_i64().unwrap()));
    assert!(!seen.contains(&stuck), "the forgotten writer's event was never committed");
    assert!(writer.execute("select 1").await.is_err(), "the writer's session was ended");
    assert!(!db::ledger_event_exists(&s.alloc.state.db, stuck).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ledger_writes_outside_read_committed_are_refused_rather_than_risk_a_skip() {
    let s = Stack::start().await;
    let mut conn = PgConnection::connect(&s.db.url).await.unwrap();
    conn.execute("begin isolation level repeatable read").await.unwrap();
    let err = conn
        .execute("insert into ledger_event (at, kind, tenant) values (now(), 'reported', 'atlas')")
        .await
        .unwrap_err();
    assert!(err.to_string().contains("read committed"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_at_an_instant_does_not_count_what_happened_after_it_and_names_each_instant() {
    let policy = json!({"limit": 100, "window_secs": 60, "chunk_max": 100, "fallback_per_region": 10});
    let (_db, clock, _alloc, http, eu) = clocked_quota(at("2026-12-02T10:00:05Z"), policy).await;
    let first = grant(&http, &grant_body("atlas", "read", "eu", "eu-1", eu, 1, 40, 4.0)).await.expect(200);
    assert_eq!(first.body["tokens"], 40);
    clock.set_now(at("2026-12-02T10:00:08Z"));
    let w0 = json!("2026-12-02T10:00:00Z");
    http.post("/v1/reports", &report_body("eu", eu, "r1", &w0, 10, 0)).await.expect(200);
    // After the instant explained: a second grant, a release, more reports.
    clock.set_now(at("2026-12-02T10:00:30Z"));
    let later = grant(&http, &grant_body("atlas", "read", "eu", "eu-1", eu, 2, 25, 9.0)).await.expect(200);
    assert_eq!(later.body["tokens"], 25);
    clock.set_now(at("2026-12-02T10:00:35Z"));
    let lease = first.body["lease_id"].as_str().unwrap();
    http.post(&format!("/v1/leases/{lease}/release"), &json!({"epoch": eu, "unspent": 5})).await.expect(200);
    http.post("/v1/reports", &report_body("eu", eu, "r2", &w0, 20, 3)).await.expect(200);
    clock.set_now(at("2026-12-02T10:00:40Z"));

    let e = http.get("/v1/explain/atlas/read?region=eu&at=2026-12-02T10:00:10Z").await.expect(200).body;
    assert_eq!(
        e["pool"],
        json!({"exists": true, "limit": 100, "granted": 40, "returned": 0, "available": 60}),
        "the later grant is not counted: {e}"
    );
    let r = &e["region_account"];
    assert_eq!(
        (r["granted"].as_i64(), r["returned"].as_i64(), r["consumed"].as_i64()),
        (Some(40), Some(0), Some(10))
    );
    assert_eq!((r["demand_per_sec"].as_f64(), r["last_want"].as_i64()), (Some(4.0), Some(40)));
    assert_eq!(e["fallback"], json!({"allowance": 10, "admitted": 0, "left": 10, "in_fallback": false}));
    let leases = e["leases"].as_array().unwrap();
    assert_eq!(leases.len(), 1, "{e}");
    assert!(leases[0]["released_at"].is_null() && leases[0]["spent"].is_null(), "released only later: {e}");
    assert_eq!((e["verdict"].as_str(), e["live_lease_tokens"].as_i64()), (Some("leased"), Some(40)));
    // Each part names its instant; the stored totals are there too, as of now.
    for part in ["policy", "pool", "region_account", "leases", "fallback", "refusals"] {
        assert_eq!(e["as_of"][part], "2026-12-02T10:00:10Z", "{part}: {e}");
    }
    let now = at(e["current"]["as_of"].as_str().unwrap());
    assert!(now >= at("2026-12-02T10:00:40Z") && now < at("2026-12-02T10:00:50Z"), "{e}");
    // The 3 fallback admits reported while the window was open are repaid
    // from the pool: 100 - (65 - 5) - 3.
    assert_eq!(
        e["current"]["pool"],
        json!({"exists": true, "limit": 100, "granted": 65, "returned": 5, "available": 37})
    );
    assert_eq!(e["current"]["region_account"]["consumed"], 30);
    assert_eq!(e["current"]["fallback"]["admitted"], 3);
    assert!(
        e["notes"].as_array().unwrap().iter().any(|n| n.as_str().unwrap().contains("reported by `at`")),
        "{e}"
    );

    // Later in the window the same call counts both grants, the release and
    // the 3 fallback admits reported at 10:00:35, repaid from the pool.
    let e = http.get("/v1/explain/atlas/read?region=eu&at=2026-12-02T10:00:36Z").await.expect(200).body;
    assert_eq!(
        e["pool"],
        json!({"exists": true, "limit": 100, "granted": 65, "returned": 5, "available": 37}),
        "{e}"
    );
    assert_eq!(e["leases"][0]["spent"], 35);
    assert_eq!(
        (e["region_account"]["consumed"].as_i64(), e["fallback"]["admitted"].as_i64()),
        (Some(30), Some(3))
    );
    assert_eq!(e["notes"], json!([]), "nothing happened after that instant: {e}");
    // Before the first report arrived, nothing was reported consumed yet.
    let e = http.get("/v1/explain/atlas/read?region=eu&at=2026-12-02T10:00:07Z").await.expect(200).body;
    assert_eq!(
        (e["pool"]["granted"].as_i64(), e["region_account"]["consumed"].as_i64()),
        (Some(40), Some(0))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openapi_document_describes_the_freshness_fields() {
    let s = Stack::start().await;
    let doc = s.http.get("/openapi.json").await.expect(200).body;
    let schemas = &doc["components"]["schemas"];
    assert!(schemas["LedgerPage"]["properties"]["as_of"].is_object(), "{}", schemas["LedgerPage"]);
    assert!(schemas["WindowsPage"]["properties"]["as_of"].is_object());
    for field in ["as_of", "current", "notes"] {
        assert!(schemas["Explanation"]["properties"][field].is_object(), "Explanation.{field}");
    }
    assert!(schemas["ExplainInstants"].is_object() && schemas["ExplainCurrent"].is_object());
}
