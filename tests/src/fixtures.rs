//! Domain helpers over the allocator API for tests: write a policy, register
//! an agent, ask for a grant, read the database's pool rows.

use crate::app::TestAllocator;
use crate::http::{Http, Resp};
use serde_json::{json, Value};

/// A running allocator with a database and a client.
pub struct Stack {
    pub db: crate::pg::TestDb,
    pub alloc: TestAllocator,
    pub http: Http,
}

impl Stack {
    /// PostgreSQL plus one allocator.
    pub async fn start() -> Stack {
        let db = crate::pg::TestDb::start().await;
        let alloc = TestAllocator::spawn(&db.url).await;
        let http = Http::new(&alloc.base);
        Stack { db, alloc, http }
    }
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
