//! `cargo lab chaos`: scenarios that run the real binaries with faults
//! injected between them, drive traffic from clients and check DESIGN §3
//! with numbers.
//!
//! Every scenario starts its own [`Stack`], puts a policy, drives traffic,
//! injects its faults, heals, waits until the agents' outboxes have drained
//! and then checks, per window, from the clients' ground truth:
//!
//! * admitted ≤ the bound the policy documents (I6): `G + Σ fallback`
//!   (`G` in strict mode);
//! * no request sent after a window ended was admitted into it (I2);
//! * the allocator's accounting equals the clients' count (I7), up to
//!   requests whose answer was lost (each may or may not have been admitted);
//!
//! plus the checks of its own (I1, I3, I4, ledger events, epochs).

pub mod catalog;
mod concurrency;
mod faults;
mod harness;
mod namespace;
mod netns;
mod outcomes;
mod postgres;
mod principals;
mod redis;
mod retries;
mod rollout;
mod telemetry;

use crate::bins;
use crate::report::{self, ScenarioReport, Verdict};
pub use catalog::{PATRONI_SCENARIOS, SCENARIOS};
use clap::Args;
pub use harness::{Profile, Run};

/// Flags of `quota-lab chaos`.
#[derive(Debug, Args)]
pub struct ChaosArgs {
    /// `short` (4 s windows, every scenario in a few minutes) or `long`
    /// (30 s windows, for soak runs).
    #[arg(long, default_value = "short", value_parser = ["short", "long"])]
    pub profile: String,
    /// Runs only this scenario (see `--list`).
    #[arg(long, value_parser = clap::builder::PossibleValuesParser::new(SCENARIOS.iter().map(|(n, _)| *n)))]
    pub scenario: Option<String>,
    /// Lists the scenarios and exits.
    #[arg(long)]
    pub list: bool,
    /// Directory for `report.json` and `report.md` (default `target/chaos`).
    #[arg(long)]
    pub out: Option<std::path::PathBuf>,
    /// Leaves docs/ alone. Without it, a whole short run (every scenario,
    /// no --out) publishes: it copies report.json to docs/reports/chaos.json
    /// and regenerates the chaos table of the README and of any docs page
    /// with the `figures:chaos` markers (in a clean clone, such as CI's,
    /// that only changes the working tree; a docs tree that cannot be
    /// written is reported, never a failure).
    #[arg(long)]
    pub no_publish: bool,
}

/// Runs the scenario `name` (one of [`SCENARIOS`]) once.
pub async fn run_one(name: &str, p: &Profile, bins: &bins::Bins) -> Result<ScenarioReport, String> {
    let b = bins.clone();
    match name {
        "partition-bounded" => faults::partition(p, b, false).await,
        "partition-strict" => faults::partition(p, b, true).await,
        "partition-heal-repaid" => faults::partition_heal_repaid(p, b).await,
        "lost-grant-replies" => faults::lost_replies(p, b).await,
        "allocator-kill" => faults::allocator_kill(p, b).await,
        "agent-restart" => faults::agent_restart(p, b).await,
        "redis-restart-empty" => faults::redis_restart(p, b).await,
        "redis-rollback" => redis::redis_rollback(p, b).await,
        "redis-failover" => redis::redis_failover(p, b).await,
        "redis-eviction" => redis::redis_eviction(p, b).await,
        "postgres-restart" => faults::postgres_restart(p, b).await,
        "postgres-failover" => postgres::failover(p, b, true).await,
        "postgres-failover-async" => postgres::failover(p, b, false).await,
        "postgres-switchover" => postgres::switchover(p, b).await,
        "etcd-loss" => postgres::etcd_loss(p, b).await,
        "clock-skew" => faults::clock_skew(p, b).await,
        "demand-skew" => outcomes::demand_skew(p, b).await,
        "zombie" => faults::zombie(p, b).await,
        "paused-agent" => faults::paused_agent(p, b).await,
        "export-concurrency" => concurrency::export_concurrency(p, b).await,
        "policy-rollout" => rollout::policy_rollout(p, b).await,
        "retry-wave" => retries::retry_wave(p, b).await,
        "bogus-principals" => principals::bogus_principals(p, b).await,
        "key-namespace-shadow" => namespace::key_namespace_shadow(p, b).await,
        "corrupted-telemetry" => telemetry::corrupted_telemetry(p, b).await,
        "retried-debit" => retries::retried_debit(p, b).await,
        "netns-partition" => faults::netns_partition(p, b).await,
        other => Err(format!("unknown scenario {other:?}; `quota-lab chaos --list` names them")),
    }
}

