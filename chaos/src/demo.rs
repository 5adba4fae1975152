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
//!
//! With `--envoy` the traffic goes through the shipped Envoy example
//! instead ([`crate::envoy_front`]: one Envoy per agent, in front of a small
//! upstream; Envoy installed into a venv when missing): plain HTTP requests
//! with an `x-user-id` ([`crate::envoy_traffic`]), the quotas the example's
//! descriptors name, `atlas/catalog` (every request) and `atlas/search`
//! (searches, both or neither), each with per-user caps, and a table and
//! chart for each. The partition works as before; when `us` can no longer
//! decide, Envoy answers 500 (`failure_mode_deny: true`), counted as a 503.

use crate::accounts;
use crate::bins;
use crate::demo_table::{suffixed, summary, window_of, write_chart};
use crate::envoy_front::{self, Fronts};
use crate::envoy_traffic;
use crate::install;
use crate::report;
use crate::stack::{Stack, StackSpec};
use crate::traffic::{self, RegionLoad, Traffic};
use clap::Args;
use quota_tests::proxy::Fault;
use std::fmt::Write as _;
use std::path::Path;
use std::time::Duration;

/// Flags of `quota-lab demo`.
#[derive(Debug, Args)]
pub struct DemoArgs {
    /// How long traffic runs, in seconds (the summary follows).
    #[arg(long, default_value_t = 90, value_parser = clap::value_parser!(u64).range(10..=3600))]
    pub duration: u64,
    /// Where the SVG chart is written (default `target/demo/windows.svg`;
    /// with --envoy one per quota beside it: `windows-catalog.svg`,
    /// `windows-search.svg`).
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

    /// Send the traffic through Envoy (the shipped examples/envoy config,
    /// one Envoy per agent in front of a small upstream) as HTTP requests
    /// with an x-user-id; the quotas are the example's atlas/catalog and
    /// atlas/search. Installs Envoy (pip, into ~/.cache/quota-envoy) when
    /// missing.
    #[arg(long)]
    pub envoy: bool,
}

const TENANT: &str = "atlas";
const WINDOW_SECS: i64 = 10;
const CUT_REGION: &str = "us";

/// A quota the demo sets up and reports on.
struct Quota {
    resource: &'static str,
    /// What spends it, for the table's title.
    spent_by: &'static str,
    limit: i64,
    fallback: i64,
    /// Per-user cap (`rate_per_sec`, `burst`).
    per_key: Option<(f64, i64)>,
}

/// The demo's quota when clients call the agents.
const ACQUIRE_QUOTAS: [Quota; 1] =
    [Quota { resource: "read", spent_by: "every request", limit: 1000, fallback: 100, per_key: None }];

/// The quotas of the Envoy example's descriptors, with the demo's 10-s
/// windows; demand (eu 90/s, us 30/s, half of it searches) is above both
/// limits, so both pools are shared by demand. The heavy user
/// ([`envoy_traffic::HEAVY_SHARE`] of the requests) runs into the per-user
/// caps; the others stay under them.
const ENVOY_QUOTAS: [Quota; 2] = [
    Quota {
        resource: envoy_traffic::RESOURCES[0],
        spent_by: "every request",
        limit: 800,
        fallback: 100,
        per_key: Some((20.0, 40)),
    },
    Quota {
        resource: envoy_traffic::RESOURCES[1],
        spent_by: "searches, with catalog",
        limit: 400,
        fallback: 40,
        per_key: Some((8.0, 16)),
    },
];

impl Quota {
    fn policy(&self) -> serde_json::Value {
        let mut p = serde_json::json!({"limit": self.limit, "window_secs": WINDOW_SECS,
                                       "fallback_per_region": self.fallback, "fail_mode": "bounded"});
        if let Some((rate, burst)) = self.per_key {
            p["per_key"] = serde_json::json!({"rate_per_sec": rate, "burst": burst});
        }
        p
    }

    fn describe(&self) -> String {
        let cap = match self.per_key {
            Some((rate, burst)) => format!(", per user {rate}/s (burst {burst})"),
            None => String::new(),
        };
        format!(
            "policy {TENANT}/{}: {} per {WINDOW_SECS} s, fallback {} per region, bounded{cap}",
            self.resource, self.limit, self.fallback
        )
    }
}

