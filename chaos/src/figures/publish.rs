//! Publishing a whole run: its `report.json` copied under docs/reports/
//! and the blocks it owns rewritten in README.md and docs/**/*.md.
//! Publishing never fails the run: a run's verdict is about the system, so
//! a docs tree that cannot be written is reported on stderr and left alone.

use super::{
    blocks, markdown_files, render_bench, render_chaos, render_gameday, root, Figure, BENCHMARKS_MD,
    BENCH_JSON, CHAOS_JSON, GAMEDAY_JSON,
};
use crate::bench::report::BenchReport;
use crate::report::ScenarioReport;
use std::path::Path;

/// Why a file was not published.
#[derive(Debug, thiserror::Error)]
enum PublishError {
    #[error("{file}: {source}")]
    Io { file: String, source: std::io::Error },
    #[error("{file}: {source}; fix the markers, then run again")]
    Markers { file: String, source: blocks::MarkerError },
}

fn io(file: &str) -> impl FnOnce(std::io::Error) -> PublishError + '_ {
    move |source| PublishError::Io { file: file.to_string(), source }
}

/// Copies `report_json` to `copy_to`, then rewrites every block of
/// `figures` in the docs of `root`; the files written, relative to `root`.
fn publish(
    root: &Path,
    report_json: &Path,
    copy_to: &str,
    figures: &[(Figure, String)],
) -> (Vec<String>, Vec<PublishError>) {
    let (mut written, mut failed) = (Vec::new(), Vec::new());
    let copied = std::fs::create_dir_all(root.join(copy_to).parent().unwrap_or(root))
        .and_then(|()| std::fs::copy(report_json, root.join(copy_to)));
    match copied {
        Ok(_) => written.push(copy_to.to_string()),
        // Blocks rendered from a report that is not committed would fail
        // the figures test: publish all or nothing.
        Err(e) => return (written, vec![io(copy_to)(e)]),
    }
    let files = match markdown_files(root) {
        Ok(f) => f,
        Err(e) => return (written, vec![io("docs")(e)]),
    };
    for file in files {
        match rewrite(root, &file, figures) {
            Ok(true) => written.push(file),
            Ok(false) => {}
            Err(e) => failed.push(e),
        }
    }
    (written, failed)
}

/// Rewrites the blocks of `figures` in `file`; whether it held any.
fn rewrite(root: &Path, file: &str, figures: &[(Figure, String)]) -> Result<bool, PublishError> {
    let path = root.join(file);
    let mut text = std::fs::read_to_string(&path).map_err(io(file))?;
    let mut held = 0;
    for (f, body) in figures {
        let (t, n) = blocks::replace(&text, f.name(), body)
            .map_err(|source| PublishError::Markers { file: file.to_string(), source })?;
        text = t;
        held += n;
    }
    if held > 0 {
        std::fs::write(&path, text).map_err(io(file))?;
    }
    Ok(held > 0)
}

/// Creates docs/benchmarks.md with its block when it does not exist.
fn ensure_benchmarks_page(root: &Path) -> Result<(), PublishError> {
    let path = root.join(BENCHMARKS_MD);
    if path.exists() {
        return Ok(());
    }
    let name = Figure::Benchmarks.name();
    let text = format!("# Benchmarks\n\n{}\n{}\n", blocks::begin(name), blocks::end(name));
    std::fs::write(&path, text).map_err(io(BENCHMARKS_MD))
}

fn tell(what: &str, (written, failed): (Vec<String>, Vec<PublishError>), say: &dyn Fn(&str)) {
    if !written.is_empty() {
        say(&format!("published {what}: wrote {}", written.join(", ")));
    }
    for e in failed {
        say(&format!("not published: {e}"));
    }
}

