//! `policy-rollout` (issue 31; seed 002 F24/F25, game day 6): a
//! deliberately bad version (the limit 100 times too tight, F25's unit
//! mix-up) published to the canary region only, under traffic from both
//! regions, with one of the two allocator replicas SIGKILLed right after
//! the `PUT`: the watcher of the one left must halt it by itself, refusals stay
//! in the canary, and a roll forward with a higher version goes
//! everywhere. The window bound of the run is checked as in every scenario.

use super::harness::{Profile, Run, RESOURCE, TENANT};
use crate::bins::Bins;
use crate::report::ScenarioReport;
use crate::stack::StackSpec;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

const EU: f64 = 0.3;
const US: f64 = 0.3;
/// The bad version's limit divides G by this.
const TIGHTER: i64 = 100;

fn body(p: &Profile, limit: i64, rollout: Value) -> Value {
    json!({"limit": limit, "window_secs": p.window_secs, "fallback_per_region": p.fallback.min(limit),
           "fail_mode": "bounded", "rollout": rollout})
}

/// Polls the quota's rollout until its state is no longer `canary` (or
/// `within` passes); answers it.
async fn until_ended(run: &Run, within: Duration) -> Value {
    let deadline = Instant::now() + within;
    loop {
        let r = run.stack.admin.get(&format!("/v1/policies/{TENANT}/{RESOURCE}")).await;
        let rollout = r.body["rollout"].clone();
        if rollout["state"] != "canary" || Instant::now() >= deadline {
            return rollout;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `(admitted, refused)` answers of `region` sent since `since_ms`.
fn answered(run: &Run, region: &str, since_ms: i64) -> (usize, usize) {
    let a = run.answers(region, since_ms);
    let refused = a.iter().filter(|x| x.status == 429).count();
    (a.iter().filter(|x| x.status == 200).count(), refused)
}

pub async fn policy_rollout(p: &Profile, bins: Bins) -> Result<ScenarioReport, String> {
    let spec = StackSpec {
        regions: vec![("eu".into(), 1), ("us".into(), 1)],
        allocators: 2,
        agent_env: vec![("AGENT_STATUS_INTERVAL_MS".into(), "500".into())],
        sentinel_regions: Vec::new(),
        patroni: None,
    };
    let mut run = Run::start("policy-rollout", p, bins, Some(spec), false).await?;
    run.traffic(&[("eu", EU), ("us", US)]);
    run.pass(1.5).await;

    let soak = (p.window_secs * 10) as u64;
    let bad =
        body(p, p.limit / TIGHTER, json!({"canary_regions": ["eu"], "soak_secs": soak, "min_decisions": 50}));
    let since = chrono::Utc::now().timestamp_millis();
    let started = Instant::now();
    let r = run.stack.admin.put(&format!("/v1/policies/{TENANT}/{RESOURCE}"), &bad).await;
    if r.status != 200 || r.body["rollout"]["state"] != "canary" {
        run.check(false, format!("the bad version's rollout started: {} {}", r.status, r.body));
        return run.finish().await;
    }
    let candidate = r.body["rollout"]["version"].as_i64().unwrap_or(0);
    run.stack.allocators[0].kill(libc::SIGKILL);
    run.note(format!(
        "version {candidate} (limit {} instead of {}) rolled out to eu, soak {soak} s; allocator replica 1 SIGKILLed at once",
        p.limit / TIGHTER,
        p.limit
    ));
    let ended = until_ended(&run, Duration::from_secs(soak)).await;
    let halt_s = started.elapsed().as_secs_f64();
    let (eu_ok, eu_refused) = answered(&run, "eu", since);
    let (us_ok, us_refused) = answered(&run, "us", since);
    run.check(
        ended["state"] == "halted" && ended["ended_by"] == "rollout-watcher",
        format!("halted by itself {halt_s:.1} s after the PUT (soak {soak} s): {}", ended["reason"]),
    );
    run.check(
        us_refused == 0,
        format!("refusals outside the canary while it ran: {us_refused} (us admitted {us_ok})"),
    );
    run.check(
        eu_refused > 0,
        format!("the canary refused {eu_refused} (admitted {eu_ok}) under the bad version"),
    );
    run.figure("halt_s", halt_s);
    run.figure("soak_s", soak as f64);
    run.figure("refusals_outside_canary", us_refused as f64);
    run.figure("canary_refusals", eu_refused as f64);
    let halted_to = ended["halted_to_version"].as_i64().unwrap_or(0);
    run.check(
        halted_to > candidate,
        format!("the old policy published again as version {halted_to} > {candidate}"),
    );
    // The canary back on the old policy: its last refusal after the halt
    // (a refused grant is retried within 1 s while a rollout is live).
    let halted_ms = chrono::Utc::now().timestamp_millis();
    run.stack.allocators[0].restart().await?;
    run.note("allocator replica 1 restarted");
    run.pass(1.0).await;
    let last_refused =
        run.answers("eu", halted_ms).iter().filter(|a| a.status == 429).map(|a| a.sent_ms).max();
    let back_s = last_refused.map_or(0.0, |t| (t - halted_ms) as f64 / 1000.0);
    run.figure("canary_last_refusal_after_halt_s", back_s);
    run.check(
        back_s <= 2.0,
        format!("the canary's last refusal {back_s:.2} s after the halt was seen (refusals within about 1 s expected)"),
    );

    // Roll forward: the fixed policy (G again) as a higher version, to eu
    // first, soaked for one window.
    let fixed =
        body(p, p.limit, json!({"canary_regions": ["eu"], "soak_secs": p.window_secs, "min_decisions": 20}));
    let since = chrono::Utc::now().timestamp_millis();
    let r = run.stack.admin.put(&format!("/v1/policies/{TENANT}/{RESOURCE}"), &fixed).await;
    let forward = r.body["rollout"]["version"].as_i64().unwrap_or(0);
    let ended = until_ended(&run, Duration::from_secs(soak)).await;
    let rolled_forward = ended["state"] == "promoted" && forward > halted_to;
    run.figure("rolled_forward", if rolled_forward { 1.0 } else { 0.0 });
    run.check(
        rolled_forward,
        format!("rolled forward: version {forward} {} ({})", ended["state"], ended["reason"]),
    );
    run.pass(1.0).await;
    run.check(
        run.answers("eu", since).iter().any(|a| a.status == 200),
        "the canary admitted under the roll forward",
    );
    let (_, eu_refused) = answered(&run, "eu", since);
    let (_, us_refused) = answered(&run, "us", since);
    run.check(
        eu_refused + us_refused == 0,
        format!("from the roll forward on: eu refused {eu_refused}, us {us_refused}"),
    );
    let v = run.stack.admin.get(&format!("/v1/policies/{TENANT}/{RESOURCE}")).await.body;
    run.check(
        v["version"].as_i64() == Some(forward),
        format!("version in force {} = {forward}", v["version"]),
    );
    run.finish().await
}
