//! Scenarios of what real Redis deployments do to a region (issue 14):
//! a Redis that comes back from an older snapshot, a Sentinel failover to
//! a replica that missed the last writes, and an evicting
//! `maxmemory-policy` switched on at run time.

use super::harness::{Profile, Run};
use crate::bins::Bins;
use crate::report::ScenarioReport;
use crate::stack::StackSpec;
use crate::traffic::{region_total, Answer};
use std::time::Duration;

/// Offered load above G (eu 0.9 + us 0.4 of G): every window's pool runs
/// dry, so tokens that a rolled-back Redis shows as unspent would be
/// admitted beyond G if the agents spent them.
const EU: f64 = 0.9;
const US: f64 = 0.4;

/// Sends one command (`args[0]` with its arguments) to a region's Redis,
/// bounded by a timeout.
async fn redis_cmd(url: &str, args: &[&str]) -> Result<String, String> {
    let mut c = crate::redis_conn::connect(url, Duration::from_secs(10)).await?;
    let mut cmd = redis::cmd(args[0]);
    for a in &args[1..] {
        cmd.arg(*a);
    }
    tokio::time::timeout(Duration::from_secs(10), cmd.query_async::<redis::Value>(&mut c))
        .await
        .map_err(|_| format!("{args:?} timed out"))?
        .map(|v| format!("{v:?}"))
        .map_err(|e| format!("{args:?}: {e}"))
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
    redis_cmd(&url, &["SAVE"]).await?;
    let saved = chrono::Utc::now().timestamp();
    run.pass(0.4).await;
    let at = chrono::Utc::now().timestamp();
    run.stack.region_mut("eu").redis.restart_from_snapshot();
    run.note(format!("eu's Redis SIGKILLed and restarted from a snapshot taken {} s earlier", at - saved));
    run.figure("snapshot_age_s", (at - saved) as f64);
    // The ledger may count fewer admits than the clients around the
    // rollback: counters the snapshot held are dropped (they may have been
    // reported since), and what Redis held unsent at the crash is lost, each
    // at most two outbox intervals (200 ms) of eu's rate.
    let allowed = (p.rate(EU) * 0.8).ceil() as i64;
    run.allow_loss_between(saved - 1, at + 1, allowed);
    eu_recovers(&mut run, allowed, "rollback", 2.0).await;
    run.finish().await
}

/// The end of a scenario that rolled eu's Redis back (`what`: how): notes
/// the `allowed` loss already granted, then eu must admit again within
/// `windows` and its agents must have detected the rollback.
async fn eu_recovers(run: &mut Run, allowed: i64, what: &str, windows: f64) {
    run.note(format!(
        "the allocator may count up to {allowed} admits fewer around the {what} (docs/limits.md)"
    ));
    let before = region_total(&run.tally(), "eu");
    run.pass(windows).await;
    let after = region_total(&run.tally(), "eu").since(&before);
    run.check(after.admitted() > 0, format!("eu admitted {} after the {what}", after.admitted()));
    let detected = agents_metric(run, "eu", "agent_redis_rollbacks_total").await;
    // Which limits noticed (F33): each quota state an agent found rolled
    // back and stranded counts once.
    run.figure("rollbacks_detected", detected);
    run.figure("admitted_after_fault", after.admitted() as f64);
    run.check(
        detected > 0.0,
        format!("eu's agents detected the rollback ({detected} quota states stranded)"),
    );
}

/// The first admit of `region`'s clients among `answers` (sent at or after
/// the fault), and the 503s answered before it, by error code.
fn first_admit(answers: &[Answer]) -> (Option<&Answer>, std::collections::BTreeMap<String, u64>) {
    let first = answers.iter().filter(|a| a.status == 200).min_by_key(|a| a.done_ms);
    let mut refused = std::collections::BTreeMap::new();
    for a in answers {
        if a.status == 503 && first.is_none_or(|f| a.sent_ms <= f.sent_ms) {
            *refused.entry(a.error.clone()).or_insert(0) += 1;
        }
    }
    (first, refused)
}