/// Publishes a whole bench run whose report is `report_json` (= `r`).
pub fn publish_bench(report_json: &Path, r: &BenchReport, say: &dyn Fn(&str)) {
    let root = root();
    if let Err(e) = ensure_benchmarks_page(&root) {
        say(&format!("not published: {e}"));
        return;
    }
    let figures: Vec<(Figure, String)> =
        [Figure::Performance, Figure::Benchmarks].into_iter().map(|f| (f, render_bench(f, r))).collect();
    tell("the bench run", publish(&root, report_json, BENCH_JSON, &figures), say);
}

/// Publishes a whole chaos run whose report is `report_json` (= `reports`).
pub fn publish_chaos(report_json: &Path, reports: &[ScenarioReport]) {
    let figures = [(Figure::Chaos, render_chaos(reports))];
    tell("the chaos run", publish(&root(), report_json, CHAOS_JSON, &figures), &|s| eprintln!("chaos: {s}"));
}

/// Publishes a whole game day (all ten drills) whose report is
/// `report_json` (= `report`).
pub fn publish_gameday(report_json: &Path, report: &serde_json::Value) {
    let figures = [(Figure::Gameday, render_gameday(report))];
    tell("the game day", publish(&root(), report_json, GAMEDAY_JSON, &figures), &|s| {
        eprintln!("gameday: {s}")
    });
}

/// Rewrites every block from the committed reports under `root` (after a
/// renderer changed, without running the benchmarks or the chaos suite
/// again); what was written and what could not be.
pub fn regenerate(root: &Path) -> Vec<String> {
    let mut figures = Vec::new();
    let mut said = Vec::new();
    match crate::bench::report::read_json::<BenchReport>(&root.join(BENCH_JSON)) {
        Ok(r) => figures.extend([Figure::Performance, Figure::Benchmarks].map(|f| (f, render_bench(f, &r)))),
        Err(e) => said.push(format!("not regenerated: {e}")),
    }
    match crate::bench::report::read_json::<Vec<ScenarioReport>>(&root.join(CHAOS_JSON)) {
        Ok(r) => figures.push((Figure::Chaos, render_chaos(&r))),
        Err(e) => said.push(format!("not regenerated: {e}")),
    }
    match crate::bench::report::read_json::<serde_json::Value>(&root.join(GAMEDAY_JSON)) {
        Ok(r) => figures.push((Figure::Gameday, render_gameday(&r))),
        Err(e) => said.push(format!("not regenerated: {e}")),
    }
    for file in markdown_files(root).unwrap_or_default() {
        match rewrite(root, &file, &figures) {
            Ok(true) => said.push(format!("wrote {file}")),
            Ok(false) => {}
            Err(e) => said.push(format!("not regenerated: {e}")),
        }
    }
    said
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn publishing_copies_the_report_and_rewrites_only_its_blocks() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        std::fs::create_dir_all(root.join("docs")).unwrap();
        let readme = "# R\n<!-- figures:chaos:begin -->\nold\n<!-- figures:chaos:end -->\n\
                      <!-- figures:performance:begin -->\nkeep\n<!-- figures:performance:end -->\n";
        std::fs::write(root.join("README.md"), readme).unwrap();
        std::fs::write(root.join("docs/other.md"), "no blocks\n").unwrap();
        std::fs::write(root.join("docs/broken.md"), "<!-- figures:chaos:begin -->\n").unwrap();
        std::fs::write(root.join("report.json"), "[]").unwrap();
        let (written, failed) =
            publish(root, &root.join("report.json"), CHAOS_JSON, &[(Figure::Chaos, "new\n".into())]);
        assert_eq!(written, [CHAOS_JSON, "README.md"]);
        assert_eq!(failed.len(), 1, "the broken page is reported: {failed:?}");
        assert!(failed[0].to_string().starts_with("docs/broken.md: line 1"), "{}", failed[0]);
        assert_eq!(std::fs::read_to_string(root.join(CHAOS_JSON)).unwrap(), "[]");
        let text = std::fs::read_to_string(root.join("README.md")).unwrap();
        assert_eq!(text, readme.replace("old", "new"));
        assert_eq!(std::fs::read_to_string(root.join("docs/other.md")).unwrap(), "no blocks\n");
    }
}
