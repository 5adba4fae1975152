//! Scenarios of what real Redis deployments do to a region (issue 14):
//! a Redis that comes back from an older snapshot.

use super::harness::{Profile, Run};
use crate::bins::Bins;
use crate::report::ScenarioReport;
use crate::traffic::region_total;
use std::time::Duration;

/// Offered load above G (eu 0.9 + us 0.4 of G): every window's pool runs
/// dry, so tokens that a rolled-back Redis shows as unspent would be
/// admitted beyond G if the agents spent them.
const EU: f64 = 0.9;
const US: f64 = 0.4;

/// Sends one command to a region's Redis, bounded by a timeout.
async fn redis_cmd(url: &str, cmd: &str) -> Result<String, String> {
    let client = redis::Client::open(url).map_err(|e| format!("redis url: {e}"))?;
    let cfg = redis::AsyncConnectionConfig::new().set_response_timeout(Some(Duration::from_secs(10)));
    let mut c = tokio::time::timeout(
        Duration::from_secs(10),
        client.get_multiplexed_async_connection_with_config(&cfg),
    )
    .await
    .map_err(|_| "connecting to Redis timed out".to_string())?
    .map_err(|e| format!("connecting to Redis: {e}"))?;
    redis::cmd(cmd).query_async(&mut c).await.map_err(|e| format!("{cmd}: {e}"))
}

/// Σ of a counter over the agents of `region`.
async fn agents_metric(run: &Run, region: &str, name: &str) -> f64 {
    let http =
        quota_tests::http::client_builder().timeout(Duration::from_secs(2)).build().unwrap_or_default();
    let mut sum = 0.0;
    for (r, urls) in run.stack.agent_urls() {
        if r != region {
            continue;
        }
        for u in urls {
            if let Ok(resp) = http.get(format!("{u}/metrics")).send().await {
                let text = resp.text().await.unwrap_or_default();
                sum += quota_tests::http::metric(&text, name).unwrap_or(0.0);
            }
        }
    }
    sum
}

/// `redis-rollback`: strict policy, demand above G. Mid-window eu's Redis
/// takes a snapshot (`SAVE`), traffic goes on for a while, then Redis is
/// SIGKILLed and restarted from that snapshot: spent leases, the counters
/// and the outbox all go back in time. Both eu replicas must notice before
/// deciding on that state (I6: admitted ≤ G per window), and the ledger
/// must never count an admit twice.
pub async fn redis_rollback(p: &Profile, bins: Bins) -> Result<ScenarioReport, String> {
    if std::env::var_os("REDIS_URL").is_some() {
        return Err("needs a local redis-server to restart (REDIS_URL is set)".into());
    }
    let mut run = Run::start("redis-rollback", p, bins, None, true).await?;
    run.traffic(&[("eu", EU), ("us", US)]);
    run.pass(1.3).await;
    let url = run.stack.region("eu").redis.url.clone();
    redis_cmd(&url, "SAVE").await?;
    let saved = chrono::Utc::now().timestamp();
    run.pass(0.4).await;
    let at = chrono::Utc::now().timestamp();
    run.stack.region_mut("eu").redis.restart_from_snapshot();
    run.note(format!("eu's Redis SIGKILLed and restarted from a snapshot taken {} s earlier", at - saved));
    // The ledger may count fewer admits than the clients around the
    // rollback: counters the snapshot held are dropped (they may have been
    // reported since), and what Redis held unsent at the crash is lost, each
    // at most two outbox intervals (200 ms) of eu's rate.
    let allowed = (p.rate(EU) * 0.8).ceil() as i64;
    run.allow_loss_between(saved - 1, at + 1, allowed);
    run.note(format!(
        "the allocator may count up to {allowed} admits fewer around the rollback (README limits)"
    ));
    let before = region_total(&run.tally(), "eu");
    run.pass(2.0).await;
    let after = region_total(&run.tally(), "eu").since(&before);
    run.check(after.admitted() > 0, format!("eu admitted {} after the rollback", after.admitted()));
    let detected = agents_metric(&run, "eu", "agent_redis_rollbacks_total").await;
    run.check(
        detected > 0.0,
        format!("eu's agents detected the rollback ({detected} quota states stranded)"),
    );
    run.finish().await
}
