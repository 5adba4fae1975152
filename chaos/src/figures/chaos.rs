//! The chaos table the docs show (the `chaos` generated block): which run,
//! how many scenarios passed, the per-scenario summary and the windows
//! that went over G. A pure function of `report.json` and the list of
//! scenarios (so one left out of the report, skipped on the machine that
//! ran it, is named rather than silently missing).

use super::number::count;
use crate::report::{self, ScenarioReport, Verdict};
use std::fmt::Write as _;

/// The block's text.
pub fn block(reports: &[ScenarioReport], scenarios: &[&str]) -> String {
    let mut s = String::new();
    let passed = reports.iter().filter(|r| r.verdict == Verdict::Pass).count();
    let first = reports.iter().flat_map(|r| r.windows.iter().map(|w| w.window_start.as_str())).min();
    let secs: f64 = reports.iter().map(|r| r.seconds).sum();
    let secs = secs.round() as u64;
    let _ = write!(
        s,
        "Latest published run of `cargo lab chaos --profile short` (first window {}): {passed} of {} \
         scenarios passed, {} min {} s of scenarios",
        first.unwrap_or("none"),
        reports.len(),
        secs / 60,
        secs % 60
    );
    let missing: Vec<&str> =
        scenarios.iter().copied().filter(|n| !reports.iter().any(|r| r.scenario == *n)).collect();
    if !missing.is_empty() {
        let _ = write!(s, "; not in the report (skipped on the machine that ran it): {}", missing.join(", "));
    }
    let _ = writeln!(s, ".\n");
    s.push_str(&report::summary(reports));
    let over: Vec<String> = reports
        .iter()
        .filter_map(|r| {
            let w = r.windows.iter().max_by_key(|w| w.overshoot)?;
            (w.overshoot > 0).then(|| {
                // The scenario's verdict, not the window's `bound` column:
                // a scenario may allow more (lost grants × chunk).
                format!("`{}` by {} ({})", r.scenario, count(w.overshoot as f64), r.verdict)
            })
        })
        .collect();
    let _ = writeln!(
        s,
        "\nOver G in a window: {}.",
        if over.is_empty() { "none".to_string() } else { over.join(", ") }
    );
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::WindowRow;

    fn window(start: &str, admitted: u64, limit: i64, bound: i64) -> WindowRow {
        WindowRow {
            window_start: start.into(),
            limit,
            bound,
            admitted,
            fallback: 0,
            overshoot: (admitted as i64 - limit).max(0),
            fallback_repaid: 0,
            stranded: 3,
            denied: 0,
            unavailable: 0,
            ambiguous: 0,
            ledger_admitted: admitted as i64,
            late: false,
            regions: Default::default(),
            stranded_by_region: Default::default(),
        }
    }

    fn scenario(name: &str, verdict: Verdict, windows: Vec<WindowRow>) -> ScenarioReport {
        ScenarioReport {
            scenario: name.into(),
            verdict,
            windows,
            notes: Vec::new(),
            seconds: 61.4,
            figures: Default::default(),
        }
    }

    #[test]
    fn the_block_names_the_run_the_misses_and_the_overshoot() {
        let reports = vec![
            scenario("a", Verdict::Pass, vec![window("2026-12-05T08:00:04Z", 700, 1000, 1200)]),
            scenario(
                "b",
                Verdict::Fail,
                vec![
                    window("2026-12-05T08:00:00Z", 1062, 1000, 1200),
                    window("2026-12-05T08:00:04Z", 10, 1000, 1200),
                ],
            ),
        ];
        let text = block(&reports, &["a", "b", "netns"]);
        assert!(text.starts_with(
            "Latest published run of `cargo lab chaos --profile short` (first window 2026-12-05T08:00:00Z): \
             1 of 2 scenarios passed, 2 min 3 s of scenarios; not in the report (skipped on the machine \
             that ran it): netns.\n\n| scenario |"
        ), "{text}");
        assert!(text.contains("| b | fail | 2 | 1000 | 1200 | 1062 | 62 |"), "{text}");
        assert!(text.ends_with("\nOver G in a window: `b` by 62 (fail).\n"), "{text}");
    }
}
