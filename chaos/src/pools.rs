//! What the bench and the chaos scenarios set up on the allocator before
//! they measure: policies (so the allocator creates their pools on the
//! first grant) and agent identities with their epochs. One place writes a
//! policy, and a refusal comes back as an error naming the quota and the
//! allocator's answer.

use quota_tests::http::Http;
use serde_json::{json, Value};
use std::sync::Arc;

/// `PUT /v1/policies/{tenant}/{resource}` with `body`.
pub async fn put_policy(admin: &Http, tenant: &str, resource: &str, body: &Value) -> Result<(), String> {
    let resp = admin.put(&format!("/v1/policies/{tenant}/{resource}"), body).await;
    if resp.status != 200 {
        return Err(format!("PUT policy {tenant}/{resource}: {} {}", resp.status, resp.body));
    }
    Ok(())
}

/// A policy of `limit` tokens per window of `window_secs`, every other
/// field the allocator's default.
pub async fn put_limit(
    admin: &Http,
    tenant: &str,
    resource: &str,
    limit: i64,
    window_secs: i64,
) -> Result<(), String> {
    put_policy(admin, tenant, resource, &json!({"limit": limit, "window_secs": window_secs})).await
}

/// The same policy for every resource in `resources`, one after the other.
pub async fn put_policies<R: AsRef<str>>(
    admin: &Http,
    tenant: &str,
    resources: impl IntoIterator<Item = R>,
    body: &Value,
) -> Result<(), String> {
    for r in resources {
        put_policy(admin, tenant, r.as_ref(), body).await?;
    }
    Ok(())
}

/// Registers `n` agents of `region` named `{prefix}-{i}` and answers
/// their names with their epochs. Fresh names per run let a caller start
/// `seq` at 1 again without replaying an earlier grant.
pub async fn register_agents(
    admin: &Http,
    region: &str,
    prefix: &str,
    n: usize,
) -> Result<Arc<Vec<(String, i64)>>, String> {
    let mut out = Vec::with_capacity(n);
    for c in 0..n {
        let name = format!("{prefix}-{c}");
        let r = admin.post("/v1/agents/register", &json!({"region": region, "agent": name})).await;
        let epoch =
            r.body["epoch"].as_i64().ok_or_else(|| format!("register {name}: {} {}", r.status, r.body))?;
        out.push((name, epoch));
    }
    Ok(Arc::new(out))
}
