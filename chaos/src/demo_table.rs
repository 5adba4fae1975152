//! What `cargo lab demo` prints and writes at the end, per quota: the
//! per-window table and the SVG chart's file.

use crate::accounts;
use crate::chart;
use crate::report::WindowRow;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// `base` with `-<suffix>` added to its file name's stem (`windows.svg` →
/// `windows-search.svg`).
pub(crate) fn suffixed(base: &Path, suffix: &str) -> PathBuf {
    let stem = base.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "windows".into());
    let name = match base.extension() {
        Some(e) => format!("{stem}-{suffix}.{}", e.to_string_lossy()),
        None => format!("{stem}-{suffix}"),
    };
    base.with_file_name(name)
}

/// Writes the chart of `rows` to `path` (creating its directory) and
/// answers the absolute path it wrote.
pub(crate) fn write_chart(path: &Path, title: &str, rows: &[WindowRow]) -> Result<PathBuf, String> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    }
    let path = path
        .parent()
        .map(|d| if d.as_os_str().is_empty() { Path::new(".") } else { d })
        .and_then(|d| d.canonicalize().ok())
        .map(|d| d.join(path.file_name().unwrap_or_default()))
        .unwrap_or_else(|| path.to_path_buf());
    std::fs::write(&path, chart::svg(title, rows)).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(path)
}

/// The window start of `r` in Unix seconds.
pub(crate) fn window_of(r: &WindowRow) -> i64 {
    chrono::DateTime::parse_from_rfc3339(&r.window_start).map(|t| t.timestamp()).unwrap_or_default()
}

/// The per-window table; with `unavailable` a column of the 503s (through
/// Envoy, its 5xx).
pub(crate) fn summary(
    rows: &[WindowRow],
    acc: &std::collections::BTreeMap<i64, accounts::WindowAccount>,
    unavailable: bool,
) -> String {
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
    let _ = write!(s, " {:>8} {:>8} {:>8} {:>8}", "fallback", "stranded", "ledger", "429");
    if unavailable {
        let _ = write!(s, " {:>8}", "5xx");
    }
    let _ = writeln!(s, " {:>10}", "bound held");
    for w in rows {
        let held = acc
            .values()
            .find(|a| a.window_start.to_rfc3339_opts(chrono::SecondsFormat::Secs, true) == w.window_start)
            .map(|a| a.bound_held && w.admitted as i64 <= a.bound);
        let _ = write!(s, "{:<10} {:>6} {:>6}", w.window_start.get(11..19).unwrap_or(""), w.limit, w.bound);
        for r in &regions {
            let _ = write!(s, " {:>8}", w.regions.get(r).copied().unwrap_or(0));
        }
        let _ = write!(s, " {:>8} {:>8} {:>8} {:>8}", w.fallback, w.stranded, w.ledger_admitted, w.denied);
        if unavailable {
            let _ = write!(s, " {:>8}", w.unavailable);
        }
        let _ = writeln!(
            s,
            " {:>10}",
            match held {
                Some(true) => "yes",
                Some(false) => "NO",
                None => "-",
            }
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_quota_gets_its_own_chart_file() {
        assert_eq!(
            suffixed(Path::new("/t/demo/windows.svg"), "search"),
            Path::new("/t/demo/windows-search.svg")
        );
        assert_eq!(suffixed(Path::new("chart"), "catalog"), Path::new("chart-catalog"));
    }

    #[test]
    fn the_table_has_a_5xx_column_only_when_asked() {
        let row = WindowRow {
            window_start: "2026-01-01T00:00:10Z".into(),
            limit: 400,
            bound: 480,
            admitted: 410,
            fallback: 10,
            overshoot: 10,
            fallback_repaid: 0,
            stranded: 0,
            denied: 7,
            unavailable: 33,
            ambiguous: 0,
            ledger_admitted: 410,
            late: false,
            regions: [("eu".to_string(), 300), ("us".to_string(), 110)].into(),
            stranded_by_region: Default::default(),
        };
        let acc = Default::default();
        let plain = summary(std::slice::from_ref(&row), &acc, false);
        let envoy = summary(std::slice::from_ref(&row), &acc, true);
        assert!(!plain.contains("5xx") && !plain.contains(" 33 "), "{plain}");
        assert!(envoy.lines().next().is_some_and(|h| h.contains(" 429      5xx bound held")), "{envoy}");
        assert!(
            envoy.lines().nth(1).is_some_and(|l| l.starts_with("00:00:10") && l.contains(" 33 ")),
            "{envoy}"
        );
    }
}
