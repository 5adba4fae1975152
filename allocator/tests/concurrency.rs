//! Concurrency policies (a global semaphore) on a real PostgreSQL: the
//! policy PUT and its validation, the kind that never changes, permit
//! leases across regions (grant up to the limit, shrink, compare-and-set on
//! `seq`, expiry), the permit view, and the refusals between the two kinds.

use quota_tests::fixtures::{grant, grant_body, put_policy, register, table_counts, Stack};
use quota_tests::http::{metric, Http, Resp};
use serde_json::{json, Value};

fn conc(max_in_flight: i64) -> Value {
    json!({"kind": "concurrency", "max_in_flight": max_in_flight})
}

fn lease_body(region: &str, agent: &str, epoch: i64, seq: i64, want: i64) -> Value {
    json!({
        "tenant": "atlas", "resource": "jobs", "region": region, "agent": agent,
        "epoch": epoch, "seq": seq, "want": want,
    })
}

async fn lease(http: &Http, region: &str, agent: &str, epoch: i64, seq: i64, want: i64) -> Resp {
    http.post("/v1/permits/lease", &lease_body(region, agent, epoch, seq, want)).await
}

/// `(held, seq, conflict)` of an applied or conflicting lease answer.
fn hsc(r: &Resp) -> (i64, i64, bool) {
    (
        r.body["held"].as_i64().expect("held"),
        r.body["seq"].as_i64().expect("seq"),
        r.body["conflict"].as_bool().expect("conflict"),
    )
}

/// `(region, held, seq)` of every region's permit lease as the view shows it.
async fn view(http: &Http) -> (i64, Vec<(String, i64, i64)>) {
    let v = http.get("/v1/permits/atlas/jobs").await.expect(200).body;
    let regions = v["regions"]
        .as_array()
        .expect("regions")
        .iter()
        .map(|r| {
            (
                r["region"].as_str().unwrap().to_string(),
                r["held"].as_i64().unwrap(),
                r["seq"].as_i64().unwrap(),
            )
        })
        .collect();
    (v["held"].as_i64().expect("held"), regions)
}