/// Runs the scenarios; `Ok(false)` when a verdict fails.
pub async fn run(args: ChaosArgs) -> Result<bool, String> {
    if args.list {
        for (name, what) in SCENARIOS {
            println!("{name:<22} {what}");
        }
        return Ok(true);
    }
    let names: Vec<&str> = match &args.scenario {
        Some(s) => {
            if !SCENARIOS.iter().any(|(n, _)| n == s) {
                return Err(format!("unknown scenario {s:?}; `quota-lab chaos --list` names them"));
            }
            vec![s.as_str()]
        }
        None => SCENARIOS.iter().map(|(n, _)| *n).collect(),
    };
    bins::check_servers()?;
    if names.iter().any(|n| PATRONI_SCENARIOS.contains(n)) {
        crate::install::check_ha_packages()?;
    }
    let bins = bins::ensure()?;
    let profile = Profile::named(&args.profile);
    let mut reports = Vec::new();
    for (i, name) in names.iter().enumerate() {
        eprintln!("chaos: [{}/{}] {name} ({} profile)", i + 1, names.len(), profile.name);
        let rep = match run_one(name, &profile, &bins).await {
            Ok(r) => r,
            Err(e) => ScenarioReport {
                scenario: name.to_string(),
                verdict: Verdict::Fail,
                windows: Vec::new(),
                notes: vec![format!("the scenario could not run: {e}")],
                seconds: 0.0,
                figures: Default::default(),
            },
        };
        println!("{}", report::text_table(&rep));
        reports.push(rep);
    }
    let out = args.out.clone().unwrap_or_else(|| report::target_dir().join("chaos"));
    let command = format!(
        "cargo lab chaos --profile {}{}",
        profile.name,
        args.scenario.as_deref().map(|s| format!(" --scenario {s}")).unwrap_or_default()
    );
    // A skipped scenario has no verdict; it is named in report.md only.
    let judged: Vec<&ScenarioReport> = reports.iter().filter(|r| r.verdict != Verdict::Skipped).collect();
    report::write_json(&out.join("report.json"), &judged)?;
    std::fs::write(out.join("report.md"), report::markdown(&reports, &command))
        .map_err(|e| format!("{}: {e}", out.display()))?;
    if args.scenario.is_some() || args.out.is_some() || profile.name != "short" {
        eprintln!("chaos: not published: only a whole short run into the default directory updates docs/");
    } else if args.no_publish {
        eprintln!("chaos: not published (--no-publish)");
    } else {
        let judged: Vec<ScenarioReport> = judged.into_iter().cloned().collect();
        crate::figures::publish_chaos(&out.join("report.json"), &judged);
    }
    let failed: Vec<&str> =
        reports.iter().filter(|r| r.verdict != Verdict::Pass).map(|r| r.scenario.as_str()).collect();
    let skipped = reports.iter().filter(|r| r.verdict == Verdict::Skipped).count();
    println!(
        "chaos: {} scenario(s), {} passed, {} failed{}; report: {}",
        reports.len(),
        reports.len() - failed.len(),
        failed.len() - skipped,
        if skipped > 0 { format!(", {skipped} skipped") } else { String::new() },
        out.join("report.json").display()
    );
    Ok(failed.len() == skipped)
}
