//! `promtool` (Prometheus' own checker, Debian package `prometheus`) for the
//! operator tests: alert rules, their unit tests and scraped metrics. A
//! missing promtool fails the test that needs it, with the install command;
//! it is never skipped silently.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// The workspace's root folder.
pub fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("workspace root").to_path_buf()
}

/// `deploy/prometheus/` of the workspace.
pub fn prometheus_dir() -> PathBuf {
    workspace().join("deploy").join("prometheus")
}

/// What one promtool run printed.
#[derive(Debug)]
pub struct Run {
    pub ok: bool,
    pub output: String,
}

/// Runs `promtool ARGS` in `dir` with `stdin`; panics when promtool is not installed.
pub fn promtool(dir: &Path, args: &[&str], stdin: Option<&str>) -> Run {
    let mut child = Command::new("promtool")
        .args(args)
        .current_dir(dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| {
            panic!("promtool cannot be started ({e}); install it with `apt-get install prometheus` (.ci/run does)")
        });
    {
        let mut input = child.stdin.take().expect("stdin");
        if let Some(text) = stdin {
            input.write_all(text.as_bytes()).expect("write promtool stdin");
        }
    }
    let out = child.wait_with_output().expect("promtool output");
    Run {
        ok: out.status.success(),
        output: format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)),
    }
}

/// `promtool check metrics` over a scrape: panics with promtool's complaints
/// unless it is clean (help text, names, types).
pub fn check_metrics(what: &str, text: &str) {
    let run = promtool(&workspace(), &["check", "metrics"], Some(text));
    assert!(run.ok && run.output.trim().is_empty(), "promtool check metrics on the {what}:\n{}", run.output);
}

/// The metric names a PromQL expression refers to: every identifier that is
/// followed by a selector (`{`, `[`), an operator, a closing parenthesis or
/// the end, and is not a function, keyword or label name. Good enough for
/// the rules and panels of this repository, which name metrics by their
/// full `agent_`/`allocator_` prefix; `prefixes` restricts the result.
pub fn metric_names(expr: &str, prefixes: &[&str]) -> Vec<String> {
    let mut names = Vec::new();
    let bytes: Vec<char> = expr.chars().collect();
    let mut i = 0;
    while i < bytes.len() {
        let c = bytes[i];
        if c == '"' || c == '\'' {
            // Skip string literals (label values, count_values' label).
            i += 1;
            while i < bytes.len() && bytes[i] != c {
                i += 1;
            }
            i += 1;
            continue;
        }
        if c.is_ascii_alphabetic() || c == '_' {
            let start = i;
            while i < bytes.len() && (bytes[i].is_ascii_alphanumeric() || bytes[i] == '_' || bytes[i] == ':')
            {
                i += 1;
            }
            let word: String = bytes[start..i].iter().collect();
            if prefixes.iter().any(|p| word.starts_with(p)) && !names.contains(&word) {
                names.push(word);
            }
            continue;
        }
        i += 1;
    }
    names
}

/// The metric names a Prometheus text exposition shows (from its samples,
/// with the `_bucket`/`_sum`/`_count` series of histograms).
pub fn exported_names(text: &str) -> Vec<String> {
    let mut names: Vec<String> = text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| l.split(['{', ' ']).next())
        .map(str::to_string)
        .collect();
    names.sort();
    names.dedup();
    names
}