/// Runs the demo; `Ok(false)` when a window broke its bound or the
/// allocator's count differs from the clients'.
pub async fn run(args: DemoArgs) -> Result<bool, String> {
    install::ensure_servers(args.yes)?;
    let say = |m: &str| eprintln!("demo: {m}");
    let envoy_bin = if args.envoy { Some(envoy_front::ensure(&say)?) } else { None };
    let bins = bins::ensure()?;
    let spec = StackSpec {
        regions: vec![("eu".into(), 2), ("us".into(), 1)],
        allocators: 1,
        agent_env: if args.envoy {
            envoy_front::agent_env(envoy_front::EXAMPLE_AGENT_ENV)
        } else {
            Vec::new()
        },
        sentinel_regions: Vec::new(),
        patroni: None,
    };
    let tls = if args.tls {
        say("generating a throwaway CA and certificates (rcgen)");
        Some(crate::tls::LabTls::generate()?)
    } else {
        None
    };
    let stack = Stack::start_with(bins, &spec, tls, args.envoy, &say).await?;
    if let Some(tls) = &stack.tls {
        println!("tls: every link over TLS with a throwaway CA (files in {})", tls.dir().display());
        println!("tls:   agent -> allocator: https with mutual TLS (client certificate per region, SAN region:<r>)");
        println!("tls:   agent -> Redis: rediss:// (Redis requires client certificates)");
        if let Err(e) = links_over_tls(&stack).await {
            stack.shutdown().await;
            return Err(e);
        }
    }
    let fronts = match &envoy_bin {
        Some(bin) => match Fronts::start(bin, &stack, &say).await {
            Ok(f) => Some(f),
            Err(e) => {
                stack.shutdown().await;
                return Err(e);
            }
        },
        None => None,
    };
    let result = drive(&stack, &args, fronts.as_ref()).await;
    eprintln!("demo: stopping everything it started");
    drop(fronts);
    stack.shutdown().await;
    result
}

async fn drive(stack: &Stack, args: &DemoArgs, fronts: Option<&Fronts>) -> Result<bool, String> {
    let quotas: &[Quota] = if fronts.is_some() { &ENVOY_QUOTAS } else { &ACQUIRE_QUOTAS };
    for q in quotas {
        crate::pools::put_policy(&stack.admin, TENANT, q.resource, &q.policy()).await?;
        println!("{}", q.describe());
    }
    if stack.tls.is_some() {
        // The allocator requires a client certificate of the run's CA, so
        // a browser cannot open the dashboard without one.
        println!("allocator: {}  (mTLS: clients need a certificate of the throwaway CA)", stack.admin.base);
    } else {
        println!("allocator: {}  (dashboard: {}/ui)", stack.admin.base, stack.admin.base);
    }
    let live = quotas[0].resource;
    let mut traffic = start_traffic(stack, fronts, live);
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
        println!("{}", live_line(stack, &traffic, t, live, fronts.is_some()).await);
    }
    stack.region(CUT_REGION).alloc_link.set(Fault::Pass);
    traffic.halt().await;
    if !interrupted {
        println!("traffic stopped; waiting for the last window to close and the outboxes to drain");
    }
    let settle =
        if interrupted { Duration::from_secs(3) } else { Duration::from_secs(WINDOW_SECS as u64 + 15) };
    let chart_base =
        args.chart.clone().unwrap_or_else(|| report::target_dir().join("demo").join("windows.svg"));
    let mut failed = Vec::new();
    for q in quotas {
        let several = quotas.len() > 1;
        let f = report_quota(stack, q, &traffic, fronts.is_some(), settle, &chart_base, several).await?;
        failed
            .extend(f.into_iter().map(|f| if several { format!("{TENANT}/{}: {f}", q.resource) } else { f }));
    }
    if let Some(f) = fronts {
        let seen = traffic.tally().values().fold(traffic::Counts::default(), |mut c, r| {
            c.add(&traffic::total(r));
            c
        });
        println!(
            "through Envoy: clients saw {} × 200, {} × 429, {} × 5xx (counted as 503: nothing charged); the \
             upstream served {}",
            seen.admitted(),
            seen.denied,
            seen.unavailable,
            f.upstream.hits()
        );
        if seen.ambiguous == 0 && seen.admitted() != f.upstream.hits() {
            failed.push(format!(
                "the upstream served {} requests, clients saw {} admitted",
                f.upstream.hits(),
                seen.admitted()
            ));
        }
    }
    for f in &failed {
        println!("FAILED: {f}");
    }
    if failed.is_empty() {
        println!("every window held its bound, and the allocator's ledger equals what clients saw");
    }
    Ok(failed.is_empty())
}

