//! `cargo lab demo`: the whole system on this machine in one command.
//!
//! PostgreSQL, one allocator, region `eu` (two agent replicas sharing one
//! Redis) and region `us` (one agent, its own Redis); policy `atlas/read`
//! = 1,000 per 10 s with a fallback of 100 per region; skewed traffic
//! (eu 90/s, us 30/s: demand above G, so the pool is shared by demand).
//! Part way through, `us` loses the allocator (a blackhole) and heals, so
//! its fallback admits and the bound `G + Σ fallback` show in the summary.
//!
//! Before anything starts, a missing PostgreSQL or redis-server is
//! installed with apt-get where the lab may (see [`crate::install`]).
//!
//! With `--tls` every agent link runs over TLS with a CA made for this run
//! ([`crate::tls`]): agents call the allocator over HTTPS with client
//! certificates naming their region (mTLS), and reach their Redis over
//! `rediss://` with client certificates too; the output says so and shows
//! each agent's view of both links.

use crate::accounts;
use crate::bins;
use crate::chart;
use crate::install;
use crate::report::{self, WindowRow};
use crate::stack::{Stack, StackSpec};
use crate::traffic::{self, RegionLoad, Traffic};
use clap::Args;
use quota_tests::proxy::Fault;
use std::fmt::Write as _;
use std::time::Duration;

/// Flags of `quota-lab demo`.
#[derive(Debug, Args)]
pub struct DemoArgs {
    /// How long traffic runs, in seconds (the summary follows).
    #[arg(long, default_value_t = 90, value_parser = clap::value_parser!(u64).range(10..=3600))]
    pub duration: u64,
    /// Where the SVG chart is written (default `target/demo/windows.svg`).
    #[arg(long)]
    pub chart: Option<std::path::PathBuf>,
    /// When PostgreSQL or redis-server is missing, install it with apt-get
    /// without asking (as root or with passwordless sudo).
    #[arg(long)]
    pub yes: bool,

    /// Run every agent link over TLS with a throwaway CA: agent → allocator
    /// over HTTPS with client certificates (mTLS), agent → Redis over rediss://.
    #[arg(long)]
    pub tls: bool,
}

const TENANT: &str = "atlas";
const RESOURCE: &str = "read";
const WINDOW_SECS: i64 = 10;
const LIMIT: i64 = 1000;
const FALLBACK: i64 = 100;
const CUT_REGION: &str = "us";

/// Runs the demo; `Ok(false)` when a window broke its bound or the
/// allocator's count differs from the clients'.
pub async fn run(args: DemoArgs) -> Result<bool, String> {
    install::ensure_servers(args.yes)?;
    let bins = bins::ensure()?;
    let spec = StackSpec {
        regions: vec![("eu".into(), 2), ("us".into(), 1)],
        allocators: 1,
        agent_env: Vec::new(),
        sentinel_regions: Vec::new(),
    };
    let say = |m: &str| eprintln!("demo: {m}");
    let stack = if args.tls {
        say("generating a throwaway CA and certificates (rcgen)");
        let tls = crate::tls::LabTls::generate()?;
        Stack::start_tls(bins, &spec, tls, &say).await?
    } else {
        Stack::start(bins, &spec, &say).await?
    };
    if let Some(tls) = &stack.tls {
        println!("tls: every link over TLS with a throwaway CA (files in {})", tls.dir().display());
        println!("tls:   agent -> allocator: https with mutual TLS (client certificate per region, SAN region:<r>)");
        println!("tls:   agent -> Redis: rediss:// (Redis requires client certificates)");
        if let Err(e) = links_over_tls(&stack).await {
            stack.shutdown().await;
            return Err(e);
        }
    }
    let result = drive(&stack, &args).await;
    eprintln!("demo: stopping everything it started");
    stack.shutdown().await;
    result
}

