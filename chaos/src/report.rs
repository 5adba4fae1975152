//! Per-window rows joining the clients' ground truth with the allocator's
//! accounting, their checks, and the table as text, Markdown and JSON.

use crate::accounts::WindowAccount;
use crate::traffic::{self, Tally};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

/// One window of one scenario.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WindowRow {
    pub window_start: String,
    pub limit: i64,
    pub bound: i64,
    /// Clients' 200s charged to this window (ground truth).
    pub admitted: u64,
    /// Of those, `source: "fallback"`.
    pub fallback: u64,
    /// `admitted − limit` when positive.
    pub overshoot: i64,
    /// Of the fallback admits, what the allocator repaid from the window's
    /// pool (reported while the window was open, issue 17 item 5): grants
    /// after the report shared that much less, so without the repayment
    /// the window could have admitted up to this many more.
    pub fallback_repaid: i64,
    pub stranded: i64,
    pub denied: u64,
    pub unavailable: u64,
    /// Requests whose answer the client never saw.
    pub ambiguous: u64,
    /// What the allocator's accounting says was admitted.
    pub ledger_admitted: i64,
    /// Requests sent after this window ended and still admitted into it
    /// (an admit on an expired lease: must be 0, I2).
    pub late: bool,
    /// Admitted per region (ground truth).
    pub regions: BTreeMap<String, u64>,
    /// Stranded per region (the allocator's accounting).
    pub stranded_by_region: BTreeMap<String, i64>,
}

/// What a scenario's checks concluded; `report.json` spells it in lower
/// case (`"pass"`, `"fail"`, `"skipped"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    Pass,
    Fail,
    /// The scenario cannot run on this machine (no verdict; left out of
    /// `report.json`).
    Skipped,
}

impl Verdict {
    /// The verdict as `report.json` and the tables spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Pass => "pass",
            Verdict::Fail => "fail",
            Verdict::Skipped => "skipped",
        }
    }
}

impl std::fmt::Display for Verdict {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One scenario's result, as `report.json` holds it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ScenarioReport {
    pub scenario: String,
    pub verdict: Verdict,
    pub windows: Vec<WindowRow>,
    /// Every check that failed, and notes on what the scenario did.
    pub notes: Vec<String>,
    pub seconds: f64,
    /// Named figures the run measured (the game day's verdicts read them):
    /// every run's window figures (`admitted_max_per_window`,
    /// `bound_per_window`, `windows`) and the scenario's own.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub figures: BTreeMap<String, f64>,
}

/// Joins the tally (raw keys) with the accounts; windows with neither
/// traffic nor accounting are left out.
pub fn rows(tally: &Tally, accounts: &BTreeMap<i64, WindowAccount>, secs: i64) -> Vec<WindowRow> {
    let grouped = traffic::by_window(tally, secs);
    let mut starts: Vec<i64> = grouped.keys().chain(accounts.keys()).copied().collect();
    starts.sort_unstable();
    starts.dedup();
    starts
        .into_iter()
        .map(|ws| {
            let empty = BTreeMap::new();
            let regions = grouped.get(&ws).unwrap_or(&empty);
            let c = traffic::total(regions);
            let acc = accounts.get(&ws);
            let limit = acc.map(|a| a.limit).unwrap_or(0);
            WindowRow {
                window_start: chrono::DateTime::from_timestamp(ws, 0)
                    .unwrap_or_default()
                    .to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
                limit,
                bound: acc.map(|a| a.bound).unwrap_or(0),
                admitted: c.admitted(),
                fallback: c.fallback,
                overshoot: (c.admitted() as i64 - limit).max(0),
                fallback_repaid: acc.map(|a| a.fallback_repaid).unwrap_or(0),
                stranded: acc.map(|a| a.stranded).unwrap_or(0),
                denied: c.denied,
                unavailable: c.unavailable,
                ambiguous: c.ambiguous,
                ledger_admitted: acc.map(|a| a.admitted).unwrap_or(0),
                late: c.last_admit_sent_ms >= (ws + secs) * 1000,
                regions: regions.iter().map(|(r, c)| (r.clone(), c.admitted())).collect(),
                stranded_by_region: acc
                    .map(|a| a.regions.iter().map(|(r, x)| (r.clone(), x.stranded)).collect())
                    .unwrap_or_default(),
            }
        })
        .collect()
}

/// Whether the allocator's count of every window of `tally` agrees with
/// the clients' (the count check of [`check_windows`], with no bound and
/// nothing lost): what [`crate::accounts::settled`] waits for.
pub fn ledger_agrees(tally: &Tally, accounts: &BTreeMap<i64, WindowAccount>, secs: i64) -> bool {
    check_windows(&rows(tally, accounts, secs), |_| i64::MAX, |_| 0).is_empty()
}

