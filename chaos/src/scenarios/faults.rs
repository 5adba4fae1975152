//! Scenarios 1–8 and 10 of the chaos issue: one fault each, on a link or a
//! process, during steady traffic below G.

use super::harness::{Profile, Run, RESOURCE, TENANT};
use crate::bins::Bins;
use crate::report::ScenarioReport;
use crate::stack::StackSpec;
use crate::traffic::{region_total, Counts};
use quota_tests::proxy::Fault;
use serde_json::json;
use std::time::Duration;

/// Offered load of the fault scenarios: 70 % of G, so every refusal the
/// clients see comes from the fault, not from the pool running dry.
const EU: f64 = 0.4;
const US: f64 = 0.3;

fn totals(run: &Run, region: &str) -> Counts {
    region_total(&run.tally(), region)
}

/// Longest from the heal of a partition to the first admit from a lease.
const HEAL_BOUND_MS: i64 = 1000;

/// 1 and 2: `us` loses the allocator for three windows.
pub async fn partition(p: &Profile, bins: Bins, strict: bool) -> Result<ScenarioReport, String> {
    let name = if strict { "partition-strict" } else { "partition-bounded" };
    let mut run = Run::start(name, p, bins, None, strict).await?;
    run.traffic(&[("eu", EU), ("us", US)]);
    run.pass(1.5).await;
    let before = totals(&run, "us");
    run.stack.region("us").alloc_link.set(Fault::Blackhole);
    run.note("us cut off from the allocator (blackhole) for 3 windows");
    run.pass(3.0).await;
    let during = totals(&run, "us").since(&before);
    run.stack.region("us").alloc_link.set(Fault::Pass);
    let healed_ms = chrono::Utc::now().timestamp_millis();
    run.pass(1.5).await;
    let after = totals(&run, "us").since(&before).since(&during);
    // Heal within a second (docs/guarantees.md, what each event costs): the
    // first admit from a fresh lease, and no 429 (demand is below G: the pool
    // always had tokens).
    let answers = run.answers("us", healed_ms);
    let first_lease = answers.iter().filter(|a| a.status == 200 && a.lease).map(|a| a.done_ms).min();
    let unavailable = answers.iter().filter(|a| a.status == 503 && a.sent_ms >= healed_ms).count();
    let denied = answers.iter().filter(|a| a.status == 429).count();
    run.figure("fallback_admitted_while_cut_off", during.fallback as f64);
    run.figure("unavailable_while_cut_off", during.unavailable as f64);
    if let Some(t) = first_lease {
        run.figure("heal_to_first_lease_admit_ms", (t - healed_ms) as f64);
    }
    match first_lease {
        Some(t) => run.check(
            t - healed_ms <= HEAL_BOUND_MS,
            format!(
                "us admitted from a fresh lease {} ms after the heal (limit {HEAL_BOUND_MS} ms); {unavailable} requests sent after the heal were answered 503",
                t - healed_ms
            ),
        ),
        None => run.check(false, "us admitted nothing from a lease after the heal".to_string()),
    }
    run.check(denied == 0, format!("us answered {denied} 429s after the heal while the pool had tokens"));
    if strict {
        run.check(
            during.denied == 0,
            format!("us answered {} 429s while cut off (must be 0)", during.denied),
        );
        run.check(
            during.fallback == 0,
            format!("us admitted {} from fallback in strict mode", during.fallback),
        );
        run.check(during.unavailable > 0, format!("us answered {} 503s while cut off", during.unavailable));
    } else {
        run.check(
            during.fallback > 0,
            format!("us admitted {} from fallback while cut off", during.fallback),
        );
    }
    run.check(after.lease > 0, format!("us admitted {} from leases after the heal", after.lease));
    run.finish().await
}