async fn drive(stack: &Stack, args: &DemoArgs) -> Result<bool, String> {
    let policy = serde_json::json!({"limit": LIMIT, "window_secs": WINDOW_SECS, "fallback_per_region": FALLBACK,
                                    "fail_mode": "bounded"});
    crate::pools::put_policy(&stack.admin, TENANT, RESOURCE, &policy).await?;
    println!(
        "policy {TENANT}/{RESOURCE}: {LIMIT} per {WINDOW_SECS} s, fallback {FALLBACK} per region, bounded"
    );
    if stack.tls.is_some() {
        // The allocator requires a client certificate of the run's CA, so
        // a browser cannot open the dashboard without one.
        println!("allocator: {}  (mTLS: clients need a certificate of the throwaway CA)", stack.admin.base);
    } else {
        println!("allocator: {}  (dashboard: {}/ui)", stack.admin.base, stack.admin.base);
    }
    println!("live: per region, this window's admitted (ok), of them fallback (fb), 429s, 503s, lease tokens left, mode");
    for (region, urls) in stack.agent_urls() {
        println!("region {region}: agents {}", urls.join(", "));
    }
    let loads: Vec<RegionLoad> = stack
        .agent_urls()
        .into_iter()
        .map(|(region, agents)| {
            let rate_per_sec = if region == "eu" { 90.0 } else { 30.0 };
            RegionLoad { region, agents, rate_per_sec }
        })
        .collect();
    let traffic = Traffic::start(TENANT, RESOURCE, &loads);
    let cut_at = args.duration * 35 / 100;
    let heal_at = args.duration * 65 / 100;
    let started = tokio::time::Instant::now();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let mut interrupted = false;
    loop {
        tokio::select! {
            _ = tick.tick() => {},
            _ = tokio::signal::ctrl_c() => {
                println!("\ninterrupted: summarising what ran so far");
                interrupted = true;
                break;
            }
        }
        let t = started.elapsed().as_secs();
        if t >= args.duration {
            break;
        }
        let link = &stack.region(CUT_REGION).alloc_link;
        if t >= cut_at && t < heal_at && link.fault() == Fault::Pass {
            link.set(Fault::Blackhole);
            println!(">>> t={t}s: region {CUT_REGION} cut off from the allocator (blackhole)");
        } else if t >= heal_at && link.fault() != Fault::Pass {
            link.set(Fault::Pass);
            println!(">>> t={t}s: region {CUT_REGION} healed");
        }
        println!("{}", live_line(stack, &traffic, t).await);
    }
    stack.region(CUT_REGION).alloc_link.set(Fault::Pass);
    let tally = traffic.stop().await;
    if !interrupted {
        println!("traffic stopped; waiting for the last window to close and the outboxes to drain");
    }
    let settle =
        if interrupted { Duration::from_secs(3) } else { Duration::from_secs(WINDOW_SECS as u64 + 15) };
    let agrees = |acc: &_| report::ledger_agrees(&tally, acc, WINDOW_SECS);
    let acc = accounts::settled(&stack.admin, TENANT, RESOURCE, &tally, WINDOW_SECS, settle, agrees).await?;
    let rows = report::rows(&tally, &acc, WINDOW_SECS);
    let failed = report::check_windows(&rows, |r| r.bound, |_| 0);
    println!("\n{}", summary(&rows, &acc));
    let path = args.chart.clone().unwrap_or_else(|| report::target_dir().join("demo").join("windows.svg"));
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    }
    let path = path
        .parent()
        .and_then(|d| d.canonicalize().ok())
        .map(|d| d.join(path.file_name().unwrap_or_default()))
        .unwrap_or(path);
    let title = format!("{TENANT}/{RESOURCE}: admitted per {WINDOW_SECS} s window by region");
    std::fs::write(&path, chart::svg(&title, &rows)).map_err(|e| format!("{}: {e}", path.display()))?;
    println!("chart: {}", path.display());
    for f in &failed {
        println!("FAILED: {f}");
    }
    if failed.is_empty() {
        println!("every window held its bound, and the allocator's ledger equals what clients saw");
    }
    Ok(failed.is_empty())
}

