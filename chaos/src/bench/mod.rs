//! `cargo lab bench`: what one run measures on this machine, each figure
//! next to a reference measured in the same run (numbers on a shared
//! 2-core box drift by tens of percent between runs; a ratio to a ceiling
//! taken minutes apart does not), as medians of several repetitions.
//!
//! * [`acquire`]: agent decisions at 1/16/64 clients vs the bare spend
//!   script, the HTTP floor and `limitador`; Redis memory of one quota.
//! * [`grants`]: allocator grants at 64 agents vs `pgbench`; allocator RSS
//!   and grant p99 by number of quotas.
//! * [`renewal`]: grant calls per 1,000 admits; ledger growth.
//! * [`utilization`]: skew and contention at 20 quotas × 3 regions.
//! * [`tls`]: decisions with Redis over TLS beside plain Redis, grants
//!   over HTTPS (mTLS) beside HTTP, at 16 clients.
//! * [`hist`]: the closed-loop driver and HDR histograms; [`machine`]: what
//!   the machine is; [`rig`]: the proxy-free stack of the first three;
//!   [`table`]: the Markdown report; [`summary`]: the README's table;
//!   [`report`]: `report.json` as one type, written and read back.
//!
//! Output: a Markdown table on stdout and in `<target>/bench/report.md`,
//! and `<target>/bench/report.json` with flat dotted keys under `results`.
//! A whole quick or full run also publishes that report to the docs
//! ([`crate::figures`]) unless `--no-publish`.

pub mod acquire;
pub mod envoy;
pub mod flood;
pub mod grants;
pub mod h2_client;
pub mod hist;
pub mod machine;
pub mod peer;
pub mod renewal;
pub mod report;
pub mod rig;
pub mod summary;
pub mod table;
pub mod tls;
pub mod utilization;
pub mod view;

use clap::Args;
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// Flags of `quota-lab bench`.
#[derive(Debug, Clone, Default, Args)]
pub struct BenchArgs {
    /// A run of about two minutes.
    #[arg(long)]
    pub quick: bool,
    /// A run of a few seconds that only checks the harness works (CI).
    #[arg(long)]
    pub smoke: bool,
    /// Directory for report.md and report.json (default `<target>/bench`).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Measure only these parts (repeatable; default all). Targets of the
    /// parts left out show as "not measured".
    #[arg(long, value_enum)]
    pub only: Vec<Part>,
    /// Skips the limitador peer instead of building it: its first build
    /// compiles RocksDB (about 20 minutes on 2 cores, needs libclang-dev).
    /// Its columns and target then say "not measured", and the report's
    /// notes say why.
    #[arg(long)]
    pub no_peer: bool,
    /// Leaves docs/ alone. Without it, a whole `--quick` or full run (every
    /// part, no --out) publishes: it copies report.json to
    /// docs/reports/bench.json and regenerates docs/benchmarks.md and the
    /// README's performance block from it (in a clean clone that only
    /// changes the working tree).
    #[arg(long)]
    pub no_publish: bool,
}

/// The parts of one run, in the order they run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Part {
    Acquire,
    Renewal,
    Grants,
    Tls,
    Utilization,
    Envoy,
}

impl BenchArgs {
    fn runs(&self, p: Part) -> bool {
        self.only.is_empty() || self.only.contains(&p)
    }
}

