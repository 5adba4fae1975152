//! Finds performance figures written by hand: in Markdown outside generated
//! blocks and code fences, a latency percentile with a number (`p99 4.2`),
//! a throughput (`11,223/s`, `900 decisions/s`, `613 tps`) or a latency
//! with decimals (`1.34 ms`, `8.3 µs`).
//!
//! It is a pattern check, tuned to what the docs say about design rather
//! than measurements: whole milliseconds (`500 ms` between probes, `20 ms`
//! apart) and small rates (`eu 90/s`, `8/s per user`: offered load and
//! policies) are configuration, not results, and pass.

/// A figure found outside a generated block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stray {
    /// 1-based line.
    pub line: usize,
    /// The figure as written.
    pub figure: String,
}

/// Units after a number that mark a measured rate whatever the number.
const RATE_WORDS: [&str; 3] = ["decisions/s", "grants/s", "tps"];
const PERCENTILES: [&str; 4] = ["p50", "p99", "p99.9", "p999"];

/// The strays of `text` (already stripped of generated block bodies) that
/// lie outside ``` fences.
pub fn strays(text: &str) -> Vec<Stray> {
    let mut found = Vec::new();
    let mut fenced = false;
    for (i, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if !fenced {
            found.extend(in_line(line).into_iter().map(|figure| Stray { line: i + 1, figure }));
        }
    }
    found
}

/// Whether `c` continues a word or a path (so a number after it is part
/// of a name such as `v1/status` or `c16.p99_ms`).
fn joins(c: char) -> bool {
    c.is_alphanumeric() || matches!(c, '_' | '.' | '/' | '-')
}

/// The figures of one line.
fn in_line(line: &str) -> Vec<String> {
    let chars: Vec<char> = line.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let starts_number = chars[i].is_ascii_digit() && (i == 0 || !joins(chars[i - 1]));
        if !starts_number {
            i += 1;
            continue;
        }
        let mut j = i;
        while j < chars.len()
            && (chars[j].is_ascii_digit()
                || (matches!(chars[j], ',' | '.') && chars.get(j + 1).is_some_and(|c| c.is_ascii_digit())))
        {
            j += 1;
        }
        let number: String = chars[i..j].iter().collect();
        let before: String = chars[..i].iter().collect();
        let after: String = chars[j..].iter().collect();
        if let Some(unit) = unit_of(&number, &after) {
            out.push(format!("{number}{unit}"));
        } else if let Some(p) = PERCENTILES.iter().find(|p| before.trim_end().ends_with(*p)) {
            let word_start = before.trim_end().len() - p.len();
            if word_start == 0 || !joins(before[..word_start].chars().last().unwrap_or(' ')) {
                out.push(format!("{p} {number}"));
            }
        }
        i = j;
    }
    out
}

/// The unit that makes `number` a measured figure, as written after it.
fn unit_of(number: &str, after: &str) -> Option<String> {
    let spaced = after.strip_prefix(' ').or_else(|| after.strip_prefix('\u{a0}'));
    let gap = if spaced.is_some() { " " } else { "" };
    let rest = spaced.unwrap_or(after);
    let ends_word =
        |u: &str| rest.strip_prefix(u).is_some_and(|r| !r.starts_with(|c: char| c.is_alphanumeric()));
    let decimal = number.contains('.');
    let value: f64 = number.replace(',', "").parse().unwrap_or(0.0);
    if let Some(w) = RATE_WORDS.iter().find(|w| ends_word(w)) {
        return (!gap.is_empty()).then(|| format!(" {w}"));
    }
    if ends_word("/s") && (decimal || value >= 1000.0) {
        return Some(format!("{gap}/s"));
    }
    ["ms", "µs"].iter().find(|u| decimal && ends_word(u)).map(|u| format!("{gap}{u}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn figures(text: &str) -> Vec<String> {
        strays(text).into_iter().map(|s| s.figure).collect()
    }

    #[test]
    fn measured_figures_are_found() {
        assert_eq!(figures("agent decisions | 11,223/s, p99 4.23 ms |"), ["11,223/s", "4.23 ms"]);
        assert_eq!(
            figures("(16 streams: 17,254 decisions/s, p99 1.72 ms)"),
            ["17,254 decisions/s", "1.72 ms"]
        );
        assert_eq!(figures("pgbench ran 613 tps"), ["613 tps"]);
        assert_eq!(figures("the HTTP floor has p99 2.0–3.5 ms"), ["p99 2.0", "3.5 ms"]);
        assert_eq!(figures("agent's own work is 8.3 µs"), ["8.3 µs"]);
        assert_eq!(figures("about 1500/s"), ["1500/s"]);
        assert_eq!(figures("grants | 331/s, p99 421 ms"), ["p99 421"]);
    }

    #[test]
    fn configuration_and_names_pass() {
        for ok in [
            "drives skewed traffic (eu 90/s, us 30/s)",
            "at most 500 ms between single probes, 20 ms apart",
            "`GET /v1/status` and `acquire.c16.p99_ms`",
            "a per-user cap of 8/s per user",
            "--acquire-wait-ms 100",
            "limit 1,000 per minute, p99 target ≤ 1 ms",
            "rls.c16.decisions_per_s",
        ] {
            assert_eq!(figures(ok), Vec::<String>::new(), "{ok}");
        }
    }

    #[test]
    fn code_fences_are_skipped_and_lines_counted() {
        let text = "one\n```text\n11,223/s\n```\nfour 2.5 ms\n";
        assert_eq!(strays(text), vec![Stray { line: 5, figure: "2.5 ms".into() }]);
    }
}
