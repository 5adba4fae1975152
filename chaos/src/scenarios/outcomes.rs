//! Scenario 9: the outcomes DESIGN §4 promises, measured from the clients:
//! no admission gap at rollover below G, skew, and contention.

use super::harness::{Profile, Run};
use crate::bins::Bins;
use crate::report::ScenarioReport;
use crate::traffic::{self, Tally};

/// Full windows (start, end) strictly inside `[from, to)` (Unix seconds).
fn full_windows(from: i64, to: i64, secs: i64) -> Vec<i64> {
    let first = (from + secs - 1).div_euclid(secs) * secs;
    (0..).map(|k| first + k * secs).take_while(|ws| ws + secs <= to).collect()
}

pub async fn demand_skew(p: &Profile, bins: Bins) -> Result<ScenarioReport, String> {
    let mut run = Run::start("demand-skew", p, bins, None, false).await?;
    let t0 = chrono::Utc::now().timestamp();
    run.traffic(&[("eu", 0.5), ("us", 0.2)]);
    run.note("phase 1: eu 50 %, us 20 % of G (rollover below G)");
    run.pass(2.5).await;
    let t1 = chrono::Utc::now().timestamp();
    run.set_share("eu", 0.9);
    run.set_share("us", 0.1);
    run.note("phase 2 (skew): eu 90 %, us 10 % of G");
    run.pass(3.5).await;
    let t2 = chrono::Utc::now().timestamp();
    run.set_share("eu", 2.0);
    run.set_share("us", 0.5);
    run.note("phase 3 (contention): eu 200 %, us 50 % of G");
    run.pass(3.5).await;
    let t3 = chrono::Utc::now().timestamp();
    let (secs, limit) = (p.window_secs, p.limit);
    run.finish_with(move |_, tally: &Tally| {
        let by = traffic::by_window(tally, secs);
        let mut checks = Vec::new();
        let calm = full_windows(t0 + 1, t1, secs);
        let refused: u64 = calm
            .iter()
            .filter_map(|ws| by.get(ws))
            .map(|r| {
                let c = traffic::total(r);
                c.denied + c.unavailable
            })
            .sum();
        checks.push((refused == 0, format!("phase 1: {refused} refusals over {} full windows", calm.len())));
        for ws in full_windows(t1 + 1, t2, secs) {
            let Some(r) = by.get(&ws) else { continue };
            for region in ["eu", "us"] {
                let c = r.get(region).copied().unwrap_or_default();
                let offered = c.admitted() + c.denied + c.unavailable + c.ambiguous + c.refused;
                let pct = 100.0 * c.admitted() as f64 / offered.max(1) as f64;
                checks.push((
                    pct >= 98.0,
                    format!("skew window {ws}: {region} admitted {pct:.1} % of its demand"),
                ));
            }
        }
        for ws in full_windows(t2 + 1, t3, secs) {
            let Some(r) = by.get(&ws) else { continue };
            let eu = r.get("eu").map(|c| c.admitted()).unwrap_or(0) as f64;
            let us = r.get("us").map(|c| c.admitted()).unwrap_or(0) as f64;
            let util = 100.0 * (eu + us) / limit as f64;
            let share = 100.0 * eu / (eu + us).max(1.0);
            checks.push((util >= 97.0, format!("contention window {ws}: {util:.1} % of G admitted")));
            checks.push((
                (share - 80.0).abs() <= 10.0,
                format!("contention window {ws}: eu's share of admits {share:.1} % (demand share 80 %)"),
            ));
        }
        checks
    })
    .await
}
