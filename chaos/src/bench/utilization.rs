//! Utilization and fairness at scale: the skew and contention scenarios of
//! DESIGN §4 on many quotas at once, three regions, small windows, over the
//! full lab stack (agents reach the allocator and Redis through the links
//! of [`crate::stack`], as in the chaos suite).
//!
//! Per measured window of each quota: `admitted / min(G, offered)` from the
//! clients' ground truth (offered = every request sent in the window), and
//! the allocator's `stranded` (granted, neither admitted nor returned) as %
//! of G from `/v1/windows`. The first window is warm-up (no demand
//! estimate yet) and is left out, and so is the window traffic stops in.

use super::{Plan, Results};
use crate::stack::{Stack, StackSpec};
use crate::traffic::{self, RegionLoad, Traffic};
use serde_json::json;
use std::collections::BTreeMap;

const TENANT: &str = "util";
pub const REGIONS: [&str; 3] = ["eu", "us", "ap"];

/// One scenario: demand per window per region, as fractions of G.
struct Scenario {
    name: &'static str,
    /// Demand per window of each region in [`REGIONS`] order, × G.
    demand: [f64; 3],
}

/// DESIGN §4's skew (900/100 of 1,000) and contention (2,000/500 of
/// 1,000), with a third, small region taking a slice of the minority's share.
const SCENARIOS: [Scenario; 2] = [
    Scenario { name: "skew", demand: [0.90, 0.08, 0.02] },
    Scenario { name: "contention", demand: [2.00, 0.40, 0.10] },
];

/// Runs both scenarios on one stack.
pub async fn run(
    bins: crate::bins::Bins,
    plan: &Plan,
    out: &mut Results,
    progress: &dyn Fn(&str),
) -> Result<(), String> {
    let spec = StackSpec {
        regions: REGIONS.iter().map(|r| (r.to_string(), 1)).collect(),
        allocators: 1,
        agent_env: vec![("RUST_LOG".into(), "warn".into())],
        sentinel_regions: Vec::new(),
        patroni: None,
    };
    let stack = Stack::start(bins, &spec, &|s| progress(&format!("utilization: {s}"))).await?;
    let result = scenarios(&stack, plan, out, progress).await;
    stack.shutdown().await;
    result
}