/// Checks and shows that each agent reaches both its links over TLS: its
/// URLs are https:// and rediss://, and its status shows no link error.
async fn links_over_tls(stack: &Stack) -> Result<(), String> {
    for r in &stack.regions {
        for a in &r.agents {
            let s = a.http.get("/v1/status").await.body;
            let secure = a.opts.allocator.starts_with("https://") && a.opts.redis.starts_with("rediss://");
            if !secure || !s["allocator_error"].is_null() || !s["redis_error"].is_null() {
                return Err(format!(
                    "agent {} is not on TLS links: allocator {} ({}), Redis {} ({})",
                    a.opts.agent, a.opts.allocator, s["allocator_error"], a.opts.redis, s["redis_error"]
                ));
            }
            println!(
                "tls:   agent {}: allocator {} ok, Redis {} ok",
                a.opts.agent, a.opts.allocator, a.opts.redis
            );
        }
    }
    Ok(())
}

async fn live_line(stack: &Stack, traffic: &Traffic, t: u64) -> String {
    let now = chrono::Utc::now().timestamp();
    let ws = now.div_euclid(WINDOW_SECS) * WINDOW_SECS;
    let tally = traffic::by_window(&traffic.tally(), WINDOW_SECS);
    let mut line = format!("t={t:>3}s window {} |", fmt_hms(ws));
    for region in &stack.regions {
        let c = tally.get(&ws).and_then(|r| r.get(&region.name)).copied().unwrap_or_default();
        let (mut tokens, mut mode) = (0i64, String::from("?"));
        for a in &region.agents {
            let s = a.http.get("/v1/status").await.body;
            if let Some(q) = s["quotas"].as_array().and_then(|qs| qs.iter().find(|q| q["tenant"] == TENANT)) {
                tokens = tokens.max(q["lease_tokens"].as_i64().unwrap_or(0));
                mode = q["mode"].as_str().unwrap_or("?").to_string();
            }
        }
        let _ = write!(
            line,
            " {} ok {:>4} fb {:>3} 429 {:>4} 503 {:>4} lease {:>4} {:<9}|",
            region.name,
            c.admitted(),
            c.fallback,
            c.denied,
            c.unavailable,
            tokens,
            mode
        );
    }
    line
}

fn fmt_hms(ts: i64) -> String {
    chrono::DateTime::from_timestamp(ts, 0).map(|t| t.format("%H:%M:%S").to_string()).unwrap_or_default()
}

fn summary(rows: &[WindowRow], acc: &std::collections::BTreeMap<i64, accounts::WindowAccount>) -> String {
    let regions: Vec<String> = {
        let mut r: Vec<String> = rows.iter().flat_map(|w| w.regions.keys().cloned()).collect();
        r.sort();
        r.dedup();
        r
    };
    let mut s = String::new();
    let _ = write!(s, "{:<10} {:>6} {:>6}", "window", "limit", "bound");
    for r in &regions {
        let _ = write!(s, " {:>8}", format!("adm {r}"));
    }
    let _ =
        writeln!(s, " {:>8} {:>8} {:>8} {:>8} {:>10}", "fallback", "stranded", "ledger", "429", "bound held");
    for w in rows {
        let held = acc
            .values()
            .find(|a| a.window_start.to_rfc3339_opts(chrono::SecondsFormat::Secs, true) == w.window_start)
            .map(|a| a.bound_held && w.admitted as i64 <= a.bound);
        let _ = write!(s, "{:<10} {:>6} {:>6}", w.window_start.get(11..19).unwrap_or(""), w.limit, w.bound);
        for r in &regions {
            let _ = write!(s, " {:>8}", w.regions.get(r).copied().unwrap_or(0));
        }
        let _ = writeln!(
            s,
            " {:>8} {:>8} {:>8} {:>8} {:>10}",
            w.fallback,
            w.stranded,
            w.ledger_admitted,
            w.denied,
            match held {
                Some(true) => "yes",
                Some(false) => "NO",
                None => "-",
            }
        );
    }
    s
}