/// Issue 17 item 5: demand above G (eu 70 %, us 60 %), `us` cut off from
/// the allocator from 5 % to 40 % of one window, so it heals while the
/// window is open and its pool still has room. Its fallback admits,
/// reported at heal, are repaid from the pool: grants after the report
/// share only what is left, and the window admits at most G although
/// demand stays above it (without the repayment it could admit G plus
/// the fallback). Every window: admitted ≤ G + fallback − repaid.
pub async fn partition_heal_repaid(p: &Profile, bins: Bins) -> Result<ScenarioReport, String> {
    let mut run = Run::start("partition-heal-repaid", p, bins, None, false).await?;
    run.traffic(&[("eu", 0.7), ("us", 0.6)]);
    run.pass(1.0).await;
    run.at_phase(0.05).await;
    let cut_at = chrono::Utc::now().timestamp();
    run.stack.region("us").alloc_link.set(Fault::Blackhole);
    run.note("us cut off from the allocator (blackhole) from 5 % to 40 % of a window; demand 130 % of G");
    run.pass(0.35).await;
    run.stack.region("us").alloc_link.set(Fault::Pass);
    let heal_at = chrono::Utc::now().timestamp();
    run.pass(1.6).await;
    let heal_window = run.window_key(heal_at);
    let same_window = run.window_key(cut_at) == heal_window;
    run.finish_with(move |rows, _| {
        let mut checks =
            vec![(same_window, format!("the partition began and healed in window {heal_window}"))];
        for r in rows {
            let ceiling = r.limit + r.fallback as i64 - r.fallback_repaid;
            checks.push((
                r.admitted as i64 <= ceiling,
                format!(
                    "window {}: admitted {} ≤ G {} + fallback {} − repaid {}",
                    r.window_start, r.admitted, r.limit, r.fallback, r.fallback_repaid
                ),
            ));
        }
        match rows.iter().find(|r| r.window_start == heal_window) {
            Some(r) => {
                checks.push((
                    r.fallback > 0 && r.fallback_repaid == r.fallback as i64,
                    format!(
                        "window {}: us's {} fallback admits were repaid from the pool ({} repaid)",
                        r.window_start, r.fallback, r.fallback_repaid
                    ),
                ));
                checks.push((
                    r.admitted as i64 <= r.limit,
                    format!(
                        "window {}: admitted {} ≤ G {} with demand above G (without the repayment up to {})",
                        r.window_start,
                        r.admitted,
                        r.limit,
                        r.limit + r.fallback as i64
                    ),
                ));
            }
            None => checks.push((false, format!("no row for the heal window {heal_window}"))),
        }
        checks
    })
    .await
}

/// 3: grant replies swallowed for 6 s; the agents resend the same
/// requests, so the allocator replays instead of debiting again.
pub async fn lost_replies(p: &Profile, bins: Bins) -> Result<ScenarioReport, String> {
    let mut run = Run::start("lost-grant-replies", p, bins, None, false).await?;
    run.traffic(&[("eu", EU), ("us", US)]);
    run.pass(1.0).await;
    run.stack.region("eu").alloc_link.set(Fault::DropReplies);
    run.note("eu: every allocator reply dropped for 6 s (requests still delivered)");
    // Shorter than the agents' resend horizon, so the first lost grant is
    // still resent unchanged once replies flow again.
    tokio::time::sleep(Duration::from_secs(6)).await;
    run.stack.region("eu").alloc_link.set(Fault::Pass);
    run.pass(1.5).await;
    let replays = run.ledger_count("replayed").await?;
    run.check(replays > 0, format!("the ledger shows {replays} replayed grants"));
    run.finish().await
}

/// 4: one of two allocator replicas is SIGKILLed and restarted.
pub async fn allocator_kill(p: &Profile, bins: Bins) -> Result<ScenarioReport, String> {
    let spec = StackSpec {
        regions: vec![("eu".into(), 2), ("us".into(), 1)],
        allocators: 2,
        agent_env: Vec::new(),
        sentinel_regions: Vec::new(),
        patroni: None,
    };
    let mut run = Run::start("allocator-kill", p, bins, Some(spec), false).await?;
    run.traffic(&[("eu", EU), ("us", US)]);
    run.pass(1.5).await;
    run.stack.allocators[0].kill(libc::SIGKILL);
    run.note("allocator replica 1 SIGKILLed; replica 2 serves alone for a window");
    run.pass(1.0).await;
    run.stack.allocators[0].restart().await?;
    run.note("allocator replica 1 restarted");
    run.pass(1.5).await;
    let orphans = sqlx::query_file_scalar!("src/sql/leases_without_event.sql", TENANT, RESOURCE)
        .fetch_one(&run.db)
        .await
        .map_err(|e| format!("query: {e}"))?;
    run.check(orphans == 0, format!("{orphans} leases without their ledger event"));
    let c = Counts { ..totals(&run, "eu") };
    let u = totals(&run, "us");
    run.check(
        c.unavailable + u.unavailable == 0,
        format!("agents answered {} 503s (they must keep serving)", c.unavailable + u.unavailable),
    );
    run.finish().await
}