/// The checks every scenario makes on every window: admitted within the
/// bound (I6), no admit into a window after it ended (I2), and the
/// allocator's count equal to the clients' (I7). A request whose answer was
/// lost may have been admitted, then or later (a paused agent answers a
/// queued request in the window it wakes up in), so the allocator may count
/// more than the clients saw, by at most the unanswered requests sent up to
/// that window and not yet accounted for; never fewer, except by what
/// `lost_of` allows (admits whose record a Redis data loss took with it).
pub fn check_windows(
    rows: &[WindowRow],
    bound_of: impl Fn(&WindowRow) -> i64,
    lost_of: impl Fn(&WindowRow) -> i64,
) -> Vec<String> {
    let mut failed = Vec::new();
    let mut unresolved = 0i64;
    for r in rows {
        let bound = bound_of(r);
        if r.admitted as i64 > bound {
            failed.push(format!("window {}: admitted {} > bound {bound}", r.window_start, r.admitted));
        }
        if r.late {
            failed.push(format!(
                "window {}: a request sent after the window ended was admitted into it",
                r.window_start
            ));
        }
        unresolved += r.ambiguous as i64;
        let excess = r.ledger_admitted - r.admitted as i64;
        if excess < -lost_of(r) || excess > unresolved {
            failed.push(format!(
                "window {}: allocator counts {} admitted, clients saw {} ({} unanswered requests unaccounted for)",
                r.window_start, r.ledger_admitted, r.admitted, unresolved
            ));
        } else {
            unresolved -= excess.max(0);
        }
    }
    failed
}

/// A row's columns, in the order of both tables.
fn cells(w: &WindowRow) -> [String; 12] {
    [
        w.window_start.clone(),
        w.limit.to_string(),
        w.bound.to_string(),
        w.admitted.to_string(),
        w.overshoot.to_string(),
        w.fallback.to_string(),
        w.fallback_repaid.to_string(),
        w.stranded.to_string(),
        w.denied.to_string(),
        w.unavailable.to_string(),
        w.ambiguous.to_string(),
        w.ledger_admitted.to_string(),
    ]
}

/// The text table printed for a scenario.
pub fn text_table(rep: &ScenarioReport) -> String {
    let mut s = String::new();
    let _ =
        writeln!(s, "== {} : {} ({:.1} s)", rep.scenario, rep.verdict.as_str().to_uppercase(), rep.seconds);
    let _ = writeln!(
        s,
        "{:<21} {:>6} {:>6} {:>8} {:>9} {:>8} {:>6} {:>8} {:>7} {:>7} {:>6} {:>8}",
        "window",
        "G",
        "bound",
        "admitted",
        "overshoot",
        "fallback",
        "repaid",
        "stranded",
        "429",
        "503",
        "lost",
        "ledger"
    );
    for w in &rep.windows {
        let c = cells(w);
        let _ = writeln!(
            s,
            "{:<21} {:>6} {:>6} {:>8} {:>9} {:>8} {:>6} {:>8} {:>7} {:>7} {:>6} {:>8}",
            c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7], c[8], c[9], c[10], c[11]
        );
    }
    for n in &rep.notes {
        let _ = writeln!(s, "   - {n}");
    }
    s
}

/// One line per scenario: its verdict and its worst window.
pub fn summary(reports: &[ScenarioReport]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "| scenario | verdict | windows | G | bound | most admitted in a window | worst overshoot over G | fallback admitted | of it repaid | stranded | 429 | 503 | unanswered | ledger − clients |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for rep in reports {
        let most = rep.windows.iter().map(|w| w.admitted).max().unwrap_or(0);
        let over = rep.windows.iter().map(|w| w.overshoot).max().unwrap_or(0);
        let g = rep.windows.iter().map(|w| w.limit).max().unwrap_or(0);
        let bound = rep.windows.iter().map(|w| w.bound).max().unwrap_or(0);
        let stranded: i64 = rep.windows.iter().map(|w| w.stranded).sum();
        let fallback: u64 = rep.windows.iter().map(|w| w.fallback).sum();
        let repaid: i64 = rep.windows.iter().map(|w| w.fallback_repaid).sum();
        let denied: u64 = rep.windows.iter().map(|w| w.denied).sum();
        let unavailable: u64 = rep.windows.iter().map(|w| w.unavailable).sum();
        let unanswered: u64 = rep.windows.iter().map(|w| w.ambiguous).sum();
        let diff: i64 = rep.windows.iter().map(|w| w.ledger_admitted - w.admitted as i64).sum();
        let _ = writeln!(
            s,
            "| {} | {} | {} | {g} | {bound} | {most} | {over} | {fallback} | {repaid} | {stranded} | {denied} | {unavailable} | {unanswered} | {diff} |",
            rep.scenario,
            rep.verdict,
            rep.windows.len(),
        );
    }
    s
}

/// All scenarios as Markdown.
pub fn markdown(reports: &[ScenarioReport], command: &str) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "# Chaos report\n\nCommand: `{command}`\n");
    s.push_str(&summary(reports));
    let _ = writeln!(s);
    for rep in reports {
        let _ = writeln!(s, "## {} — {}\n", rep.scenario, rep.verdict);
        let _ = writeln!(
            s,
            "| window | G | bound | admitted | overshoot | fallback | fallback repaid | stranded | denied 429 | unavailable 503 | unanswered | ledger admitted |"
        );
        let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|---|---|---|");
        for w in &rep.windows {
            let _ = writeln!(s, "| {} |", cells(w).join(" | "));
        }
        for n in &rep.notes {
            let _ = writeln!(s, "\n- {n}");
        }
        let _ = writeln!(s);
    }
    s
}

/// Writes `value` as pretty JSON to `path`, creating its directory.
pub fn write_json<T: Serialize>(path: &Path, value: &T) -> Result<(), String> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    }
    let text = serde_json::to_string_pretty(value).map_err(|e| e.to_string())?;
    std::fs::write(path, text).map_err(|e| format!("{}: {e}", path.display()))
}

/// The workspace's `target/` directory (where reports go).
pub fn target_dir() -> std::path::PathBuf {
    if let Some(d) = std::env::var_os("CARGO_TARGET_DIR") {
        return d.into();
    }
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join("target")
}