/// Says what the clients do and starts them: on the agents, or through
/// the Envoys of `fronts`; `live` is the quota the live lines show.
fn start_traffic(stack: &Stack, fronts: Option<&Fronts>, live: &str) -> Traffic {
    match fronts {
        Some(_) => println!(
            "live: per region, this window's requests through Envoy: 200s (ok), 429s, 5xx (Envoy's 500 when the \
             agent cannot decide, failure_mode_deny: true), {TENANT}/{live} lease tokens left, mode"
        ),
        None => println!(
            "live: per region, this window's admitted (ok), of them fallback (fb), 429s, 503s, lease tokens left, mode"
        ),
    }
    for (region, urls) in stack.agent_urls() {
        println!("region {region}: agents {}", urls.join(", "));
    }
    let targets = match fronts {
        Some(f) => {
            for (region, urls) in f.urls() {
                println!("region {region}: Envoys {} (one per agent)", urls.join(", "));
            }
            println!(
                "traffic: GET {} or {} ({:.0} % searches) with {}: one of {} users, {} sending {:.0} %",
                envoy_traffic::SEARCH,
                envoy_traffic::BROWSE,
                envoy_traffic::SEARCH_SHARE * 100.0,
                envoy_traffic::USER_HEADER,
                envoy_traffic::USERS.len(),
                envoy_traffic::USERS[0],
                envoy_traffic::HEAVY_SHARE * 100.0
            );
            f.urls()
        }
        None => stack.agent_urls(),
    };
    let loads: Vec<RegionLoad> = targets
        .into_iter()
        .map(|(region, agents)| {
            let rate_per_sec = if region == "eu" { 90.0 } else { 30.0 };
            RegionLoad { region, agents, rate_per_sec }
        })
        .collect();
    match fronts {
        Some(_) => Traffic::start_envoy(&loads, WINDOW_SECS),
        None => Traffic::start(TENANT, live, &loads),
    }
}

/// Waits for the allocator's accounts of quota `q`, prints its table and
/// writes its chart (`chart_base`, suffixed with the quota when there are
/// `several`); answers the failed checks.
async fn report_quota(
    stack: &Stack,
    q: &Quota,
    traffic: &Traffic,
    envoy: bool,
    settle: Duration,
    chart_base: &Path,
    several: bool,
) -> Result<Vec<String>, String> {
    let tally = traffic.tally_of(q.resource);
    let agrees = |acc: &_| report::ledger_agrees(&tally, acc, WINDOW_SECS);
    let acc =
        accounts::settled(&stack.admin, TENANT, q.resource, &tally, WINDOW_SECS, settle, agrees).await?;
    let mut rows = report::rows(&tally, &acc, WINDOW_SECS);
    if envoy {
        // Envoy's answers do not say what paid for an admit: the
        // fallback column is the allocator's count.
        for r in &mut rows {
            r.fallback = acc.get(&window_of(r)).map_or(0, |a| a.fallback_admitted.max(0) as u64);
        }
    }
    let failed = report::check_windows(&rows, |r| r.bound, |_| 0);
    if several {
        println!("\n{TENANT}/{} ({}):", q.resource, q.spent_by);
    } else {
        println!();
    }
    println!("{}", summary(&rows, &acc, envoy));
    let path = if several { suffixed(chart_base, q.resource) } else { chart_base.to_path_buf() };
    let title = format!("{TENANT}/{}: admitted per {WINDOW_SECS} s window by region", q.resource);
    let path = write_chart(&path, &title, &rows)?;
    println!("chart: {}", path.display());
    Ok(failed)
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

async fn live_line(stack: &Stack, traffic: &Traffic, t: u64, resource: &str, envoy: bool) -> String {
    let now = chrono::Utc::now().timestamp();
    let ws = now.div_euclid(WINDOW_SECS) * WINDOW_SECS;
    let tally = traffic::by_window(&traffic.tally(), WINDOW_SECS);
    let mut line = format!("t={t:>3}s window {} |", fmt_hms(ws));
    for region in &stack.regions {
        let c = tally.get(&ws).and_then(|r| r.get(&region.name)).copied().unwrap_or_default();
        let (mut tokens, mut mode) = (0i64, String::from("?"));
        for a in &region.agents {
            let s = a.http.get("/v1/status").await.body;
            let ours = |q: &&serde_json::Value| q["tenant"] == TENANT && q["resource"] == resource;
            if let Some(q) = s["quotas"].as_array().and_then(|qs| qs.iter().find(ours)) {
                tokens = tokens.max(q["lease_tokens"].as_i64().unwrap_or(0));
                mode = q["mode"].as_str().unwrap_or("?").to_string();
            }
        }
        let _ = if envoy {
            // Through Envoy a 200 does not say whether the fallback paid.
            write!(
                line,
                " {} ok {:>4} 429 {:>4} 5xx {:>4} lease {:>4} {:<9}|",
                region.name,
                c.admitted(),
                c.denied,
                c.unavailable,
                tokens,
                mode
            )
        } else {
            write!(
                line,
                " {} ok {:>4} fb {:>3} 429 {:>4} 503 {:>4} lease {:>4} {:<9}|",
                region.name,
                c.admitted(),
                c.fallback,
                c.denied,
                c.unavailable,
                tokens,
                mode
            )
        };
    }
    line
}

fn fmt_hms(ts: i64) -> String {
    chrono::DateTime::from_timestamp(ts, 0).map(|t| t.format("%H:%M:%S").to_string()).unwrap_or_default()
}
