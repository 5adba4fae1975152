//! The operator surface against a real PostgreSQL: window accounting of a
//! scripted scenario, the ledger cursor under concurrent and late commits,
//! the NDJSON export, explain, policy history, auth per route, retention and
//! the OpenAPI document.

use chrono::{Duration, Utc};
use quota_tests::db::{self, Table};
use quota_tests::fixtures::{
    at, clocked_quota, grant, grant_body, operator_scenario_played, put_policy, register, report_body,
    window_of, Stack,
};
use quota_tests::http::{Http, Resp};
use quota_tests::wait;
use serde_json::{json, Value};
use std::collections::BTreeSet;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scripted_scenario_yields_exact_window_accounting_bound_and_stranded() {
    let (_db, _clock, _alloc, http) = operator_scenario_played().await;

    let w = http
        .get("/v1/windows/atlas/read?from=2026-12-02T10:00:00Z&to=2026-12-02T10:02:00Z")
        .await
        .expect(200);
    let windows = w.body["windows"].as_array().unwrap();
    assert_eq!(windows.len(), 2, "{}", w.body);
    let w0 = &windows[0];
    let expect0 = json!({
        "window_start": "2026-12-02T10:00:00Z", "window_end": "2026-12-02T10:01:00Z", "window_secs": 60,
        "closed": true, "limit": 1000, "granted": 500, "returned": 50, "consumed": 400,
        "fallback_admitted": 40, "admitted": 440, "overshoot": 0, "bound": 1100, "bound_held": true,
        "stranded": 50,
    });
    for (k, v) in expect0.as_object().unwrap() {
        assert_eq!(&w0[k], v, "window 10:00 field {k}: {w0}");
    }
    let eu = &w0["regions"]["eu"];
    let us = &w0["regions"]["us"];
    assert_eq!(
        (eu["granted"].as_i64(), eu["returned"].as_i64(), eu["consumed"].as_i64(), eu["admitted"].as_i64()),
        (Some(300), Some(50), Some(250), Some(250))
    );
    assert_eq!((eu["stranded"].as_i64(), eu["fallback_allowance"].as_i64()), (Some(0), Some(50)));
    assert_eq!(
        (us["granted"].as_i64(), us["consumed"].as_i64(), us["fallback_admitted"].as_i64()),
        (Some(200), Some(150), Some(40))
    );
    assert_eq!((us["admitted"].as_i64(), us["stranded"].as_i64()), (Some(190), Some(50)));

    let w1 = &windows[1];
    assert_eq!(w1["admitted"], 1150);
    assert_eq!(w1["bound"], 1100);
    assert_eq!(w1["overshoot"], 150, "admitted − limit");
    assert_eq!(w1["bound_held"], false);
    assert_eq!(w1["stranded"], 0, "nothing granted: consumption beyond grants is not stranded");

    // Paging by one window continues with next_from.
    let p = http.get("/v1/windows/atlas/read?from=2026-12-02T10:00:00Z&limit=1").await.expect(200);
    assert_eq!(p.body["windows"].as_array().unwrap().len(), 1);
    assert_eq!(p.body["next_from"], "2026-12-02T10:01:00Z");
    let p = http.get("/v1/windows/atlas/read?from=2026-12-02T10:01:00Z&limit=1").await.expect(200);
    assert_eq!(p.body["windows"][0]["window_start"], "2026-12-02T10:01:00Z");

    for (q, field) in [
        ("from=10:00", "from"),
        ("to=2026-13-01T00:00:00Z", "to"),
        ("from=2026-12-02T10:01:00Z&to=2026-12-02T10:00:00Z", "to"),
        ("limit=0", "limit"),
        ("limit=101", "limit"),
    ] {
        let r = http.get(&format!("/v1/windows/atlas/read?{q}")).await.expect(422);
        assert!(r.body["message"].as_str().unwrap().starts_with(field), "{q}: {}", r.body);
    }
}