/// How long and how big each measurement is in one mode.
#[derive(Debug, Clone)]
pub struct Plan {
    pub mode: &'static str,
    /// The parts `--only` selected (empty: all).
    pub only: Vec<Part>,
    /// `--no-peer`: the limitador peer is not built or measured.
    pub no_peer: bool,
    /// Repetitions of every throughput measurement (medians are reported).
    pub reps: usize,
    pub acquire: Duration,
    pub grants: Duration,
    pub pgbench: Duration,
    /// Quotas of the "10,000 quotas" grant cases.
    pub many_quotas: usize,
    /// Quota counts of the scaling figures.
    pub scaling_quotas: Vec<usize>,
    pub steady: Duration,
    pub steady_rate: f64,
    pub util_quotas: usize,
    /// G of DESIGN §4's scenarios (1,000) outside smoke runs. The window is
    /// 10 s so that 20 quotas under contention (2.5 G offered per window,
    /// 5,000 requests/s) stay within what two cores can drive and serve.
    pub util_limit: i64,
    pub util_window_secs: i64,
    /// Windows measured per scenario (after one warm-up window).
    pub util_windows: usize,
    /// Wait after traffic stops for outbox reports and releases to land.
    pub settle: Duration,
}

impl Plan {
    /// The plan of the mode `args` selects.
    pub fn of(args: &BenchArgs) -> Plan {
        let mode = if args.smoke {
            "smoke"
        } else if args.quick {
            "quick"
        } else {
            "full"
        };
        Plan { only: args.only.clone(), no_peer: args.no_peer, ..Plan::named(mode) }
    }

    /// The plan of a mode by its name (`smoke`, `quick`; anything else is
    /// the full run), with every part and the peer.
    pub fn named(mode: &str) -> Plan {
        if mode == "smoke" {
            Plan {
                mode: "smoke",
                only: Vec::new(),
                no_peer: false,
                reps: 1,
                acquire: Duration::from_millis(300),
                grants: Duration::from_millis(500),
                pgbench: Duration::from_secs(1),
                many_quotas: 1_000,
                scaling_quotas: vec![100, 1_000],
                steady: Duration::from_secs(3),
                steady_rate: 50.0,
                util_quotas: 2,
                util_limit: 100,
                util_window_secs: 2,
                util_windows: 1,
                settle: Duration::from_secs(1),
            }
        } else if mode == "quick" {
            Plan {
                mode: "quick",
                only: Vec::new(),
                no_peer: false,
                reps: 3,
                acquire: Duration::from_secs(1),
                grants: Duration::from_secs(2),
                pgbench: Duration::from_secs(2),
                many_quotas: 10_000,
                scaling_quotas: vec![100, 100_000],
                steady: Duration::from_secs(12),
                steady_rate: 200.0,
                util_quotas: 20,
                util_limit: 1_000,
                util_window_secs: 10,
                util_windows: 3,
                settle: Duration::from_secs(3),
            }
        } else {
            Plan {
                mode: "full",
                only: Vec::new(),
                no_peer: false,
                reps: 5,
                acquire: Duration::from_secs(3),
                grants: Duration::from_secs(4),
                pgbench: Duration::from_secs(4),
                many_quotas: 10_000,
                scaling_quotas: vec![100, 100_000],
                steady: Duration::from_secs(40),
                steady_rate: 200.0,
                util_quotas: 20,
                util_limit: 1_000,
                util_window_secs: 10,
                util_windows: 6,
                settle: Duration::from_secs(3),
            }
        }
    }

    /// The command a reader runs to get this plan again.
    pub fn command(&self) -> String {
        let mut c = match self.mode {
            "full" => "cargo lab bench".to_string(),
            m => format!("cargo lab bench --{m}"),
        };
        for p in &self.only {
            if let Some(v) = clap::ValueEnum::to_possible_value(p) {
                c.push_str(&format!(" --only {}", v.get_name()));
            }
        }
        if self.no_peer {
            c.push_str(" --no-peer");
        }
        c
    }

    /// Why this run does not measure the limitador peer, if it does not.
    pub fn peer_skipped(&self) -> Option<String> {
        if self.mode == "smoke" {
            Some("a smoke run does not build the peer (RocksDB); --quick and full runs measure it".into())
        } else if self.no_peer {
            Some(
                "--no-peer: the peer (its first build compiles RocksDB, about 20 minutes) was not built"
                    .into(),
            )
        } else {
            None
        }
    }