/// Longest the region may go without an admit after its Redis primary is
/// killed: Sentinel's detection (`down-after-milliseconds` 500 ms), its
/// promotion (1–3 s here) and the agents' next lookup, with room for a
/// loaded machine.
const FAILOVER_BOUND: Duration = Duration::from_secs(10);

/// `redis-failover`: eu's agents find their Redis through Sentinel
/// (primary, replica, Sentinel). Early in a window the replica is made to
/// miss every later write (`REPLICAOF` a dead port: it keeps its data and
/// its role), traffic goes on for half a second, the primary is SIGKILLed
/// and Sentinel promotes the replica: eu's Redis goes back in time by what
/// it missed. Strict policy, demand above G: a rolled-back balance spent
/// again would show as admits beyond G. The agents must follow, detect the
/// rollback (a new server identity) and strand what they cannot trust.
pub async fn redis_failover(p: &Profile, bins: Bins) -> Result<ScenarioReport, String> {
    let spec = StackSpec {
        regions: vec![("eu".into(), 2), ("us".into(), 1)],
        allocators: 1,
        agent_env: Vec::new(),
        sentinel_regions: vec!["eu".into()],
        patroni: None,
    };
    let mut run = Run::start("redis-failover", p, bins, Some(spec), true).await?;
    run.traffic(&[("eu", EU), ("us", US)]);
    run.pass(1.2).await;
    // Early in a window, so the region is served again before the pool of
    // that window runs dry and a 429 would hide when service came back.
    run.at_phase(0.05).await;
    let g = run.stack.region("eu").sentinel.as_ref().ok_or("eu has no Sentinel group")?;
    let nowhere = quota_tests::free_port().to_string();
    // See `TestSentinel::cut_replica_link`: SIGSTOP would not do.
    g.cli(g.replica_port, &["REPLICAOF", "127.0.0.1", &nowhere])?;
    let cut = chrono::Utc::now().timestamp();
    run.note("eu's replica cut off from its primary (REPLICAOF a dead port): it misses every later write");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let g = run.stack.region_mut("eu").sentinel.as_mut().ok_or("eu has no Sentinel group")?;
    let missed = g.primary_offset() - g.replica_offset();
    g.kill_primary();
    let killed_ms = chrono::Utc::now().timestamp_millis();
    run.note(format!(
        "eu's Redis primary SIGKILLed 0.5 s later; the replica missed {missed} bytes of writes"
    ));
    run.figure("replica_missed_bytes", missed as f64);
    // Wait for the first admit in eu after the kill (or the bound; the
    // check below judges what was seen).
    let run_ref = &run;
    let _ =
        quota_tests::wait::poll(
            FAILOVER_BOUND + Duration::from_secs(2),
            Duration::from_millis(50),
            || async move {
                run_ref.answers("eu", killed_ms).iter().any(|a| a.status == 200).then_some(()).ok_or(())
            },
        )
        .await;
    let g = run.stack.region("eu").sentinel.as_ref().ok_or("eu has no Sentinel group")?;
    let (promoted, replica) = (g.primary_by_sentinel(), g.replica_port);
    run.check(
        promoted == Some(replica),
        format!("Sentinel names the old replica ({replica}) as primary: {promoted:?}"),
    );
    let answers = run.answers("eu", killed_ms);
    let (first, refused) = first_admit(&answers);
    match first {
        Some(f) => {
            let after = Duration::from_millis((f.done_ms - killed_ms).max(0) as u64);
            run.figure("first_admit_after_kill_s", after.as_secs_f64());
            run.check(
                after <= FAILOVER_BOUND,
                format!(
                    "eu admitted again {:.2} s after the primary was killed (limit {FAILOVER_BOUND:?})",
                    after.as_secs_f64()
                ),
            );
        }
        None => {
            run.check(false, format!("eu admitted nothing within {FAILOVER_BOUND:?} of the primary's death"))
        }
    }
    run.note(format!("eu's clients were answered 503 meanwhile: {refused:?}"));
    // Admits the lost primary held unsent at its death (at most two outbox
    // intervals of eu's rate) and counters the replica held from before the
    // cut (dropped: they may have been reported since) are missing from the
    // ledger; the same allowance as redis-rollback, over the windows of the
    // cut and the kill.
    let allowed = (p.rate(EU) * 0.8).ceil() as i64;
    run.lost_allowance = Some((run.window_key(cut - 1), run.window_key(killed_ms / 1000 + 1), allowed));
    eu_recovers(&mut run, allowed, "failover", 1.5).await;
    run.finish().await
}

