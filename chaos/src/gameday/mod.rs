//! `cargo lab gameday`: seed 002's ten game days, each a drill with its
//! own numeric verdict, in one table.
//!
//! * [`drills`]: the ten drills, their sources and criteria (pure).
//! * [`report`]: `report.json` (a list of `{drill, name, incidents,
//!   verdict, figures}`) and `report.md`.
//!
//! A drill either runs a chaos scenario (the `short` profile with
//! `--quick`, `long` otherwise) and is judged on the scenario's verdict
//! and on its criteria over the scenario's figures, or runs the bench's
//! hot-tenant flood row on a rig of its own (drill 2, a latency
//! measurement: a release build).

pub mod drills;
pub mod report;

use crate::bench::Plan;
use crate::bins::{self, Bins};
use crate::report::{ScenarioReport, Verdict};
use crate::scenarios::{Profile, PATRONI_SCENARIOS};
use clap::Args;
use drills::{Drill, Source, DRILLS};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

/// Flags of `quota-lab gameday`.
#[derive(Debug, Args)]
pub struct GamedayArgs {
    /// Chaos drills in the `short` profile (4 s windows) and a quick flood
    /// measurement; without it, the `long` profile (30 s windows).
    #[arg(long)]
    pub quick: bool,
    /// Runs only drill N (1-10; repeatable; default all ten).
    #[arg(long, value_parser = clap::value_parser!(u8).range(1..=10))]
    pub only: Vec<u8>,
    /// Directory for report.json and report.md (default `target/gameday`).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Lists the drills and exits.
    #[arg(long)]
    pub list: bool,
    /// Leaves docs/ alone. Without it, a run of all ten drills into the
    /// default directory publishes: it copies report.json to
    /// docs/reports/gameday.json and regenerates the README's table of
    /// verdicts (the `figures:gameday` block).
    #[arg(long)]
    pub no_publish: bool,
}

/// One drill's result.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub drill: &'static Drill,
    pub figures: BTreeMap<String, f64>,
    /// Why it failed (the run itself, then each criterion); empty: passed.
    pub failed: Vec<String>,
    /// The run's notes.
    pub notes: Vec<String>,
    pub seconds: f64,
}

impl Outcome {
    pub fn pass(&self) -> bool {
        self.failed.is_empty()
    }
}

/// The drills `--only` selects, in order.
pub fn selected(only: &[u8]) -> Vec<&'static Drill> {
    DRILLS.iter().filter(|d| only.is_empty() || only.contains(&d.n)).collect()
}

/// Whether this run needs a release build: drill 2 measures latency.
pub fn needs_release(only: &[u8]) -> bool {
    selected(only).iter().any(|d| d.source == Source::Flood)
}

/// A drill's verdict: what its run already found wrong (`failed`), then
/// every criterion that does not hold on its figures.
fn judge(
    drill: &'static Drill,
    mut failed: Vec<String>,
    figures: BTreeMap<String, f64>,
    notes: Vec<String>,
    seconds: f64,
) -> Outcome {
    failed.extend(
        drills::failed_criteria(drill.criteria, &figures).iter().map(|f| format!("FAILED criterion: {f}")),
    );
    Outcome { drill, figures, failed, notes, seconds }
}

/// A scenario drill: the scenario must pass and every criterion hold.
fn judge_scenario(drill: &'static Drill, rep: ScenarioReport) -> Outcome {
    let failed = if rep.verdict == Verdict::Pass {
        Vec::new()
    } else {
        vec![format!("the scenario {} did not pass ({:?})", rep.scenario, rep.verdict)]
    };
    judge(drill, failed, rep.figures, rep.notes, rep.seconds)
}

async fn run_drill(drill: &'static Drill, quick: bool, bins: &Bins) -> Outcome {
    let started = Instant::now();
    let failed = |e: String| Outcome {
        drill,
        figures: BTreeMap::new(),
        failed: vec![format!("the drill could not run: {e}")],
        notes: Vec::new(),
        seconds: started.elapsed().as_secs_f64(),
    };
    match drill.source {
        Source::Scenario(name) => {
            let profile = Profile::named(if quick { "short" } else { "long" });
            match crate::scenarios::run_one(name, &profile, bins).await {
                Ok(rep) => judge_scenario(drill, rep),
                Err(e) => failed(e),
            }
        }
        Source::Flood => {
            let plan = Plan::named(if quick { "quick" } else { "full" });
            match crate::bench::flood::drill(bins.clone(), &plan, &|m| eprintln!("gameday:   {m}")).await {
                Ok(r) => judge(drill, Vec::new(), r.values, r.notes, started.elapsed().as_secs_f64()),
                Err(e) => failed(e),
            }
        }
    }
}

/// Runs the drills; `Ok(false)` when a verdict fails.
pub async fn run(args: GamedayArgs) -> Result<bool, String> {
    if args.list {
        for d in &DRILLS {
            let src = match d.source {
                Source::Scenario(s) => format!("chaos scenario {s}"),
                Source::Flood => "bench flood row".into(),
            };
            println!(
                "{:>2} {:<38} {:<13} {}{src}",
                d.n,
                d.name,
                d.incidents.join(","),
                if d.new { "new: " } else { "" }
            );
        }
        return Ok(true);
    }
    let chosen = selected(&args.only);
    bins::check_servers()?;
    if chosen.iter().any(|d| matches!(d.source, Source::Scenario(s) if PATRONI_SCENARIOS.contains(&s))) {
        crate::install::check_ha_packages()?;
    }
    let bins = bins::ensure()?;
    let started = Instant::now();
    let mut outcomes = Vec::new();
    for (i, d) in chosen.iter().enumerate() {
        eprintln!(
            "gameday: [{}/{}] drill {} {} ({})",
            i + 1,
            chosen.len(),
            d.n,
            d.name,
            d.incidents.join(", ")
        );
        let o = run_drill(d, args.quick, &bins).await;
        eprintln!(
            "gameday: drill {} {} in {:.0} s{}",
            d.n,
            if o.pass() { "passed" } else { "FAILED" },
            o.seconds,
            o.failed.iter().map(|n| format!("; {n}")).collect::<String>()
        );
        outcomes.push(o);
    }
    let out = args.out.clone().unwrap_or_else(|| crate::report::target_dir().join("gameday"));
    let mut command = String::from("cargo lab gameday");
    if args.quick {
        command.push_str(" --quick");
    }
    for n in &args.only {
        command.push_str(&format!(" --only {n}"));
    }
    let json = report::json(&outcomes, args.quick);
    crate::report::write_json(&out.join("report.json"), &json)?;
    std::fs::write(
        out.join("report.md"),
        report::markdown(&outcomes, &command, started.elapsed().as_secs_f64()),
    )
    .map_err(|e| format!("{}: {e}", out.display()))?;
    println!("{}", report::table(&outcomes));
    if !args.only.is_empty() || args.out.is_some() {
        eprintln!(
            "gameday: not published: only a run of all ten drills into the default directory updates docs/"
        );
    } else if args.no_publish {
        eprintln!("gameday: not published (--no-publish)");
    } else {
        crate::figures::publish_gameday(&out.join("report.json"), &json);
    }
    let failed = outcomes.iter().filter(|o| !o.pass()).count();
    println!(
        "gameday: {} drill(s), {} passed, {failed} failed in {:.0} s; report: {}",
        outcomes.len(),
        outcomes.len() - failed,
        started.elapsed().as_secs_f64(),
        out.join("report.json").display()
    );
    Ok(failed == 0)
}
