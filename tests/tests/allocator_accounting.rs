//! Releases, reports, window accounting, the ledger and the operational
//! endpoints, against a real PostgreSQL.

use quota_tests::app::{Options, TestAllocator};
use quota_tests::fixtures::{
    at, clocked, clocked_quota, grant, grant_body, put_policy, register, report_body, Stack,
};
use quota_tests::http::Http;
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_returns_unspent_only_while_the_window_is_open_and_is_idempotent() {
    let (_db, clock, _alloc, http) = clocked(Some(at("2026-12-02T10:00:10Z"))).await;
    put_policy(&http, "atlas", "read", json!({"limit": 1000, "window_secs": 60, "chunk_max": 500})).await;
    let epoch = register(&http, "eu", "eu-1").await;
    let a = grant(&http, &grant_body("atlas", "read", "eu", "eu-1", epoch, 1, 100, 5.0)).await.expect(200);
    let b = grant(&http, &grant_body("atlas", "read", "eu", "eu-1", epoch, 2, 100, 5.0)).await.expect(200);
    let (a_id, b_id) = (a.body["lease_id"].as_str().unwrap(), b.body["lease_id"].as_str().unwrap());

    let r = http
        .post(&format!("/v1/leases/{a_id}/release"), &json!({"epoch": epoch, "unspent": 40}))
        .await
        .expect(200);
    assert_eq!((r.body["unspent"].as_i64(), r.body["returned"].as_i64()), (Some(40), Some(40)));
    let again = http
        .post(&format!("/v1/leases/{a_id}/release"), &json!({"epoch": epoch, "unspent": 40}))
        .await
        .expect(200);
    assert_eq!(again.body, r.body, "a repeated release is a no-op");
    let r = http
        .post(&format!("/v1/leases/{a_id}/release"), &json!({"epoch": epoch, "unspent": 41}))
        .await
        .expect(409);
    assert_eq!(r.error(), "idempotency_mismatch");

    // After the window closed, unspent is recorded but not returned.
    clock.set_now(at("2026-12-02T10:01:05Z"));
    let r = http
        .post(&format!("/v1/leases/{b_id}/release"), &json!({"epoch": epoch, "unspent": 30}))
        .await
        .expect(200);
    assert_eq!((r.body["unspent"].as_i64(), r.body["returned"].as_i64()), (Some(30), Some(0)));

    let report = json!({"region": "eu", "agent": "eu-1", "epoch": epoch, "report_id": "eu-1-r1",
        "items": [{"tenant": "atlas", "resource": "read", "window_start": "2026-12-02T10:00:00Z", "consumed": 130, "fallback_admitted": 0}]});
    http.post("/v1/reports", &report).await.expect(200);

    let w = http
        .get("/v1/windows/atlas/read?from=2026-12-02T10:00:00Z&to=2026-12-02T10:01:00Z")
        .await
        .expect(200);
    let win = &w.body["windows"][0];
    assert_eq!(win["granted"], 200);
    assert_eq!(win["returned"], 40);
    assert_eq!(win["consumed"], 130);
    assert_eq!(win["closed"], true);
    assert_eq!(win["stranded"], 30, "granted 200 - consumed 130 - returned 40");
    assert_eq!(win["regions"]["eu"]["stranded"], 30);

    let lease = http.get(&format!("/v1/leases/{a_id}")).await.expect(200);
    let kinds: Vec<&str> =
        lease.body["events"].as_array().unwrap().iter().map(|e| e["kind"].as_str().unwrap()).collect();
    assert_eq!(kinds, ["granted", "released", "refused"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reports_apply_exactly_once_and_window_accounting_shows_the_bound() {
    let s = Stack::start().await;
    put_policy(
        &s.http,
        "atlas",
        "read",
        json!({"limit": 1000, "window_secs": 3600, "fallback_per_region": 50, "chunk_max": 600}),
    )
    .await;
    let eu = register(&s.http, "eu", "eu-1").await;
    let us = register(&s.http, "us", "us-1").await;
    let g = grant(&s.http, &grant_body("atlas", "read", "eu", "eu-1", eu, 1, 600, 50.0)).await.expect(200);
    assert_eq!(g.body["fallback_allowance"], 50);
    assert_eq!(g.body["fail_mode"], "bounded");
    let ws = g.body["window_start"].clone();
    grant(&s.http, &grant_body("atlas", "read", "us", "us-1", us, 1, 400, 50.0)).await.expect(200);

    let report = |region: &str, epoch: i64, id: &str, consumed: i64, fallback: i64| {
        json!({"region": region, "agent": format!("{region}-1"), "epoch": epoch, "report_id": id,
            "items": [{"tenant": "atlas", "resource": "read", "window_start": ws, "consumed": consumed, "fallback_admitted": fallback}]})
    };
    let r = s.http.post("/v1/reports", &report("eu", eu, "eu-1", 600, 0)).await.expect(200);
    assert_eq!(r.body["accepted"], 1);
    // Replays (even concurrent ones) are applied once.
    let replay = report("eu", eu, "eu-1", 600, 0);
    let replays = futures::future::join_all((0..8).map(|_| s.http.post("/v1/reports", &replay))).await;
    assert!(replays.iter().all(|r| r.status == 200));
    s.http.post("/v1/reports", &report("us", us, "us-1", 380, 30)).await.expect(200);
    let r = s.http.post("/v1/reports", &report("us", us, "us-1", 381, 30)).await.expect(409);
    assert_eq!(r.error(), "idempotency_mismatch");

    let w = s.http.get("/v1/windows/atlas/read").await.expect(200);
    let win = &w.body["windows"][0];
    assert_eq!(win["limit"], 1000);
    assert_eq!(win["granted"], 1000);
    assert_eq!(win["consumed"], 980);
    assert_eq!(win["fallback_admitted"], 30);
    assert_eq!(win["admitted"], 1010);
    assert_eq!(win["overshoot"], 10);
    assert_eq!(win["bound"], 1100, "G + 2 regions × 50");
    assert_eq!(win["bound_held"], true);
    assert_eq!(win["closed"], false);
    assert_eq!(win["regions"]["us"]["admitted"], 410);
    assert_eq!(win["regions"]["eu"]["consumed"], 600);
}

/// A clocked allocator with `atlas/read` at limit 1000 per 60 s window,
/// 100 fallback per region, inside the window 10:00; `eu` and `us` registered.
async fn fallback_window() -> (quota_tests::pg::TestDb, TestAllocator, Http, i64, i64) {
    let policy = json!({"limit": 1000, "window_secs": 60, "chunk_max": 500, "fallback_per_region": 100});
    let (db, _clock, alloc, http, eu) = clocked_quota(at("2026-12-02T10:00:10Z"), policy).await;
    let us = register(&http, "us", "us-1").await;
    (db, alloc, http, eu, us)
}

fn window_report(region: &str, epoch: i64, id: &str, consumed: i64, fallback: i64) -> serde_json::Value {
    report_body(region, epoch, id, &json!("2026-12-02T10:00:00Z"), consumed, fallback)
}

async fn window_10_00(http: &Http) -> serde_json::Value {
    let w = http
        .get("/v1/windows/atlas/read?from=2026-12-02T10:00:00Z&to=2026-12-02T10:01:00Z")
        .await
        .expect(200);
    w.body["windows"][0].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fallback_reported_while_the_pool_has_tokens_is_repaid_once_and_the_window_stays_within_its_limit() {
    let (_db, _alloc, http, eu, us) = fallback_window().await;
    let g = grant(&http, &grant_body("atlas", "read", "eu", "eu-1", eu, 1, 300, 5.0)).await.expect(200);
    assert_eq!(g.body["pool"]["available"], 700);

    // US was cut off and admitted 80 from its fallback allowance; the report
    // and its replay charge the pool once.
    http.post("/v1/reports", &window_report("us", us, "us-r1", 0, 80)).await.expect(200);
    http.post("/v1/reports", &window_report("us", us, "us-r1", 0, 80)).await.expect(200);
    let e = http.get("/v1/explain/atlas/read?region=eu").await.expect(200).body;
    assert_eq!(e["pool"]["available"], 1000 - 300 - 80, "explain sees what grants see: {e}");

    let mut granted_after = 0;
    for seq in 2..6 {
        let g = grant(&http, &grant_body("atlas", "read", "eu", "eu-1", eu, seq, 500, 5.0)).await.expect(200);
        granted_after += g.body["tokens"].as_i64().unwrap();
        assert_eq!(g.body["pool"]["available"].as_i64(), Some(1000 - 300 - 80 - granted_after));
    }
    assert_eq!(granted_after, 1000 - 300 - 80, "grants after the report share G - granted - F");
    http.post("/v1/reports", &window_report("eu", eu, "eu-r1", 920, 0)).await.expect(200);

    let win = window_10_00(&http).await;
    assert_eq!(win["granted"], 920);
    assert_eq!(win["fallback_admitted"], 80);
    assert_eq!(win["fallback_repaid"], 80);
    assert_eq!(win["admitted"], 1000);
    assert_eq!(win["overshoot"], 0);
    assert_eq!(win["bound_held"], true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fallback_reported_after_the_pool_was_spent_overshoots_by_exactly_it_within_the_bound() {
    let (_db, _alloc, http, eu, us) = fallback_window().await;
    for seq in 1..3 {
        grant(&http, &grant_body("atlas", "read", "eu", "eu-1", eu, seq, 500, 5.0)).await.expect(200);
    }
    http.post("/v1/reports", &window_report("us", us, "us-r1", 0, 80)).await.expect(200);
    let g = grant(&http, &grant_body("atlas", "read", "eu", "eu-1", eu, 3, 500, 5.0)).await.expect(200);
    assert_eq!((g.body["tokens"].as_i64(), g.body["pool"]["available"].as_i64()), (Some(0), Some(0)));
    http.post("/v1/reports", &window_report("eu", eu, "eu-r1", 1000, 0)).await.expect(200);

    let win = window_10_00(&http).await;
    assert_eq!(win["fallback_admitted"], 80);
    assert_eq!(win["fallback_repaid"], 0, "nothing was left to repay from");
    assert_eq!(win["admitted"], 1080);
    assert_eq!(win["overshoot"], 80);
    assert_eq!(win["bound"], 1200, "G + 2 regions × 100");
    assert_eq!(win["bound_held"], true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ledger_pages_with_a_cursor_without_gaps_or_repeats() {
    let s = Stack::start().await;
    put_policy(&s.http, "atlas", "read", json!({"limit": 1000, "window_secs": 3600})).await;
    let epoch = register(&s.http, "eu", "eu-1").await;
    for seq in 0..25 {
        grant(&s.http, &grant_body("atlas", "read", "eu", "eu-1", epoch, seq, 5, 5.0)).await.expect(200);
    }
    let mut seen = Vec::new();
    let mut cursor = String::new();
    loop {
        let page = s.http.get(&format!("/v1/ledger?tenant=atlas&limit=7&cursor={cursor}")).await.expect(200);
        let events = page.body["events"].as_array().unwrap().clone();
        if events.is_empty() {
            break;
        }
        seen.extend(events.iter().filter(|e| e["kind"] == "granted").map(|e| e["seq"].as_i64().unwrap()));
        cursor = page.body["next_cursor"].as_str().unwrap().to_string();
    }
    assert_eq!(seen, (0..25).collect::<Vec<_>>());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_ready_and_metrics_and_503_when_the_database_is_down() {
    let mut s = Stack::start().await;
    s.http.get("/healthz").await.expect(200);
    s.http.get("/readyz").await.expect(200);
    put_policy(&s.http, "atlas", "read", json!({"limit": 1000, "window_secs": 3600})).await;
    let epoch = register(&s.http, "eu", "eu-1").await;
    grant(&s.http, &grant_body("atlas", "read", "eu", "eu-1", epoch, 1, 5, 5.0)).await.expect(200);
    let m = s.http.get("/metrics").await.expect(200);
    let text = m.body.as_str().unwrap();
    assert!(text.contains("allocator_grants_total{outcome=\"granted\"} 1"), "{text}");
    assert!(text.contains("allocator_http_requests_total{route=\"/v1/grants\",status=\"200\"} 1"), "{text}");

    s.db.stop();
    s.http.get("/healthz").await.expect(200);
    let r = s.http.get("/readyz").await.expect(503);
    assert_eq!(r.error(), "database_unavailable");
    let r = grant(&s.http, &grant_body("atlas", "read", "eu", "eu-1", epoch, 2, 5, 5.0)).await.expect(503);
    assert_eq!(r.header("retry-after"), Some("1"));

    s.db.restart().await;
    quota_tests::wait::until(
        "readyz after PostgreSQL restart",
        std::time::Duration::from_secs(20),
        || async { (s.http.get("/readyz").await.status == 200).then_some(()) },
    )
    .await;
    grant(&s.http, &grant_body("atlas", "read", "eu", "eu-1", epoch, 2, 5, 5.0)).await.expect(200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn epochs_stay_monotonic_across_allocator_restarts_and_concurrent_registrations() {
    let db = quota_tests::pg::TestDb::start().await;
    let alloc = TestAllocator::spawn(&db.url).await;
    let http = Http::new(&alloc.base);
    let e1 = register(&http, "eu", "eu-1").await;
    let concurrent = futures::future::join_all((0..20).map(|_| register(&http, "eu", "eu-1"))).await;
    let mut sorted = concurrent.clone();
    sorted.sort();
    sorted.dedup();
    assert_eq!(sorted.len(), 20, "every concurrent registration gets its own epoch");
    assert!(sorted[0] > e1);
    alloc.stop().await;

    let alloc = TestAllocator::spawn(&db.url).await;
    let http = Http::new(&alloc.base);
    let after = register(&http, "eu", "eu-1").await;
    assert!(
        after > *sorted.last().unwrap(),
        "epoch after restart {after} must exceed {}",
        sorted.last().unwrap()
    );
    assert_eq!(register(&http, "us", "us-1").await, 1, "epochs are per (region, agent)");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auth_tokens_separate_agent_and_admin_routes() {
    let db = quota_tests::pg::TestDb::start().await;
    let opts = Options {
        agent_token: Some("agent-secret".into()),
        admin_token: Some("admin-secret".into()),
        ..Default::default()
    };
    let alloc = TestAllocator::spawn_with(&db.url, opts).await;
    let anon = Http::new(&alloc.base);
    let agent = anon.with_token(Some("agent-secret"));
    let admin = anon.with_token(Some("admin-secret"));
    let wrong = anon.with_token(Some("agent-secreT"));
    let policy = json!({"limit": 10, "window_secs": 60});
    assert_eq!(anon.put("/v1/policies/a/b", &policy).await.status, 401);
    assert_eq!(wrong.put("/v1/policies/a/b", &policy).await.status, 401);
    assert_eq!(agent.put("/v1/policies/a/b", &policy).await.status, 401, "agents cannot change policies");
    assert_eq!(agent.get("/v1/policies/a/b").await.status, 401, "agents cannot read policies");
    assert_eq!(agent.get("/v1/ledger").await.status, 401);
    assert_eq!(admin.put("/v1/policies/a/b", &policy).await.status, 200);
    let body = json!({"region": "eu", "agent": "eu-1"});
    assert_eq!(anon.post("/v1/agents/register", &body).await.status, 401);
    assert_eq!(wrong.post("/v1/agents/register", &body).await.status, 401);
    assert_eq!(agent.post("/v1/agents/register", &body).await.status, 200);
    assert_eq!(anon.get("/healthz").await.status, 200);
    let r = anon.get("/v1/ledger").await;
    assert_eq!(r.error(), "unauthorized");
    assert!(!r.body["message"].as_str().unwrap().contains("secret"));
    let events = admin.get("/v1/ledger").await.expect(200);
    let changed = events.body["events"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["kind"] == "policy_changed")
        .cloned()
        .unwrap();
    assert_eq!(changed["reason"], "by admin");
}
