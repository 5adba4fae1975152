//! Staged policy rollouts at the allocator (issue 31) on a real
//! PostgreSQL: the canary's grants follow the candidate and every other
//! region's the version in force, with the pool's limit the larger of the
//! two; the rollout's fields are checked and named; promote and halt by
//! hand name the candidate (a call about another one changes nothing);
//! a write during a rollout supersedes it; the watcher halts a rollout
//! from the agents' statuses; versions only move forward.

use quota_tests::fixtures::{grant, grant_body, put_policy, register, Stack};
use quota_tests::http::Http;
use serde_json::{json, Value};
use std::time::Duration;

fn policy(limit: i64) -> Value {
    json!({"limit": limit, "window_secs": 3600, "chunk_min": 1, "chunk_max": limit.min(1000)})
}

fn rollout(limit: i64, extra: Value) -> Value {
    let mut p = policy(limit);
    let mut r = json!({"canary_regions": ["eu"], "soak_secs": 3600});
    r.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    p["rollout"] = r;
    p
}

/// `(policy_version, tokens, pool limit)` of a grant of `want` by region's agent.
async fn granted(http: &Http, region: &str, epoch: i64, seq: i64, want: i64) -> (i64, i64, i64) {
    let agent = format!("{region}-1");
    let b = grant(http, &grant_body("atlas", "read", region, &agent, epoch, seq, want, 1.0))
        .await
        .expect(200)
        .body;
    (
        b["policy_version"].as_i64().unwrap(),
        b["tokens"].as_i64().unwrap(),
        b["pool"]["limit"].as_i64().unwrap(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grants_follow_each_regions_version_and_rollouts_end_by_hand_or_by_a_later_write() {
    let s = Stack::start().await;
    let http = &s.http;
    assert_eq!(put_policy(http, "atlas", "read", policy(1000)).await["version"], 1);
    let (eu, us) = (register(http, "eu", "eu-1").await, register(http, "us", "us-1").await);
    assert_eq!(granted(http, "us", us, 1, 400).await, (1, 400, 1000));

    // Ten times tighter, to eu first: the answer is the version in force
    // with the rollout beside it.
    let p = http.put("/v1/policies/atlas/read", &rollout(100, json!({}))).await.expect(200).body;
    assert_eq!((p["version"].as_i64(), p["limit"].as_i64()), (Some(1), Some(1000)), "{p}");
    let r = &p["rollout"];
    assert_eq!(
        (r["state"].as_str(), r["version"].as_i64(), r["from_version"].as_i64()),
        (Some("canary"), Some(2), Some(1))
    );
    assert_eq!(
        (r["limit"].as_i64(), r["halt_factor"].as_f64(), r["min_decisions"].as_i64()),
        (Some(100), Some(2.0), Some(100))
    );
    // eu grants under version 2 (its own limit: 400 already granted of 100
    // leaves nothing), us under version 1; the pool keeps the larger limit.
    assert_eq!(granted(http, "eu", eu, 1, 50).await, (2, 0, 100));
    assert_eq!(granted(http, "us", us, 2, 50).await, (1, 50, 1000));
    let w = http.get("/v1/windows/atlas/read").await.expect(200).body;
    assert_eq!(w["windows"][0]["limit"].as_i64(), Some(1000), "{w}");

    // A second rollout while this one is live: refused (eu holds version 2,
    // which only a halt or promotion moves it off).
    let second = http.put("/v1/policies/atlas/read", &rollout(500, json!({"canary_regions": ["us"]}))).await;
    assert_eq!((second.status, second.error()), (409, "rollout_in_progress"), "{}", second.body);
    // If-Match names the newest version written: the candidate, not the
    // version in force (an edit from a read older than the rollout fails).
    let stale = http.put_with("/v1/policies/atlas/read", &policy(900), &[("if-match", "1")]).await;
    assert_eq!((stale.status, stale.error()), (412, "version_mismatch"), "{}", stale.body);
    // Promote or halt naming another candidate: refused, nothing changes.
    let late = http.post("/v1/policies/atlas/read/rollout/halt", &json!({"version": 1})).await;
    assert_eq!((late.status, late.error()), (409, "not_current_rollout"), "{}", late.body);
    let bad = http.post("/v1/policies/atlas/read/rollout/halt", &json!({"version": "two"})).await;
    assert_eq!((bad.status, bad.body["field"].as_str()), (422, Some("version")), "{}", bad.body);
    // Halted: the old policy again, as version 3, for everyone.
    let h = http.post("/v1/policies/atlas/read/rollout/halt", &json!({"version": 2})).await.expect(200).body;
    assert_eq!((h["version"].as_i64(), h["limit"].as_i64()), (Some(3), Some(1000)), "{h}");
    assert_eq!(
        (h["rollout"]["state"].as_str(), h["rollout"]["halted_to_version"].as_i64()),
        (Some("halted"), Some(3))
    );
    assert_eq!(granted(http, "eu", eu, 2, 50).await, (3, 50, 1000));
    let pool_limit = |http: Http| async move {
        http.get("/v1/windows/atlas/read").await.expect(200).body["windows"][0]["limit"].as_i64()
    };
    assert_eq!(pool_limit(http.clone()).await, Some(1000));
    let again = http.post("/v1/policies/atlas/read/rollout/halt", &json!({})).await;
    assert_eq!((again.status, again.error()), (409, "no_live_rollout"));

    // A good version promoted by hand (an empty body names the live one).
    http.put("/v1/policies/atlas/read", &rollout(2000, json!({}))).await.expect(200);
    let pr = http.post("/v1/policies/atlas/read/rollout/promote", &json!(null)).await;
    assert_eq!(pr.status, 422, "a body that is not an object: {}", pr.body);
    let pr = s
        .http
        .raw("POST", "/v1/policies/atlas/read/rollout/promote", None, Vec::new())
        .await
        .expect(200)
        .body;
    assert_eq!((pr["version"].as_i64(), pr["limit"].as_i64()), (Some(4), Some(2000)), "{pr}");
    assert_eq!(granted(http, "us", us, 3, 50).await.0, 4);
    assert_eq!(pool_limit(http.clone()).await, Some(2000), "the open pool takes the promoted limit");

    // A write during a rollout supersedes it (roll forward by hand).
    http.put("/v1/policies/atlas/read", &rollout(10, json!({}))).await.expect(200);
    let d = put_policy(http, "atlas", "read", policy(3000)).await;
    assert_eq!((d["version"].as_i64(), d["rollout"]["state"].as_str()), (Some(6), Some("superseded")), "{d}");
    assert_eq!(d["rollout"]["reason"], "superseded by version 6");
    assert_eq!(granted(http, "eu", eu, 3, 50).await.0, 6);
    assert_eq!(pool_limit(http.clone()).await, Some(3000));
    let versions: Vec<i64> = http.get("/v1/policies/atlas/read/versions").await.expect(200).body["versions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["version"].as_i64().unwrap())
        .collect();
    assert_eq!(versions, [1, 2, 3, 4, 5, 6]);
    let events: Vec<(String, Value)> = sqlx::query_as(
        "select coalesce(reason, ''), coalesce(detail -> 'rollout' -> 'state', 'null') from ledger_event \
         where kind = 'policy_changed' order by id",
    )
    .fetch_all(&s.alloc.state.db)
    .await
    .unwrap();
    let states: Vec<&str> = events.iter().map(|(_, st)| st.as_str().unwrap_or("-")).collect();
    assert_eq!(states, ["-", "canary", "halted", "canary", "promoted", "canary", "-"], "{events:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rollout_fields_are_checked_and_named() {
    let s = Stack::start().await;
    let http = &s.http;
    let field = |r: quota_tests::http::Resp| (r.status, r.body["field"].as_str().unwrap_or("").to_string());
    let new = http.put("/v1/policies/atlas/new", &rollout(10, json!({}))).await;
    assert_eq!(field(new), (422, "rollout".into()), "a new quota has no version to roll out from");
    put_policy(http, "atlas", "read", policy(1000)).await;
    for (extra, name) in [
        (json!({"canary_regions": []}), "rollout.canary_regions"),
        (json!({"canary_regions": ["eu", "eu"]}), "rollout.canary_regions[1]"),
        (json!({"canary_regions": ["a b"]}), "rollout.canary_regions[0]"),
        (json!({"soak_secs": 0}), "rollout.soak_secs"),
        (json!({"halt_factor": 0.5}), "rollout.halt_factor"),
        (json!({"min_decisions": 0}), "rollout.min_decisions"),
        (json!({"nope": 1}), "rollout"),
    ] {
        let r = http.put("/v1/policies/atlas/read", &rollout(10, extra.clone())).await;
        let (status, f) = field(r);
        assert_eq!(status, 422, "{extra}");
        assert!(f.starts_with(name), "{extra}: field {f}, expected {name}");
    }
    // A canary region no agent ever registered in (a typo) cannot be promoted.
    let typo = http.put("/v1/policies/atlas/read", &rollout(10, json!({"canary_regions": ["eu"]}))).await;
    assert_eq!(field(typo), (422, "rollout.canary_regions[0]".into()));
    register(http, "eu", "eu-1").await;
    let mut other_window = rollout(10, json!({}));
    other_window["window_secs"] = json!(60);
    assert_eq!(
        field(http.put("/v1/policies/atlas/read", &other_window).await),
        (422, "rollout.window_secs".into())
    );
    // Nothing was written by the refusals.
    let p = http.get("/v1/policies/atlas/read").await.expect(200).body;
    assert_eq!((p["version"].as_i64(), p.get("rollout")), (Some(1), None), "{p}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_watcher_halts_on_the_canarys_refusals_and_promotes_a_soaked_version() {
    let s = Stack::start().await;
    let http = &s.http;
    put_policy(http, "atlas", "read", policy(1000)).await;
    let (eu, us) = (register(http, "eu", "eu-1").await, register(http, "us", "us-1").await);
    let status = |epoch: i64, version: i64, admitted: i64, refused: i64| {
        json!({"epoch": epoch, "allocator_reachable": true, "outbox_depth": 0, "quotas_total": 1,
               "quotas": [{"tenant": "atlas", "resource": "read", "mode": "leased",
                           "window_start": "2026-12-07T00:00:00Z", "quota_exhausted": refused,
                           "unavailable": 0, "admitted": admitted, "policy_version": version}]})
    };
    let until_ended = |http: Http| async move {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
        loop {
            let r = http.get("/v1/policies/atlas/read").await.expect(200).body["rollout"].clone();
            if r["state"] != "canary" {
                return r;
            }
            assert!(tokio::time::Instant::now() < deadline, "still live: {r}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    http.put("/v1/policies/atlas/read", &rollout(10, json!({"min_decisions": 50}))).await.expect(200);
    // Below min_decisions nothing happens, however bad.
    http.put("/v1/agents/eu/eu-1/status", &status(eu, 2, 0, 49)).await.expect(204);
    http.put("/v1/agents/us/us-1/status", &status(us, 1, 500, 5)).await.expect(204);
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let r = http.get("/v1/policies/atlas/read").await.expect(200).body["rollout"].clone();
    assert_eq!(
        (r["state"].as_str(), r["measured"]["new"]["refused"].as_i64()),
        (Some("canary"), Some(49)),
        "{r}"
    );
    // 90 % refused under version 2 against 1 % under version 1: halted.
    http.put("/v1/agents/eu/eu-1/status", &status(eu, 2, 10, 90)).await.expect(204);
    let r = until_ended(http.clone()).await;
    assert_eq!(
        (r["state"].as_str(), r["ended_by"].as_str()),
        (Some("halted"), Some("rollout-watcher")),
        "{r}"
    );
    assert!(r["reason"].as_str().unwrap().contains("90.0 %"), "{r}");
    assert_eq!(http.get("/v1/policies/atlas/read").await.expect(200).body["version"], 3);

    // A version the canary refuses no more than the others: promoted once soaked.
    http.put("/v1/policies/atlas/read", &rollout(2000, json!({"soak_secs": 1, "min_decisions": 10})))
        .await
        .expect(200);
    http.put("/v1/agents/eu/eu-1/status", &status(eu, 4, 100, 1)).await.expect(204);
    http.put("/v1/agents/us/us-1/status", &status(us, 3, 500, 5)).await.expect(204);
    let r = until_ended(http.clone()).await;
    assert_eq!(r["state"], "promoted", "{r}");
    let p = http.get("/v1/policies/atlas/read").await.expect(200).body;
    assert_eq!((p["version"].as_i64(), p["limit"].as_i64()), (Some(4), Some(2000)), "{p}");
}
