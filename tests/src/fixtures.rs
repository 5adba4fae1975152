//! Domain helpers over the allocator API for tests: write a policy, register
//! an agent, ask for a grant, read the database's pool rows.

use crate::app::{Options, TestAllocator};
use crate::http::{Http, Resp};
use chrono::{DateTime, Utc};
use quota_shared::clock::OffsetClock;
use serde_json::{json, Value};
use std::sync::Arc;

/// The instant an RFC 3339 text names (`2026-12-02T10:00:05Z`), in UTC.
pub fn at(s: &str) -> DateTime<Utc> {
    DateTime::parse_from_rfc3339(s).unwrap().with_timezone(&Utc)
}

/// A running allocator with a database and a client.
pub struct Stack {
    pub db: crate::pg::TestDb,
    pub alloc: TestAllocator,
    pub http: Http,
}

impl Stack {
    /// PostgreSQL plus one allocator.
    pub async fn start() -> Stack {
        Stack::with(Options::default()).await
    }

    /// PostgreSQL plus one allocator built with `opts`.
    pub async fn with(opts: Options) -> Stack {
        let db = crate::pg::TestDb::start().await;
        let alloc = TestAllocator::spawn_with(&db.url, opts).await;
        let http = Http::new(&alloc.base);
        Stack { db, alloc, http }
    }

    /// PostgreSQL plus one allocator that asks for the bearer tokens
    /// `admin` and `agent`; `http` sends none.
    pub async fn with_tokens(admin: &str, agent: &str) -> Stack {
        let opts = Options {
            admin_token: Some(admin.into()),
            agent_token: Some(agent.into()),
            ..Default::default()
        };
        Stack::with(opts).await
    }
}

/// PostgreSQL plus one allocator standing at `now` (its own clock, moved
/// by the test; `None`: the real time until set), and a client: the set-up
/// of every test that steps the allocator through time.
pub async fn clocked(
    now: Option<chrono::DateTime<chrono::Utc>>,
) -> (crate::pg::TestDb, Arc<OffsetClock>, TestAllocator, Http) {
    let db = crate::pg::TestDb::start().await;
    let clock = Arc::new(OffsetClock::default());
    if let Some(now) = now {
        clock.set_now(now);
    }
    let alloc =
        TestAllocator::spawn_with(&db.url, Options { clock: Some(clock.clone()), ..Default::default() })
            .await;
    let http = Http::new(&alloc.base);
    (db, clock, alloc, http)
}

/// A [`clocked`] allocator after the [`operator_scenario`]: the prelude of
/// every test that reads the scenario's numbers back.
pub async fn operator_scenario_played() -> (crate::pg::TestDb, Arc<OffsetClock>, TestAllocator, Http) {
    let (db, clock, alloc, http) = clocked(None).await;
    operator_scenario(&http, &clock).await;
    (db, clock, alloc, http)
}

/// A [`clocked`] allocator standing at `now` with `atlas/read` under
/// `policy` and `eu/eu-1` registered (its epoch last): the prelude of the
/// tests that step one quota through time (explain, retention, fallback).
pub async fn clocked_quota(
    now: DateTime<Utc>,
    policy: Value,
) -> (crate::pg::TestDb, Arc<OffsetClock>, TestAllocator, Http, i64) {
    let (db, clock, alloc, http) = clocked(Some(now)).await;
    put_policy(&http, "atlas", "read", policy).await;
    let epoch = register(&http, "eu", "eu-1").await;
    (db, clock, alloc, http, epoch)
}

/// The `/v1/windows` summary of `atlas/read` for the window starting at
/// `window_start` (an RFC 3339 JSON string), or the next one kept.
pub async fn window_of(http: &Http, window_start: &Value) -> Value {
    let from = window_start.as_str().unwrap().replace('+', "%2B");
    http.get(&format!("/v1/windows/atlas/read?from={from}&limit=1")).await.expect(200).body["windows"][0]
        .clone()
}

/// `PUT /v1/policies/{tenant}/{resource}`, expecting 200.
pub async fn put_policy(http: &Http, tenant: &str, resource: &str, body: Value) -> Value {
    http.put(&format!("/v1/policies/{tenant}/{resource}"), &body).await.expect(200).body
}

/// `POST /v1/agents/register`, returning the epoch.
pub async fn register(http: &Http, region: &str, agent: &str) -> i64 {
    let r = http.post("/v1/agents/register", &json!({"region": region, "agent": agent})).await.expect(200);
    r.body["epoch"].as_i64().expect("epoch")
}

/// A grant request body.
#[allow(clippy::too_many_arguments)]
pub fn grant_body(
    tenant: &str,
    resource: &str,
    region: &str,
    agent: &str,
    epoch: i64,
    seq: i64,
    want: i64,
    demand: f64,
) -> Value {
    json!({
        "tenant": tenant, "resource": resource, "region": region, "agent": agent,
        "epoch": epoch, "seq": seq, "want": want, "demand_per_sec": demand,
    })
}