async fn permit_events(db: &sqlx::PgPool) -> Vec<(String, i64, i64, Value)> {
    sqlx::query_as(
        "select region, tokens, seq, detail from ledger_event where kind = 'permit_lease' order by id",
    )
    .fetch_all(db)
    .await
    .expect("ledger")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_concurrency_policy_is_written_validated_and_shown_with_its_kind() {
    let s = Stack::start().await;
    let p = put_policy(
        &s.http,
        "atlas",
        "jobs",
        json!({"kind": "concurrency", "max_in_flight": 3, "fail_mode": "strict"}),
    )
    .await;
    assert_eq!(p["kind"], "concurrency");
    assert_eq!((p["max_in_flight"].as_i64(), p["permit_ttl_secs"].as_i64()), (Some(3), Some(60)));
    assert_eq!((p["limit"].as_i64(), p["fallback_per_region"].as_i64()), (Some(3), Some(0)));
    assert_eq!((p["fail_mode"].as_str(), p["version"].as_i64()), (Some("strict"), Some(1)));
    let p2 = put_policy(
        &s.http,
        "atlas",
        "jobs",
        json!({"kind": "concurrency", "max_in_flight": 5, "permit_ttl_secs": 120, "enforce": true}),
    )
    .await;
    assert_eq!((p2["max_in_flight"].as_i64(), p2["permit_ttl_secs"].as_i64()), (Some(5), Some(120)));
    assert_eq!((p2["fail_mode"].as_str(), p2["version"].as_i64()), (Some("bounded"), Some(2)));
    assert_eq!(s.http.get("/v1/policies/atlas/jobs").await.expect(200).body, p2);
    let versions = s.http.get("/v1/policies/atlas/jobs/versions").await.expect(200).body;
    let versions = versions["versions"].as_array().expect("versions").clone();
    assert_eq!(versions.len(), 2);
    assert_eq!(
        (versions[0]["kind"].as_str(), versions[0]["permit_ttl_secs"].as_i64()),
        (Some("concurrency"), Some(60))
    );
    assert_eq!(
        (versions[1]["limit"].as_i64(), versions[1]["permit_ttl_secs"].as_i64()),
        (Some(5), Some(120))
    );

    // A rate policy shows its kind and no concurrency field.
    let r = put_policy(&s.http, "atlas", "read", json!({"limit": 100, "window_secs": 60})).await;
    assert_eq!(r["kind"], "rate");
    assert!(r.get("max_in_flight").is_none() && r.get("permit_ttl_secs").is_none(), "{r}");
    let rv = s.http.get("/v1/policies/atlas/read/versions").await.expect(200).body;
    assert_eq!(rv["versions"][0]["kind"], "rate");
    assert!(rv["versions"][0].get("permit_ttl_secs").is_none(), "{rv}");

    let before = table_counts(&s.alloc.state.db).await;
    let c = |extra: Value| {
        let mut b = json!({"kind": "concurrency", "max_in_flight": 3});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        b
    };
    let cases = [
        (json!({"kind": "concurrency"}), "new", "max_in_flight"),
        (json!({"kind": "concurrency", "max_in_flight": 0}), "new", "max_in_flight"),
        (json!({"kind": "concurrency", "max_in_flight": 1_000_001}), "new", "max_in_flight"),
        (c(json!({"permit_ttl_secs": 0})), "new", "permit_ttl_secs"),
        (c(json!({"permit_ttl_secs": 86_401})), "new", "permit_ttl_secs"),
        (c(json!({"limit": 3})), "new", "limit"),
        (c(json!({"window_secs": 60})), "new", "window_secs"),
        (c(json!({"chunk_min": 1})), "new", "chunk_min"),
        (c(json!({"chunk_max": 1})), "new", "chunk_max"),
        (c(json!({"lease_ttl_secs": 10})), "new", "lease_ttl_secs"),
        (c(json!({"fallback_per_region": 0})), "new", "fallback_per_region"),
        (c(json!({"per_key": {"rate_per_sec": 1, "burst": 1}})), "new", "per_key"),
        (c(json!({"enforce": false})), "new", "enforce"),
        (c(json!({"on_stale": "keep"})), "new", "on_stale"),
        (c(json!({"reserve": [{"up_to_priority": 0, "pct": 10}]})), "new", "reserve"),
        (c(json!({"kind": "semaphore"})), "new", "kind"),
        (json!({"limit": 10, "window_secs": 60, "max_in_flight": 3}), "new", "max_in_flight"),
        (json!({"limit": 10, "window_secs": 60, "permit_ttl_secs": 3}), "new", "permit_ttl_secs"),
        (json!({"window_secs": 60}), "new", "limit"),
        (json!({"kind": "rate", "limit": 10}), "new", "window_secs"),
        // The kind of a quota never changes, either way.
        (json!({"limit": 10, "window_secs": 60}), "jobs", "kind"),
        (json!({"kind": "rate", "limit": 10, "window_secs": 60}), "jobs", "kind"),
        (conc(3), "read", "kind"),
    ];
    for (body, resource, field) in cases {
        let r = s.http.put(&format!("/v1/policies/atlas/{resource}"), &body).await;
        assert_eq!((r.status, r.error()), (422, "invalid_field"), "{body}: {}", r.body);
        let message = r.body["message"].as_str().unwrap();
        assert!(message.contains(field), "{body}: {}", r.body);
        // Serde's own refusals (an unknown kind) name the field only in the message.
        if field != "kind" || resource != "new" {
            assert_eq!(r.body["field"], field, "{body}: {}", r.body);
        }
    }
    let r = s.http.put("/v1/policies/atlas/jobs", &json!({"limit": 10, "window_secs": 60})).await;
    assert!(r.body["message"]
        .as_str()
        .unwrap()
        .contains("quota atlas/jobs is a concurrency policy; its kind cannot change"));
    let r = s.http.put("/v1/policies/atlas/read", &conc(3)).await;
    assert!(r.body["message"]
        .as_str()
        .unwrap()
        .contains("quota atlas/read is a rate policy; its kind cannot change"));
    let r = s.http.put("/v1/policies/atlas/new", &json!({"window_secs": 60})).await;
    assert!(r.body["message"].as_str().unwrap().contains("required for a rate policy"), "{}", r.body);
    let r = s.http.put("/v1/policies/atlas/new", &c(json!({"limit": 3}))).await;
    assert!(
        r.body["message"].as_str().unwrap().contains("not a field of a concurrency policy"),
        "{}",
        r.body
    );
    assert_eq!(table_counts(&s.alloc.state.db).await, before);
    assert_eq!(s.http.get("/v1/policies/atlas/jobs").await.body["version"], 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permits_are_leased_up_to_the_limit_across_regions_and_returned() {
    let s = Stack::start().await;
    put_policy(&s.http, "atlas", "jobs", conc(3)).await;
    let eu = register(&s.http, "eu", "eu-1").await;
    let us = register(&s.http, "us", "us-1").await;

    let a = lease(&s.http, "eu", "eu-1", eu, 0, 2).await.expect(200);
    assert_eq!(hsc(&a), (2, 1, false));
    assert_eq!(a.body["lease_ms"], 90_000, "permit_ttl_secs 60 + 30 s of slack: {}", a.body);
    assert_eq!((a.body["max_in_flight"].as_i64(), a.body["permit_ttl_secs"].as_i64()), (Some(3), Some(60)));
    assert_eq!((a.body["fail_mode"].as_str(), a.body["version"].as_i64()), (Some("bounded"), Some(1)));
    // B wants 2 with max 3: gets 1.
    let b = lease(&s.http, "us", "us-1", us, 0, 2).await.expect(200);
    assert_eq!(hsc(&b), (1, 1, false));
    assert_eq!(view(&s.http).await, (3, vec![("eu".into(), 2, 1), ("us".into(), 1, 1)]));
    // Nothing left: a renewal asking for more keeps what it holds.
    assert_eq!(hsc(&lease(&s.http, "us", "us-1", us, 1, 3).await.expect(200)), (1, 2, false));

    // A shrinks to 0: its permits return at once, and B may grow.
    assert_eq!(hsc(&lease(&s.http, "eu", "eu-1", eu, 1, 0).await.expect(200)), (0, 2, false));
    assert_eq!(hsc(&lease(&s.http, "us", "us-1", us, 2, 3).await.expect(200)), (3, 3, false));
    assert_eq!(view(&s.http).await, (3, vec![("eu".into(), 0, 2), ("us".into(), 3, 3)]));

    // A lowered limit takes effect as regions shrink: B keeps 3 until it
    // asks for less, then cannot grow back above the new limit.
    put_policy(&s.http, "atlas", "jobs", conc(2)).await;
    assert_eq!(hsc(&lease(&s.http, "us", "us-1", us, 3, 3).await.expect(200)), (3, 4, false));
    assert_eq!(hsc(&lease(&s.http, "us", "us-1", us, 4, 1).await.expect(200)), (1, 5, false));
    let b = lease(&s.http, "us", "us-1", us, 5, 3).await.expect(200);
    assert_eq!((hsc(&b), b.body["version"].as_i64()), ((2, 6, false), Some(2)));

    // The ledger has one event per change of what a region holds (the
    // renewals that changed nothing wrote none): tokens = held now.
    let events = permit_events(&s.alloc.state.db).await;
    let summary: Vec<(String, i64, i64, i64)> = events
        .iter()
        .map(|(region, tokens, seq, d)| (region.clone(), *tokens, *seq, d["held_before"].as_i64().unwrap()))
        .collect();
    assert_eq!(
        summary,
        [
            ("eu".to_string(), 2, 1, 0),
            ("us".to_string(), 1, 1, 0),
            ("eu".to_string(), 0, 2, 2),
            ("us".to_string(), 3, 3, 1),
            ("us".to_string(), 1, 5, 3),
            ("us".to_string(), 2, 6, 1),
        ]
    );
    let (_, _, _, d) = &events[1];
    assert_eq!(
        (d["want"].as_i64(), d["others"].as_i64(), d["max_in_flight"].as_i64()),
        (Some(2), Some(2), Some(3))
    );

    let text = s.http.get("/metrics").await.expect(200).body.as_str().expect("text").to_string();
    assert_eq!(metric(&text, "allocator_permit_leases_total{outcome=\"applied\"}"), Some(8.0), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_at_a_stale_seq_changes_nothing_and_answers_the_lease() {
    let s = Stack::start().await;
    put_policy(&s.http, "atlas", "jobs", conc(3)).await;
    let eu = register(&s.http, "eu", "eu-1").await;
    let eu2 = register(&s.http, "eu", "eu-2").await;
    assert_eq!(hsc(&lease(&s.http, "eu", "eu-1", eu, 0, 2).await.expect(200)), (2, 1, false));
    let events = permit_events(&s.alloc.state.db).await.len();
    // Another replica of the region, still at seq 0, asks for 3.
    let r = lease(&s.http, "eu", "eu-2", eu2, 0, 3).await.expect(200);
    assert_eq!(hsc(&r), (2, 1, true));
    let left = r.body["lease_ms"].as_i64().unwrap();
    assert!((80_000..=90_000).contains(&left), "what is left of the lease: {}", r.body);
    // A seq from the future, the same.
    assert_eq!(hsc(&lease(&s.http, "eu", "eu-2", eu2, 9, 0).await.expect(200)), (2, 1, true));
    assert_eq!(view(&s.http).await, (2, vec![("eu".into(), 2, 1)]));
    assert_eq!(permit_events(&s.alloc.state.db).await.len(), events);
    // At the lease's seq, the replica applies.
    assert_eq!(hsc(&lease(&s.http, "eu", "eu-2", eu2, 1, 3).await.expect(200)), (3, 2, false));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_lease_frees_its_permits_to_the_other_regions() {
    let s = Stack::start().await;
    put_policy(
        &s.http,
        "atlas",
        "jobs",
        json!({"kind": "concurrency", "max_in_flight": 3, "permit_ttl_secs": 1}),
    )
    .await;
    let eu = register(&s.http, "eu", "eu-1").await;
    let us = register(&s.http, "us", "us-1").await;
    let a = lease(&s.http, "eu", "eu-1", eu, 0, 3).await.expect(200);
    assert_eq!((hsc(&a), a.body["lease_ms"].as_i64()), ((3, 1, false), Some(31_000)));
    assert_eq!(hsc(&lease(&s.http, "us", "us-1", us, 0, 2).await.expect(200)), (0, 1, false));

    // Fault injection: EU's lease ran out (it vanished 31 s ago).
    sqlx::query("update permit_lease set expires_at = now() - interval '1 second' where region = 'eu'")
        .execute(&s.alloc.state.db)
        .await
        .expect("expire");
    assert_eq!(view(&s.http).await, (0, vec![("eu".into(), 0, 1), ("us".into(), 0, 1)]));
    assert_eq!(hsc(&lease(&s.http, "us", "us-1", us, 1, 2).await.expect(200)), (2, 2, false));
    // EU, back, learns it holds nothing (at its seq, a conflict answers
    // held 0 and no life left), then gets what is left.
    let r = lease(&s.http, "eu", "eu-1", eu, 0, 3).await.expect(200);
    assert_eq!((hsc(&r), r.body["lease_ms"].as_i64()), ((0, 1, true), Some(0)));
    assert_eq!(hsc(&lease(&s.http, "eu", "eu-1", eu, 1, 3).await.expect(200)), (1, 2, false));
    assert_eq!(view(&s.http).await, (3, vec![("eu".into(), 1, 2), ("us".into(), 2, 2)]));

    // Retention deletes a lease expired for more than a day, and only that.
    sqlx::query("update permit_lease set expires_at = now() - interval '25 hours' where region = 'eu'")
        .execute(&s.alloc.state.db)
        .await
        .expect("expire");
    let cfg = allocator::retention::Retention::from_hours(168, 0, 100).expect("retention");
    let purged = allocator::retention::sweep(&s.alloc.state.db, &s.alloc.state.db_clock, &cfg).await.unwrap();
    assert_eq!(purged.permit_leases, 1);
    assert_eq!(view(&s.http).await, (2, vec![("us".into(), 2, 2)]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_kind_refuses_the_other_kinds_requests() {
    let s = Stack::start().await;
    put_policy(&s.http, "atlas", "jobs", conc(3)).await;
    put_policy(&s.http, "atlas", "read", json!({"limit": 100, "window_secs": 60})).await;
    let eu = register(&s.http, "eu", "eu-1").await;

    // A grant of a concurrency quota: 409 concurrency_policy, single or batch.
    let r = grant(&s.http, &grant_body("atlas", "jobs", "eu", "eu-1", eu, 1, 10, 1.0)).await.expect(409);
    assert_eq!(r.error(), "concurrency_policy");
    assert!(r.body["message"].as_str().unwrap().contains("/v1/permits/lease"), "{}", r.body);
    let batch = json!({"items": [
        grant_body("atlas", "jobs", "eu", "eu-1", eu, 2, 10, 1.0),
        grant_body("atlas", "read", "eu", "eu-1", eu, 3, 10, 1.0),
        grant_body("atlas", "none", "eu", "eu-1", eu, 4, 10, 1.0),
    ]});
    let b = grant(&s.http, &batch).await.expect(200).body;
    assert_eq!(
        (b["items"][0]["status"].as_i64(), b["items"][0]["error"]["error"].as_str()),
        (Some(409), Some("concurrency_policy"))
    );
    assert_eq!(b["items"][1]["status"], 200);
    assert_eq!(
        (b["items"][2]["status"].as_i64(), b["items"][2]["error"]["error"].as_str()),
        (Some(404), Some("unknown_quota"))
    );
    let (pools, _) = quota_tests::fixtures::pool_rows(&s.alloc.state.db, "atlas", "jobs").await;
    assert!(pools.is_empty(), "no pool for a concurrency quota: {pools:?}");

    // A permit lease (or view) of a rate quota: 409 rate_policy; of no quota: 404.
    let mut body = lease_body("eu", "eu-1", eu, 0, 1);
    body["resource"] = json!("read");
    let r = s.http.post("/v1/permits/lease", &body).await.expect(409);
    assert_eq!(r.error(), "rate_policy");
    assert_eq!(s.http.get("/v1/permits/atlas/read").await.expect(409).error(), "rate_policy");
    body["resource"] = json!("none");
    assert_eq!(s.http.post("/v1/permits/lease", &body).await.expect(404).error(), "unknown_quota");
    assert_eq!(s.http.get("/v1/permits/atlas/none").await.expect(404).error(), "unknown_quota");
    let empty = s.http.get("/v1/permits/atlas/jobs").await.expect(200).body;
    assert_eq!((empty["held"].as_i64(), empty["max_in_flight"].as_i64()), (Some(0), Some(3)));
    assert_eq!(empty["regions"], json!([]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permit_leases_are_fenced_and_validated_like_grants() {
    let s = Stack::start().await;
    put_policy(&s.http, "atlas", "jobs", conc(3)).await;
    let old = register(&s.http, "eu", "eu-1").await;
    let cur = register(&s.http, "eu", "eu-1").await;
    let before = view(&s.http).await;

    let r = lease(&s.http, "eu", "eu-1", old, 0, 1).await.expect(409);
    assert_eq!(r.error(), "stale_epoch");
    let r = lease(&s.http, "eu", "eu-1", cur + 1, 0, 1).await.expect(422);
    assert_eq!((r.error(), r.body["field"].as_str()), ("invalid_field", Some("epoch")));
    assert_eq!(lease(&s.http, "eu", "eu-9", 1, 0, 1).await.expect(404).error(), "unknown_agent");
    for (field, value) in [
        ("epoch", json!(0)),
        ("seq", json!(-1)),
        ("want", json!(-1)),
        ("want", json!(1_000_001)),
        ("region", json!("no/slash")),
        ("tenant", json!("")),
    ] {
        let mut body = lease_body("eu", "eu-1", cur, 0, 1);
        body[field] = value;
        let r = s.http.post("/v1/permits/lease", &body).await.expect(422);
        assert_eq!(r.body["field"], field, "{body}: {}", r.body);
    }
    let mut body = lease_body("eu", "eu-1", cur, 0, 1);
    body["colour"] = json!("blue");
    s.http.post("/v1/permits/lease", &body).await.expect(422);
    assert_eq!(view(&s.http).await, before);

    // The stale epoch's refusal is in the ledger, as for grants.
    let refused: i64 = sqlx::query_scalar(
        "select count(*) from ledger_event where kind = 'refused' and reason = 'stale_epoch' and resource = 'jobs'",
    )
    .fetch_one(&s.alloc.state.db)
    .await
    .expect("refusals");
    assert_eq!(refused, 1);
    assert_eq!(hsc(&lease(&s.http, "eu", "eu-1", cur, 0, 1).await.expect(200)), (1, 1, false));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lease_is_an_agent_route_and_the_view_an_admin_route() {
    let s = Stack::with_tokens("admin-secret", "agent-secret").await;
    let agent = s.http.with_token(Some("agent-secret"));
    let admin = s.http.with_token(Some("admin-secret"));
    put_policy(&admin, "atlas", "jobs", conc(3)).await;
    let epoch = register(&agent, "eu", "eu-1").await;
    for client in [&s.http, &s.http.with_token(Some("admin-secreT"))] {
        assert_eq!(lease(client, "eu", "eu-1", epoch, 0, 1).await.expect(401).error(), "unauthorized");
        assert_eq!(client.get("/v1/permits/atlas/jobs").await.expect(401).error(), "unauthorized");
    }
    assert_eq!(agent.get("/v1/permits/atlas/jobs").await.status, 401);
    assert_eq!(hsc(&lease(&agent, "eu", "eu-1", epoch, 0, 1).await.expect(200)), (1, 1, false));
    assert_eq!(admin.get("/v1/permits/atlas/jobs").await.expect(200).body["held"], 1);
}