async fn scenarios(
    stack: &Stack,
    plan: &Plan,
    out: &mut Results,
    progress: &dyn Fn(&str),
) -> Result<(), String> {
    let (g, w) = (plan.util_limit, plan.util_window_secs);
    let urls: BTreeMap<String, Vec<String>> = stack.agent_urls().into_iter().collect();
    let mut stranded_all = Vec::new();
    for sc in &SCENARIOS {
        progress(&format!(
            "utilization: {} on {} quotas × {} regions, G = {g} per {w} s, {} windows measured",
            sc.name,
            plan.util_quotas,
            REGIONS.len(),
            plan.util_windows
        ));
        let resources: Vec<String> = (0..plan.util_quotas).map(|i| format!("{}-{i}", sc.name)).collect();
        crate::pools::put_policies(&stack.admin, TENANT, &resources, &json!({"limit": g, "window_secs": w}))
            .await?;
        // Start on a window boundary so every window but the first sees full demand.
        let now = chrono::Utc::now();
        let start = now.timestamp() - now.timestamp().rem_euclid(w) + w;
        quota_tests::wait::until_utc(chrono::DateTime::from_timestamp(start, 0).unwrap_or(now)).await;
        let loads: Vec<RegionLoad> = REGIONS
            .iter()
            .zip(sc.demand)
            .map(|(r, d)| RegionLoad {
                region: r.to_string(),
                agents: urls.get(*r).cloned().unwrap_or_default(),
                rate_per_sec: d * g as f64 / w as f64,
            })
            .collect();
        let traffics: Vec<Traffic> = resources.iter().map(|r| Traffic::start(TENANT, r, &loads)).collect();
        let (from, to) = (start + w, start + w * (1 + plan.util_windows as i64));
        quota_tests::wait::until_utc(chrono::DateTime::from_timestamp(to, 0).unwrap_or(now)).await;
        let mut tallies = Vec::new();
        for t in traffics {
            tallies.push(t.stop().await);
        }
        // Agents report consumption and release unspent leases from their
        // outboxes (every 200 ms), and a lease of the last window is
        // released once it expires at the window's end.
        tokio::time::sleep(plan.settle).await;

        let (mut admitted, mut possible, mut stranded, mut windows) = (0u64, 0u64, 0i64, 0u64);
        let mut by_region: BTreeMap<String, (u64, u64)> = BTreeMap::new();
        let mut stranded_by_region: BTreeMap<String, i64> = BTreeMap::new();
        for (r, tally) in resources.iter().zip(&tallies) {
            let grouped = traffic::by_window(tally, w);
            let accounts = crate::accounts::windows(&stack.admin, TENANT, r, from, to).await?;
            for ws in (from..to).step_by(w as usize) {
                let regions = grouped.get(&ws).cloned().unwrap_or_default();
                let c = traffic::total(&regions);
                let offered = c.admitted() + c.denied + c.unavailable + c.ambiguous;
                admitted += c.admitted();
                possible += offered.min(g as u64);
                windows += 1;
                for (name, rc) in &regions {
                    let e = by_region.entry(name.clone()).or_default();
                    e.0 += rc.admitted();
                    e.1 += rc.admitted() + rc.denied + rc.unavailable + rc.ambiguous;
                }
                if let Some(a) = accounts.get(&ws) {
                    stranded += a.stranded;
                    for (name, ra) in &a.regions {
                        *stranded_by_region.entry(name.clone()).or_default() += ra.stranded;
                    }
                }
            }
        }
        let util = 100.0 * admitted as f64 / possible.max(1) as f64;
        let stranded_pct = 100.0 * stranded as f64 / (g as f64 * windows.max(1) as f64);
        stranded_all.push(stranded_pct);
        let k = |s: &str| format!("utilization.{}.{s}", sc.name);
        out.set(&format!("utilization.{}", sc.name), util);
        out.set(&k("stranded_pct"), stranded_pct);
        out.set(&k("quota_windows"), windows as f64);
        let (adm_total, off_total): (u64, u64) =
            by_region.values().fold((0, 0), |a, v| (a.0 + v.0, a.1 + v.1));
        let mut gap: f64 = 0.0;
        let mut min_served: f64 = 100.0;
        for (name, (a, o)) in &by_region {
            let served = 100.0 * *a as f64 / (*o).max(1) as f64;
            let share_admits = 100.0 * *a as f64 / adm_total.max(1) as f64;
            let share_demand = 100.0 * *o as f64 / off_total.max(1) as f64;
            out.set(&k(&format!("{name}.served_pct")), served);
            out.set(&k(&format!("{name}.share_of_admits_pct")), share_admits);
            let parked = stranded_by_region.get(name).copied().unwrap_or(0);
            out.set(
                &k(&format!("{name}.stranded_pct")),
                100.0 * parked as f64 / (g as f64 * windows.max(1) as f64),
            );
            gap = gap.max((share_admits - share_demand).abs());
            min_served = min_served.min(served);
        }
        out.set(&k("max_share_gap_pts"), gap);
        out.set(&k("min_region_served_pct"), min_served);
    }
    // The headline is the worse scenario, not an average that could hide it.
    out.set("stranded_pct", stranded_all.iter().copied().fold(0.0, f64::max));
    Ok(())
}

/// One scenario of this part (`utilization.<scenario>` and below), read
/// back from a report.
#[derive(Debug, Clone, Copy, Default, serde::Deserialize)]
#[serde(default)]
pub struct Measured {
    /// Admitted / min(G, demand), %.
    pub value: Option<f64>,
    pub stranded_pct: Option<f64>,
    pub quota_windows: Option<f64>,
    pub max_share_gap_pts: Option<f64>,
    pub min_region_served_pct: Option<f64>,
}

/// One region of a scenario (`utilization.<scenario>.<region>.*`).
#[derive(Debug, Clone, Copy, Default, serde::Deserialize)]
#[serde(default)]
pub struct Region {
    pub served_pct: Option<f64>,
    pub share_of_admits_pct: Option<f64>,
    pub stranded_pct: Option<f64>,
}

impl Measured {
    /// Scenario `name` (`skew`, `contention`) of `r`.
    pub fn of(r: &super::report::BenchReport, name: &str) -> Measured {
        super::view::part(r, &format!("utilization.{name}"))
    }
}

impl Region {
    /// Region `region` of scenario `name` of `r`.
    pub fn of(r: &super::report::BenchReport, name: &str, region: &str) -> Region {
        super::view::part(r, &format!("utilization.{name}.{region}"))
    }
}