/// Pages the ledger to its end (the first empty page), returning the events.
async fn read_to_end(http: &Http, filter: &str, limit: i64, cursor: &mut String) -> Vec<Value> {
    let mut out = Vec::new();
    loop {
        let page = http.get(&format!("/v1/ledger?{filter}&limit={limit}&cursor={cursor}")).await.expect(200);
        let events = page.body["events"].as_array().unwrap().clone();
        if let Some(c) = page.body["next_cursor"].as_str() {
            *cursor = c.to_string();
        }
        if events.is_empty() {
            return out;
        }
        out.extend(events);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ledger_cursor_does_not_skip_an_event_that_commits_late() {
    let s = Stack::start().await;
    put_policy(&s.http, "atlas", "read", json!({"limit": 1000, "window_secs": 3600})).await;
    let epoch = register(&s.http, "eu", "eu-1").await;

    // A transaction takes its ledger id first and commits last.
    let mut late = s.alloc.state.db.begin().await.unwrap();
    let late_id = db::insert_reported_event(&mut late, "atlas", Some("read"), Some("eu")).await;
    for seq in 0..5 {
        grant(&s.http, &grant_body("atlas", "read", "eu", "eu-1", epoch, seq, 5, 5.0)).await.expect(200);
    }
    let mut cursor = String::new();
    let first = read_to_end(&s.http, "tenant=atlas", 2, &mut cursor).await;
    assert!(
        first.iter().all(|e| e["kind"] == "policy_changed"),
        "only events below the open transaction: {first:?}"
    );
    let first_ids: Vec<i64> = first.iter().map(|e| e["id"].as_i64().unwrap()).collect();
    assert!(first_ids.iter().all(|id| *id < late_id));

    late.commit().await.unwrap();
    let rest = read_to_end(&s.http, "tenant=atlas", 2, &mut cursor).await;
    let kinds: Vec<&str> = rest.iter().map(|e| e["kind"].as_str().unwrap()).collect();
    assert_eq!(kinds, ["reported", "granted", "granted", "granted", "granted", "granted"]);
    assert_eq!(rest[0]["id"].as_i64(), Some(late_id), "the late commit comes first, in commit order");
    assert!(rest[1]["id"].as_i64().unwrap() > late_id);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ledger_pagination_never_skips_or_repeats_under_concurrent_writers() {
    let s = Stack::start().await;
    put_policy(&s.http, "atlas", "read", json!({"limit": 1_000_000, "window_secs": 3600})).await;
    let mut writers = Vec::new();
    for w in 0..4 {
        let http = s.http.clone();
        let agent = format!("eu-{w}");
        writers.push(tokio::spawn(async move {
            let epoch = register(&http, "eu", &agent).await;
            for seq in 0..30 {
                grant(&http, &grant_body("atlas", "read", "eu", &agent, epoch, seq, 1, 1.0))
                    .await
                    .expect(200);
            }
        }));
    }
    // Raw writers whose transactions stay open across other commits.
    let db = s.alloc.state.db.clone();
    writers.push(tokio::spawn(async move {
        for _ in 0..15 {
            let mut tx = db.begin().await.unwrap();
            db::insert_reported_event(&mut tx, "atlas", None, None).await;
            db::sleep_in_transaction(&mut tx, 0.02).await;
            tx.commit().await.unwrap();
        }
    }));
    let mut seen: Vec<i64> = Vec::new();
    let mut cursor = String::new();
    while writers.iter().any(|w| !w.is_finished()) {
        let page = s.http.get(&format!("/v1/ledger?tenant=atlas&limit=3&cursor={cursor}")).await.expect(200);
        seen.extend(page.body["events"].as_array().unwrap().iter().map(|e| e["id"].as_i64().unwrap()));
        if let Some(c) = page.body["next_cursor"].as_str() {
            cursor = c.to_string();
        }
    }
    for w in writers {
        w.await.unwrap();
    }
    seen.extend(
        read_to_end(&s.http, "tenant=atlas", 3, &mut cursor).await.iter().map(|e| e["id"].as_i64().unwrap()),
    );
    let unique: BTreeSet<i64> = seen.iter().copied().collect();
    assert_eq!(unique.len(), seen.len(), "an event was served twice");
    let all = db::ledger_ids(&s.alloc.state.db, "atlas").await;
    assert_eq!(unique, all.into_iter().collect::<BTreeSet<_>>(), "every committed event was served");
    assert_eq!(unique.len(), 1 + 4 * 30 + 15);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ledger_ndjson_export_streams_every_matching_event_once_and_filters_are_validated() {
    let s = Stack::start().await;
    put_policy(&s.http, "atlas", "read", json!({"limit": 1000, "window_secs": 3600})).await;
    let epoch = register(&s.http, "eu", "eu-1").await;
    grant(&s.http, &grant_body("atlas", "read", "eu", "eu-1", epoch, 1, 5, 5.0)).await.expect(200);
    // More than two export batches, in three transactions.
    for _ in 0..3 {
        db::insert_reported_series(&s.alloc.state.db, "atlas", "read", "us", 900).await;
    }
    let r = reqwest::get(format!("{}/v1/ledger?tenant=atlas&format=ndjson", s.alloc.base)).await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["content-type"], "application/x-ndjson");
    let text = r.text().await.unwrap();
    let events: Vec<Value> =
        text.lines().map(|l| serde_json::from_str(l).expect("one JSON object per line")).collect();
    assert_eq!(events.len(), 1 + 1 + 2700, "policy_changed, granted and the inserted reports");
    let ids: BTreeSet<i64> = events.iter().map(|e| e["id"].as_i64().unwrap()).collect();
    assert_eq!(ids.len(), events.len(), "no event twice");
    assert_eq!(events[1]["kind"], "granted");
    assert_eq!(events[1]["lease_id"].as_str().map(str::len), Some(36));
    assert_eq!((events[1]["region"].as_str(), events[1]["agent"].as_str()), (Some("eu"), Some("eu-1")));
    assert_eq!((events[1]["epoch"].as_i64(), events[1]["seq"].as_i64()), (Some(epoch), Some(1)));

    let us = reqwest::get(format!("{}/v1/ledger?region=us&format=ndjson", s.alloc.base)).await.unwrap();
    assert_eq!(us.text().await.unwrap().lines().count(), 2700);

    for (q, field) in [
        ("since=yesterday", "since"),
        ("cursor=12", "cursor"),
        ("cursor=a.b", "cursor"),
        ("format=xml", "format"),
        ("format=ndjson&limit=5", "limit"),
        ("tenant=a%20b", "tenant"),
        ("resource=-x", "resource"),
        ("limit=1001", "limit"),
    ] {
        let r = s.http.get(&format!("/v1/ledger?{q}")).await.expect(422);
        assert!(r.body["message"].as_str().unwrap().starts_with(field), "{q}: {}", r.body);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_tells_leased_fallback_exhausted_and_no_demand_apart() {
    let policy = json!({"limit": 100, "window_secs": 60, "chunk_max": 100, "fallback_per_region": 10});
    let (_db, clock, _alloc, http, eu) = clocked_quota(at("2026-12-02T10:00:05Z"), policy).await;
    let us_old = register(&http, "us", "us-1").await;
    let us = register(&http, "us", "us-1").await;
    let ap = register(&http, "ap", "ap-1").await;
    let g = grant(&http, &grant_body("atlas", "read", "eu", "eu-1", eu, 1, 100, 20.0)).await.expect(200);
    assert_eq!(g.body["tokens"], 100);
    let empty = grant(&http, &grant_body("atlas", "read", "us", "us-1", us, 1, 10, 3.0)).await.expect(200);
    assert_eq!(empty.body["tokens"], 0);
    let stale =
        grant(&http, &grant_body("atlas", "read", "us", "us-1", us_old, 2, 10, 3.0)).await.expect(409);
    assert_eq!(stale.error(), "stale_epoch");
    let w0 = json!("2026-12-02T10:00:00Z");
    http.post("/v1/reports", &report_body("ap", ap, "ap-r1", &w0, 0, 7)).await.expect(200);
    clock.set_now(at("2026-12-02T10:00:20Z"));

    let e = http.get("/v1/explain/atlas/read?region=eu").await.expect(200).body;
    assert_eq!(e["verdict"], "leased", "{e}");
    assert!(e["at"].as_str().unwrap().starts_with("2026-12-02T10:00:2"), "at defaults to now: {e}");
    assert_eq!((e["policy"]["version"].as_i64(), e["policy"]["limit"].as_i64()), (Some(1), Some(100)));
    assert_eq!(e["window_start"], "2026-12-02T10:00:00Z");
    assert_eq!(
        e["pool"],
        json!({"exists": true, "limit": 100, "granted": 100, "returned": 0, "available": 0})
    );
    assert_eq!(e["live_lease_tokens"], 100);
    let lease = &e["leases"][0];
    assert_eq!(lease["lease_id"], g.body["lease_id"]);
    assert_eq!((lease["agent"].as_str(), lease["epoch"].as_i64()), (Some("eu-1"), Some(eu)));
    assert_eq!((lease["tokens"].as_i64(), lease["expired"].as_bool()), (Some(100), Some(false)));
    assert_eq!(lease["expires_at"], g.body["expires_at"]);
    assert!(lease["spent"].is_null() && lease["returned"].is_null(), "not released yet: {lease}");
    assert_eq!(e["region_account"]["demand_per_sec"], 20.0);

    let e = http.get("/v1/explain/atlas/read?region=us").await.expect(200).body;
    assert_eq!(e["verdict"], "exhausted", "{e}");
    assert_eq!(e["leases"][0]["tokens"], 0);
    let refusals = e["refusals"].as_array().unwrap();
    assert_eq!(refusals.len(), 1, "{e}");
    assert_eq!(
        (refusals[0]["reason"].as_str(), refusals[0]["epoch"].as_i64()),
        (Some("stale_epoch"), Some(us_old))
    );

    let e = http.get("/v1/explain/atlas/read?region=ap").await.expect(200).body;
    assert_eq!(e["verdict"], "fallback", "{e}");
    assert_eq!(e["fallback"], json!({"allowance": 10, "admitted": 7, "left": 3, "in_fallback": true}));

    let e = http.get("/v1/explain/atlas/read?region=sa").await.expect(200).body;
    assert_eq!(e["verdict"], "no demand", "{e}");

    // After the lease expired and was released, the same region is no longer leased.
    clock.set_now(at("2026-12-02T10:00:50Z"));
    http.post(
        &format!("/v1/leases/{}/release", g.body["lease_id"].as_str().unwrap()),
        &json!({"epoch": eu, "unspent": 30}),
    )
    .await
    .expect(200);
    let e = http.get("/v1/explain/atlas/read?region=eu&at=2026-12-02T10:00:51Z").await.expect(200).body;
    assert_ne!(e["verdict"], "leased", "{e}");
    assert_eq!((e["leases"][0]["spent"].as_i64(), e["leases"][0]["returned"].as_i64()), (Some(70), Some(30)));
    // At an earlier instant the explanation is of that instant.
    let e = http.get("/v1/explain/atlas/read?region=eu&at=2026-12-02T10:00:10Z").await.expect(200).body;
    assert_eq!(e["verdict"], "leased", "{e}");

    http.get("/v1/explain/atlas/nope?region=eu").await.expect(404);
    let r = http.get("/v1/explain/atlas/read?region=eu&at=2026-12-01T00:00:00Z").await.expect(404);
    assert_eq!(r.error(), "unknown_quota");
    for (q, field) in
        [("", "region"), ("region=a%20b", "region"), ("region=eu&at=noon", "at"), ("region=eu&x=1", "query")]
    {
        let r = http.get(&format!("/v1/explain/atlas/read?{q}")).await.expect(422);
        assert!(r.body["message"].as_str().unwrap().starts_with(field), "{q}: {}", r.body);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn policy_versions_record_every_change_with_who_and_when_and_if_match_refuses_a_stale_edit() {
    let s = Stack::with_tokens("admin-secret", "agent-secret").await;
    let admin = s.http.with_token(Some("admin-secret"));
    let agent = admin.with_token(Some("agent-secret"));
    let path = "/v1/policies/atlas/read";
    admin.put(path, &json!({"limit": 100, "window_secs": 60})).await.expect(200);
    admin
        .put_with(
            path,
            &json!({"limit": 200, "window_secs": 60, "fail_mode": "strict"}),
            &[("if-match", "1")],
        )
        .await
        .expect(200);
    let r = admin
        .put_with(path, &json!({"limit": 300, "window_secs": 60}), &[("if-match", "1")])
        .await
        .expect(412);
    assert_eq!(r.error(), "version_mismatch");
    // Two concurrent edits of version 2: exactly one wins.
    let body = json!({"limit": 400, "window_secs": 60});
    let (a, b) = tokio::join!(
        admin.put_with(path, &body, &[("if-match", "2")]),
        admin.put_with(path, &body, &[("if-match", "2")])
    );
    let mut statuses = [a.status, b.status];
    statuses.sort();
    assert_eq!(statuses, [200, 412]);

    let v = admin.get(&format!("{path}/versions")).await.expect(200).body;
    let versions = v["versions"].as_array().unwrap();
    assert_eq!(versions.len(), 3, "{v}");
    assert_eq!(versions.iter().map(|x| x["version"].as_i64().unwrap()).collect::<Vec<_>>(), [1, 2, 3]);
    assert_eq!(versions[1]["limit"], 200);
    assert_eq!(versions[1]["fail_mode"], "strict");
    assert_eq!(versions[1]["fallback_per_region"], 0);
    assert_eq!(versions[0]["chunk_min"], 1);
    assert_eq!(versions[0]["lease_ttl_secs"], 30);
    assert!(versions.iter().all(|x| x["changed_by"] == "admin" && x["changed_at"].is_string()));

    let ledger = admin.get("/v1/ledger?tenant=atlas").await.expect(200).body;
    let changes: Vec<&Value> =
        ledger["events"].as_array().unwrap().iter().filter(|e| e["kind"] == "policy_changed").collect();
    assert_eq!(changes.len(), 3);
    assert!(changes
        .iter()
        .all(|e| e["detail"]["changed_by"] == "admin" && e["detail"]["changed_at"].is_string()));
    assert_eq!(changes[2]["detail"]["policy"]["version"], 3);

    assert_eq!(agent.get(&format!("{path}/versions")).await.status, 401, "agents cannot read policies");
    assert_eq!(agent.get(path).await.status, 401);
    assert_eq!(agent.put(path, &body).await.status, 401, "agents cannot change policies");
    admin.get("/v1/policies/atlas/nope/versions").await.expect(404);
    admin.get("/v1/policies/atlas/a%20b/versions").await.expect(422);

    // Without tokens (loopback only) the writer is recorded as such.
    let open = Stack::start().await;
    put_policy(&open.http, "atlas", "read", json!({"limit": 100, "window_secs": 60})).await;
    let v = open.http.get(&format!("{path}/versions")).await.expect(200).body;
    assert_eq!(v["versions"][0]["changed_by"], "anonymous/loopback");
}

/// Every route of the allocator: (method, path template, class). The auth
/// test calls each one, the OpenAPI test compares the document against it.
const ROUTES: &[(&str, &str, Class)] = &[
    ("post", "/v1/agents/register", Class::Agent),
    ("post", "/v1/grants", Class::Agent),
    ("post", "/v1/leases/{lease_id}/release", Class::Agent),
    ("post", "/v1/leases/release", Class::Agent),
    ("post", "/v1/reports", Class::Agent),
    ("put", "/v1/agents/{region}/{agent}/status", Class::Agent),
    ("post", "/v1/permits/lease", Class::Agent),
    ("get", "/v1/permits/{tenant}/{resource}", Class::Admin),
    ("put", "/v1/policies/{tenant}/{resource}", Class::Admin),
    ("get", "/v1/policies/{tenant}/{resource}", Class::Admin),
    ("get", "/v1/policies/{tenant}/{resource}/versions", Class::Admin),
    ("post", "/v1/policies/{tenant}/{resource}/rollout/promote", Class::Admin),
    ("post", "/v1/policies/{tenant}/{resource}/rollout/halt", Class::Admin),
    ("get", "/v1/leases/{lease_id}", Class::Admin),
    ("get", "/v1/windows/{tenant}/{resource}", Class::Admin),
    ("get", "/v1/ledger", Class::Admin),
    ("get", "/v1/explain/{tenant}/{resource}", Class::Admin),
    ("get", "/ui", Class::Admin),
    ("get", "/ui/quotas/{tenant}/{resource}", Class::Admin),
    ("get", "/ui/regions", Class::Admin),
    ("get", "/healthz", Class::Public),
    ("get", "/readyz", Class::Public),
    ("get", "/metrics", Class::Public),
    ("get", "/openapi.json", Class::Public),
];

#[derive(Debug, Clone, Copy, PartialEq)]
enum Class {
    Agent,
    Admin,
    Public,
}

async fn call(http: &Http, method: &str, template: &str, lease_id: &str, epoch: i64) -> Resp {
    // The permit routes take a concurrency quota (atlas/jobs).
    let resource = if template.starts_with("/v1/permits") { "jobs" } else { "read" };
    let path = template
        .replace("{tenant}", "atlas")
        .replace("{resource}", resource)
        .replace("{lease_id}", lease_id)
        .replace("{region}", "eu")
        .replace("{agent}", "eu-1");
    let path = if path.starts_with("/v1/explain") { format!("{path}?region=eu") } else { path };
    match (method, template) {
        ("post", "/v1/agents/register") => http.post(&path, &json!({"region": "eu", "agent": "eu-9"})).await,
        ("post", "/v1/grants") => {
            http.post(&path, &grant_body("atlas", "read", "eu", "eu-1", epoch, 99, 1, 1.0)).await
        }
        ("post", "/v1/reports") => {
            http.post(&path, &report_body("eu", epoch, "auth-r", &json!("2026-12-02T10:00:00Z"), 0, 0)).await
        }
        ("post", "/v1/permits/lease") => {
            let body = json!({"tenant": "atlas", "resource": "jobs", "region": "eu", "agent": "eu-1",
                "epoch": epoch, "seq": 0, "want": 0});
            http.post(&path, &body).await
        }
        ("post", t) if t.contains("/rollout/") => {
            // A live rollout to end (a call without the admin token is
            // refused at the PUT as at the POST).
            let put = json!({"limit": 100, "window_secs": 60, "rollout": {"canary_regions": ["eu"]}});
            http.put("/v1/policies/atlas/read", &put).await;
            http.post(&path, &json!({})).await
        }
        ("post", "/v1/leases/release") => {
            http.post(&path, &json!({"items": [{"lease_id": lease_id, "epoch": epoch, "unspent": 0}]})).await
        }
        ("post", _) => http.post(&path, &json!({"epoch": epoch, "unspent": 0})).await,
        ("put", "/v1/agents/{region}/{agent}/status") => {
            let status = json!({"epoch": epoch, "allocator_reachable": true, "outbox_depth": 0,
                "quotas_total": 0, "quotas": []});
            http.put(&path, &status).await
        }
        ("put", _) => http.put(&path, &json!({"limit": 100, "window_secs": 60})).await,
        _ => http.get(&path).await,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auth_matrix_covers_every_route_with_no_wrong_agent_and_admin_tokens() {
    let s = Stack::with_tokens("admin-secret", "agent-secret").await;
    let anon = s.http.clone();
    let wrong = anon.with_token(Some("admin-secreT"));
    let agent = anon.with_token(Some("agent-secret"));
    let admin = anon.with_token(Some("admin-secret"));
    put_policy(&admin, "atlas", "read", json!({"limit": 100, "window_secs": 60})).await;
    put_policy(&admin, "atlas", "jobs", json!({"kind": "concurrency", "max_in_flight": 3})).await;
    let epoch = register(&agent, "eu", "eu-1").await;
    let g = grant(&agent, &grant_body("atlas", "read", "eu", "eu-1", epoch, 1, 1, 1.0)).await.expect(200);
    let lease_id = g.body["lease_id"].as_str().unwrap().to_string();

    for (method, template, class) in ROUTES {
        let who = format!("{} {template}", method.to_uppercase());
        for (name, client) in [("no token", &anon), ("wrong token", &wrong)] {
            let r = call(client, method, template, &lease_id, epoch).await;
            if *class == Class::Public {
                assert_eq!(r.status, 200, "{who} with {name}: {}", r.body);
            } else {
                // A 401 also proves the route exists: the fallback answers 404.
                assert_eq!(r.status, 401, "{who} with {name}: {}", r.body);
                assert_eq!(
                    r.body,
                    json!({"error": "unauthorized", "message": "missing or invalid bearer token"})
                );
            }
        }
        let r = call(&agent, method, template, &lease_id, epoch).await;
        match class {
            Class::Admin => assert_eq!(r.status, 401, "{who} refuses the agent token: {}", r.body),
            _ => assert!(r.status < 300, "{who} with the agent token: {} {}", r.status, r.body),
        }
        let r = call(&admin, method, template, &lease_id, epoch).await;
        assert!(r.status < 300, "{who} with the admin token: {} {}", r.status, r.body);
    }
    assert_eq!(anon.get("/v1/nothing").await.error(), "not_found");
    // The token never travels in the query string.
    assert_eq!(anon.get("/ui?token=admin-secret").await.status, 401);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openapi_document_covers_every_route_of_the_router() {
    let s = Stack::start().await;
    let doc = s.http.get("/openapi.json").await.expect(200).body;
    assert!(doc["openapi"].as_str().is_some_and(|v| v.starts_with("3.")), "{doc}");
    let documented: BTreeSet<(String, String)> = doc["paths"]
        .as_object()
        .unwrap()
        .iter()
        .flat_map(|(p, ops)| {
            ops.as_object().unwrap().keys().map(move |m| (m.clone(), p.clone())).collect::<Vec<_>>()
        })
        .collect();
    let routes: BTreeSet<(String, String)> =
        ROUTES.iter().map(|(m, p, _)| (m.to_string(), p.to_string())).collect();
    assert_eq!(documented, routes);
    for schema in [
        "GrantRequest",
        "GrantResponse",
        "PolicySpec",
        "Policy",
        "WindowsPage",
        "LedgerPage",
        "Explanation",
        "PolicyVersions",
        "ErrorBody",
    ] {
        assert!(doc["components"]["schemas"][schema].is_object(), "schema {schema} missing");
    }
    assert_eq!(doc["paths"]["/v1/grants"]["post"]["security"][0]["agent_token"], json!([]));
    assert_eq!(doc["paths"]["/v1/ledger"]["get"]["security"][0]["admin_token"], json!([]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_removes_old_ledger_events_and_leases_in_batches_and_windows_still_answer() {
    let policy = json!({"limit": 1000, "window_secs": 60, "fallback_per_region": 5});
    let (_db, clock, alloc, http, epoch) = clocked_quota(Utc::now() - Duration::days(10), policy).await;
    let mut ws = json!(null);
    for seq in 0..3 {
        let g =
            grant(&http, &grant_body("atlas", "read", "eu", "eu-1", epoch, seq, 10, 1.0)).await.expect(200);
        ws = g.body["window_start"].clone();
    }
    http.post("/v1/reports", &report_body("eu", epoch, "old-r", &ws, 25, 2)).await.expect(200);
    clock.set_now(Utc::now());
    grant(&http, &grant_body("atlas", "read", "eu", "eu-1", epoch, 10, 10, 1.0)).await.expect(200);

    let db = alloc.state.db.clone();
    let cutoff = Utc::now() - Duration::hours(168);
    let counts = |db: sqlx::PgPool| async move {
        (db::ledger_events_before(&db, cutoff).await, db::leases_expiring_before(&db, cutoff).await)
    };
    assert_eq!(counts(db.clone()).await, (6, 3), "policy, registration, 3 grants, 1 report; 3 leases");
    assert!(allocator::retention::Retention::from_hours(0, 0, 5000).is_none(), "0 disables retention");
    let mut cfg = allocator::retention::Retention::from_hours(168, 2160, 2).unwrap();
    cfg.pause = std::time::Duration::from_millis(1);
    cfg.every = std::time::Duration::from_millis(50);
    let job = tokio::spawn(allocator::retention::run(db.clone(), alloc.state.db_clock.clone(), cfg));
    wait::until("retention to purge the old rows", std::time::Duration::from_secs(10), || {
        let db = db.clone();
        async move { (counts(db).await == (0, 0)).then_some(()) }
    })
    .await;
    job.abort();
    let recent = db::rows(&db, Table::Lease).await;
    assert_eq!(recent, 1, "the recent lease stays");
    let recent_events = db::rows(&db, Table::LedgerEvent).await;
    assert_eq!(recent_events, 1, "the recent grant event stays");

    let from = ws.as_str().unwrap();
    let win = &window_of(&http, &ws).await;
    assert_eq!(win["window_start"].as_str(), Some(from));
    assert_eq!(
        (win["granted"].as_i64(), win["consumed"].as_i64(), win["fallback_admitted"].as_i64()),
        (Some(30), Some(25), Some(2))
    );
    assert_eq!((win["stranded"].as_i64(), win["bound"].as_i64()), (Some(5), Some(1005)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn odd_input_on_the_operator_routes_is_a_4xx_never_a_500() {
    let s = Stack::start().await;
    put_policy(&s.http, "atlas", "read", json!({"limit": 100, "window_secs": 60})).await;
    for path in [
        "/v1/explain/atlas/read?region=eu&at=9999-12-31T23:59:59Z",
        "/v1/explain/atlas/read?region=eu&at=0000-01-01T00:00:00Z",
        "/v1/explain/atlas/read?region=eu&at=2026-12-02T10:00:00%2B14:00",
        "/v1/windows/atlas/read?from=0000-01-01T00:00:00Z&to=9999-12-31T23:59:59Z",
        "/v1/ledger?since=9999-12-31T23:59:59Z",
        "/v1/ledger?cursor=18446744073709551615.9223372036854775807",
        "/v1/ledger?cursor=18446744073709551616.1",
        "/v1/ledger?cursor=1.-1",
        "/v1/ledger?format=ndjson&cursor=x",
        "/ui/quotas/atlas/read?n=0",
        "/ui/quotas/atlas/read?n=abc",
        "/ui/quotas/atlas/read?n=100",
        "/ui/quotas/atlas/nope",
        "/ui/quotas/%3Cb%3E/read",
        "/v1/policies/atlas/read/versions?x=1",
    ] {
        let r = s.http.get(path).await;
        assert!(r.status < 500, "{path}: {} {}", r.status, r.body);
    }
}