    /// Whether this run's report is the one the docs show: every part of a
    /// quick or full run.
    pub fn whole(&self) -> bool {
        self.mode != "smoke" && self.only.is_empty()
    }
}

/// Flat dotted results and the notes a reader needs to trust them.
#[derive(Debug, Default, Serialize)]
pub struct Results {
    pub values: BTreeMap<String, f64>,
    pub notes: Vec<String>,
}

impl Results {
    /// Sets `key` (non-finite values are kept out: JSON has no NaN).
    pub fn set(&mut self, key: &str, v: f64) {
        if v.is_finite() {
            self.values.insert(key.to_string(), v);
        } else {
            self.notes.push(format!("{key}: not measurable ({v})"));
        }
    }

    /// The value of `key`, if measured.
    pub fn get(&self, key: &str) -> Option<f64> {
        self.values.get(key).copied()
    }

    /// Adds a note to the report.
    pub fn note(&mut self, n: String) {
        self.notes.push(n);
    }
}

fn progress(started: Instant) -> impl Fn(&str) {
    move |s: &str| eprintln!("bench [{:>5.1} s] {s}", started.elapsed().as_secs_f64())
}

/// Runs the benchmarks and writes the report. A missed target is a
/// finding, not a failure: this is `Ok(true)` whenever every measurement
/// ran, and `Err` only when the harness broke.
pub async fn run(args: BenchArgs) -> Result<bool, String> {
    let plan = Plan::of(&args);
    let started = Instant::now();
    let say = progress(started);
    let machine = machine::describe();
    say(&format!(
        "{} run on {} × {} ({} MiB, load {})",
        plan.mode, machine.nproc, machine.cpu_model, machine.mem_total_mb, machine.load_avg_at_start
    ));
    crate::bins::check_servers()?;
    let bins = crate::bins::ensure()?;
    let mut out = Results::default();

    let on_rig = [Part::Acquire, Part::Renewal, Part::Grants, Part::Tls, Part::Envoy];
    if on_rig.iter().any(|&p| args.runs(p)) {
        say("starting PostgreSQL and 2 allocator replicas (direct links)");
        let rig = rig::Rig::start(bins.clone(), 2).await?;
        if args.runs(Part::Acquire) {
            acquire::run(&rig, &plan, &mut out, &say).await?;
        }
        if args.runs(Part::Renewal) {
            renewal::run(&rig, &plan, &mut out, &say).await?;
        }
        if args.runs(Part::Grants) {
            grants::run(&rig, &plan, &mut out, &say).await?;
        }
        if args.runs(Part::Tls) {
            tls::run(&rig, &plan, &mut out, &say).await?;
        }
        if args.runs(Part::Envoy) {
            envoy::run(&rig, &plan, &mut out, &say).await?;
        }
    }
    if args.runs(Part::Utilization) {
        utilization::run(bins, &plan, &mut out, &say).await?;
    }

    let targets = table::targets(&out);
    let report = report::BenchReport {
        command: plan.command(),
        argv: std::env::args().collect(),
        mode: plan.mode.to_string(),
        repetitions: plan.reps,
        machine,
        seconds: started.elapsed().as_secs_f64(),
        results: out.values,
        targets,
        notes: out.notes,
    };
    let md = table::markdown(&report);
    println!("{md}");
    let dir = args.out.clone().unwrap_or_else(|| crate::report::target_dir().join("bench"));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    std::fs::write(dir.join("report.md"), &md)
        .map_err(|e| format!("{}: {e}", dir.join("report.md").display()))?;
    crate::report::write_json(&dir.join("report.json"), &report)?;
    say(&format!("wrote {}/report.md and report.json", dir.display()));
    if !plan.whole() || args.out.is_some() {
        say("not published: only a whole --quick or full run into the default directory updates docs/");
    } else if args.no_publish {
        say("not published (--no-publish)");
    } else {
        crate::figures::publish_bench(&dir.join("report.json"), &report, &say);
    }
    Ok(true)
}