/// 5: agent `eu-1` is SIGKILLed and restarted: a new epoch, and requests of
/// the old one are refused.
pub async fn agent_restart(p: &Profile, bins: Bins) -> Result<ScenarioReport, String> {
    let mut run = Run::start("agent-restart", p, bins, None, false).await?;
    run.traffic(&[("eu", EU), ("us", US)]);
    run.pass(1.5).await;
    let old = run.stack.region("eu").agents[0].epoch().await;
    run.stack.region_mut("eu").agents[0].stop(libc::SIGKILL);
    run.note(format!("eu-1 SIGKILLed at epoch {old}"));
    run.pass(0.5).await;
    let new = run.stack.region_mut("eu").agents[0].start().await;
    run.check(new > old, format!("eu-1 restarted with epoch {new} > {old}"));
    let grant = json!({"tenant": TENANT, "resource": RESOURCE, "region": "eu", "agent": "eu-1", "epoch": old,
                       "seq": 1_000_000, "want": 10, "demand_per_sec": 1.0});
    let r = run.stack.admin.post("/v1/grants", &grant).await;
    run.check(
        r.status == 409 && r.error() == "stale_epoch",
        format!("a grant of the old epoch answered {} {}", r.status, r.error()),
    );
    let ws = chrono::Utc::now().timestamp().div_euclid(p.window_secs) * p.window_secs;
    let report = json!({"region": "eu", "agent": "eu-1", "epoch": old,
        "report_id": format!("chaos-stale-{}", uuid::Uuid::new_v4().simple()),
        "items": [{"tenant": TENANT, "resource": RESOURCE,
                   "window_start": chrono::DateTime::from_timestamp(ws, 0).unwrap_or_default(),
                   "consumed": 5, "fallback_admitted": 0}]});
    let r = run.stack.admin.post("/v1/reports", &report).await;
    run.check(
        r.status == 409 && r.error() == "stale_epoch",
        format!("a report of the old epoch answered {} {}", r.status, r.error()),
    );
    run.pass(1.5).await;
    run.finish().await
}

/// 6: `eu`'s Redis restarts empty mid-window.
pub async fn redis_restart(p: &Profile, bins: Bins) -> Result<ScenarioReport, String> {
    if std::env::var_os("REDIS_URL").is_some() {
        return Err("needs a local redis-server to restart (REDIS_URL is set)".into());
    }
    let mut run = Run::start("redis-restart-empty", p, bins, None, false).await?;
    run.traffic(&[("eu", EU), ("us", US)]);
    run.pass(1.5).await;
    let at = chrono::Utc::now().timestamp();
    run.stack.region_mut("eu").redis.restart_empty();
    run.note("eu's Redis restarted empty (balances, counters and outbox lost)");
    // What Redis held and the outbox had not yet sent is gone with it: at
    // most the admits of two outbox intervals (200 ms each) of eu's rate.
    let allowed = (p.rate(EU) * 0.4).ceil() as i64;
    run.allow_loss_between(at - 1, at + 1, allowed);
    run.note(format!(
        "the allocator may count up to {allowed} admits fewer around the loss (see docs/limits.md)"
    ));
    let before = totals(&run, "eu");
    run.pass(2.0).await;
    let after = totals(&run, "eu").since(&before);
    run.check(after.admitted() > 0, format!("eu admitted {} after the restart", after.admitted()));
    run.finish().await
}

/// 7: PostgreSQL is killed and restarted.
pub async fn postgres_restart(p: &Profile, bins: Bins) -> Result<ScenarioReport, String> {
    if std::env::var_os("DATABASE_URL").is_some() {
        return Err("needs a local PostgreSQL to restart (DATABASE_URL is set)".into());
    }
    let mut run = Run::start("postgres-restart", p, bins, None, false).await?;
    run.traffic(&[("eu", EU), ("us", US)]);
    run.pass(1.5).await;
    let before = totals(&run, "eu");
    run.stack.local_db()?.restart().await;
    let at = chrono::Utc::now();
    run.note("PostgreSQL SIGKILLed and restarted");
    run.pass(2.0).await;
    let after = totals(&run, "eu").since(&before);
    run.check(after.admitted() > 0, format!("eu admitted {} during and after the restart", after.admitted()));
    let resumed = sqlx::query_file_scalar!("src/sql/leases_issued_after.sql", TENANT, RESOURCE, at)
        .fetch_one(&run.db)
        .await
        .map_err(|e| format!("query: {e}"))?;
    run.check(resumed > 0, format!("{resumed} leases granted after the restart"));
    run.finish().await
}