/// `POST /v1/grants`.
pub async fn grant(http: &Http, body: &Value) -> Resp {
    http.post("/v1/grants", body).await
}

/// Pool counts straight from the database: `(limit, granted, returned)` of
/// every pool of the quota, and Σ tokens of its lease rows.
pub async fn pool_rows(db: &sqlx::PgPool, tenant: &str, resource: &str) -> (Vec<(i64, i64, i64)>, i64) {
    let pools: Vec<(i64, i64, i64)> = sqlx::query_as(
        "select limit_tokens, granted, returned from pool where tenant = $1 and resource = $2 order by window_start",
    )
    .bind(tenant)
    .bind(resource)
    .fetch_all(db)
    .await
    .expect("pools");
    let leased: Option<i64> =
        sqlx::query_scalar("select sum(tokens)::bigint from lease where tenant = $1 and resource = $2")
            .bind(tenant)
            .bind(resource)
            .fetch_one(db)
            .await
            .expect("leases");
    (pools, leased.unwrap_or(0))
}

/// Row counts of every table, to show a refused request changed nothing.
pub async fn table_counts(db: &sqlx::PgPool) -> Vec<(String, i64)> {
    let mut out = Vec::new();
    for t in ["policy", "policy_version", "agent", "pool", "pool_region", "lease", "report"] {
        let n: i64 =
            sqlx::query_scalar(&format!("select count(*) from {t}")).fetch_one(db).await.expect("count");
        out.push((t.to_string(), n));
    }
    let granted: Option<i64> = sqlx::query_scalar("select sum(granted + returned)::bigint from pool")
        .fetch_one(db)
        .await
        .expect("sum");
    out.push(("pool.granted+returned".into(), granted.unwrap_or(0)));
    out
}

/// A report body of one item for `{region}-1`.
pub fn report_body(
    region: &str,
    epoch: i64,
    id: &str,
    window_start: &Value,
    consumed: i64,
    fallback: i64,
) -> Value {
    json!({"region": region, "agent": format!("{region}-1"), "epoch": epoch, "report_id": id,
        "items": [{"tenant": "atlas", "resource": "read", "window_start": window_start,
                   "consumed": consumed, "fallback_admitted": fallback}]})
}

/// The operator scenario on `atlas/read` (limit 1000 per 60 s window,
/// fallback 50 per region), driven through the API with `clock`:
///
/// * window 10:00: EU is granted 300 and US 200; EU reports 250 consumed and
///   releases 50 unspent while the window is open; US reports 150 consumed
///   and, after losing the allocator, 40 fallback admits, and never releases.
///   Closed: granted 500, returned 50, admitted 440 (EU 250, US 190),
///   bound 1100, held, stranded 50 (all US).
/// * window 10:01: reports only, EU 950 consumed and US 200 fallback:
///   admitted 1150 above the bound 1100, so the bound is not held.
///
/// Leaves the clock at 10:02:30, so both windows are closed.
pub async fn operator_scenario(http: &Http, clock: &quota_shared::clock::OffsetClock) {
    clock.set_now(at("2026-12-02T10:00:05Z"));
    put_policy(
        http,
        "atlas",
        "read",
        json!({"limit": 1000, "window_secs": 60, "chunk_max": 500, "fallback_per_region": 50}),
    )
    .await;
    let eu = register(http, "eu", "eu-1").await;
    let us = register(http, "us", "us-1").await;
    let a = grant(http, &grant_body("atlas", "read", "eu", "eu-1", eu, 1, 300, 10.0)).await.expect(200);
    assert_eq!(a.body["tokens"], 300, "{}", a.body);
    let b = grant(http, &grant_body("atlas", "read", "us", "us-1", us, 1, 200, 5.0)).await.expect(200);
    assert_eq!(b.body["tokens"], 200, "{}", b.body);
    let w0 = json!("2026-12-02T10:00:00Z");
    http.post("/v1/reports", &report_body("eu", eu, "eu-r1", &w0, 250, 0)).await.expect(200);
    let lease = a.body["lease_id"].as_str().unwrap();
    http.post(&format!("/v1/leases/{lease}/release"), &json!({"epoch": eu, "unspent": 50})).await.expect(200);
    http.post("/v1/reports", &report_body("us", us, "us-r1", &w0, 150, 0)).await.expect(200);
    clock.set_now(at("2026-12-02T10:00:50Z"));
    http.post("/v1/reports", &report_body("us", us, "us-r2", &w0, 0, 40)).await.expect(200);

    clock.set_now(at("2026-12-02T10:01:30Z"));
    let w1 = json!("2026-12-02T10:01:00Z");
    http.post("/v1/reports", &report_body("eu", eu, "eu-r2", &w1, 950, 0)).await.expect(200);
    http.post("/v1/reports", &report_body("us", us, "us-r3", &w1, 0, 200)).await.expect(200);
    clock.set_now(at("2026-12-02T10:02:30Z"));
}