/// How often the eviction scenario's agents read the policy (the default,
/// 5 s, is more than a window of the short profile).
const POLICY_CHECK_MS: u64 = 1000;

/// `redis-eviction`: eu's Redis is switched at run time to
/// `maxmemory-policy allkeys-lru` (CONFIG SET) for 1.5 windows, then back
/// to `noeviction`. Under that policy Redis may evict the counters the
/// bound rests on, so eu must answer 503 `store_unavailable` (and admit
/// nothing) from its next policy check until the policy is back, then
/// admit again. Bounded policy, load below G: every refusal comes from the
/// policy.
pub async fn redis_eviction(p: &Profile, bins: Bins) -> Result<ScenarioReport, String> {
    if std::env::var_os("REDIS_URL").is_some() {
        return Err("needs a local redis-server to reconfigure (REDIS_URL is set)".into());
    }
    let spec = StackSpec {
        regions: vec![("eu".into(), 2), ("us".into(), 1)],
        allocators: 1,
        agent_env: vec![("AGENT_REDIS_POLICY_CHECK_MS".into(), POLICY_CHECK_MS.to_string())],
        sentinel_regions: Vec::new(),
        patroni: None,
    };
    let mut run = Run::start("redis-eviction", p, bins, Some(spec), false).await?;
    run.traffic(&[("eu", 0.4), ("us", 0.3)]);
    run.pass(1.5).await;
    let url = run.stack.region("eu").redis.url.clone();
    redis_cmd(&url, &["CONFIG", "SET", "maxmemory-policy", "allkeys-lru"]).await?;
    let on_ms = chrono::Utc::now().timestamp_millis();
    run.note(format!(
        "eu's Redis switched to maxmemory-policy allkeys-lru (agents check every {POLICY_CHECK_MS} ms)"
    ));
    run.pass(1.5).await;
    redis_cmd(&url, &["CONFIG", "SET", "maxmemory-policy", "noeviction"]).await?;
    let off_ms = chrono::Utc::now().timestamp_millis();
    run.note(format!("back to noeviction after {:.1} s", (off_ms - on_ms) as f64 / 1000.0));
    run.pass(1.5).await;
    let during = run.answers("eu", on_ms);
    let first_refusal = during.iter().filter(|a| a.error == "store_unavailable").map(|a| a.done_ms).min();
    match first_refusal {
        Some(t) => run.note(format!(
            "first 503 store_unavailable {:.2} s after the switch",
            (t - on_ms) as f64 / 1000.0
        )),
        None => run.check(false, "eu never answered 503 store_unavailable under allkeys-lru"),
    }
    // Every agent has read the policy once a check period (and a round
    // trip) has passed: from then until the switch back, nothing but
    // `store_unavailable`.
    let settled = on_ms + POLICY_CHECK_MS as i64 + 300;
    let held: Vec<&Answer> = during.iter().filter(|a| a.sent_ms >= settled && a.done_ms <= off_ms).collect();
    let admitted = held.iter().filter(|a| a.status == 200).count();
    let refused = held.iter().filter(|a| a.status == 503 && a.error == "store_unavailable").count();
    run.check(
        admitted == 0 && refused > 0 && refused == held.len(),
        format!(
            "from {POLICY_CHECK_MS} ms after the switch until the switch back eu answered {refused} of {} requests \
             503 store_unavailable, admitted {admitted}",
            held.len()
        ),
    );
    let back = run.answers("eu", off_ms);
    match back.iter().filter(|a| a.status == 200).map(|a| a.done_ms).min() {
        Some(t) => run.check(
            t - off_ms <= 2 * POLICY_CHECK_MS as i64 + 1000,
            format!("eu admitted again {:.2} s after the switch back", (t - off_ms) as f64 / 1000.0),
        ),
        None => run.check(false, "eu admitted nothing after the switch back to noeviction"),
    }
    run.finish().await
}