/// 8: `eu-1` runs 30 s ahead, `us-1` 30 s behind.
pub async fn clock_skew(p: &Profile, bins: Bins) -> Result<ScenarioReport, String> {
    let mut run = Run::start("clock-skew", p, bins, None, false).await?;
    for (region, ms) in [("eu", "30000"), ("us", "-30000")] {
        let a = &mut run.stack.region_mut(region).agents[0];
        a.stop(libc::SIGTERM);
        a.opts.env.push(("AGENT_TEST_CLOCK_OFFSET_MS".into(), ms.into()));
        a.start().await;
    }
    run.note("eu-1 wall clock +30 s, us-1 wall clock -30 s (eu-2 unskewed)");
    run.traffic(&[("eu", EU), ("us", US)]);
    run.pass(4.0).await;
    let (eu, us) = (totals(&run, "eu"), totals(&run, "us"));
    run.check(
        eu.admitted() > 0 && us.admitted() > 0,
        format!("eu admitted {}, us {}", eu.admitted(), us.admitted()),
    );
    run.finish().await
}

/// 10: `eu-1`'s incarnation is replaced (a registration of its own id)
/// while it is paused; when it resumes, its old epoch is refused.
pub async fn zombie(p: &Profile, bins: Bins) -> Result<ScenarioReport, String> {
    let mut run = Run::start("zombie", p, bins, None, false).await?;
    run.traffic(&[("eu", EU), ("us", US)]);
    run.pass(1.5).await;
    let old = run.stack.region("eu").agents[0].epoch().await;
    run.stack.region("eu").agents[0].signal(libc::SIGSTOP);
    let r = run.stack.admin.post("/v1/agents/register", &json!({"region": "eu", "agent": "eu-1"})).await;
    let fenced_at = chrono::Utc::now();
    run.stack.region("eu").agents[0].signal(libc::SIGCONT);
    let taken = r.body["epoch"].as_i64().unwrap_or(0);
    run.check(r.status == 200 && taken > old, format!("eu-1 re-registered elsewhere: epoch {taken} > {old}"));
    run.pass(1.5).await;
    let refused = run.ledger_count("refused/stale_epoch").await?;
    run.check(refused > 0, format!("{refused} requests of the old incarnation refused as stale_epoch"));
    let credited =
        sqlx::query_file_scalar!("src/sql/leases_of_epoch_after.sql", "eu", "eu-1", old, fenced_at)
            .fetch_one(&run.db)
            .await
            .map_err(|e| format!("query: {e}"))?;
    run.check(credited == 0, format!("{credited} leases granted to epoch <= {old} after the fence"));
    let now = run.stack.region("eu").agents[0].epoch().await;
    run.check(now > taken, format!("the resumed agent registered anew: epoch {now} > {taken}"));
    run.finish().await
}

/// A process fault of its own: `eu-1` SIGSTOPped for longer than its
/// leases live, then SIGCONTed; it must not admit on what expired.
pub async fn paused_agent(p: &Profile, bins: Bins) -> Result<ScenarioReport, String> {
    let mut run = Run::start("paused-agent", p, bins, None, false).await?;
    run.traffic(&[("eu", EU), ("us", US)]);
    run.pass(1.5).await;
    run.stack.region("eu").agents[0].signal(libc::SIGSTOP);
    run.note("eu-1 SIGSTOPped for 1.5 windows");
    run.pass(1.5).await;
    run.stack.region("eu").agents[0].signal(libc::SIGCONT);
    run.note("eu-1 SIGCONTed");
    run.pass(1.5).await;
    run.finish().await
}

/// A region cut off at the kernel level: needs root and `ip netns`.
pub async fn netns_partition(p: &Profile, bins: Bins) -> Result<ScenarioReport, String> {
    super::netns::partition(p, bins).await
}
