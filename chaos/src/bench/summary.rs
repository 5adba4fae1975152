//! The README's performance table (the `performance` generated block): the
//! headline figures of one published run, each beside what the same run
//! measured for comparison, and the targets of issue 6. A pure function of
//! the report; `table` renders every figure for `docs/benchmarks.md`.

use super::report::BenchReport;
use super::Plan;
use crate::figures::number::{count, ratio, sig};
use std::fmt::Write as _;

const NOT_MEASURED: &str = "not measured";

/// `rate/s, p99 x ms` of a measurement whose keys start with `prefix`.
fn rate_p99(r: &BenchReport, prefix: &str, per_s: &str) -> String {
    rate_p99_of(r, &format!("{prefix}.{per_s}"), &format!("{prefix}.p99_ms"))
}

/// `rate/s, p99 x ms` from two keys.
fn rate_p99_of(r: &BenchReport, rate: &str, p99: &str) -> String {
    match (r.get(rate), r.get(p99)) {
        (Some(n), Some(p)) => format!("{}/s, p99 {} ms", count(n), sig(p)),
        (Some(n), None) => format!("{}/s", count(n)),
        _ => NOT_MEASURED.into(),
    }
}

/// `key` as a ratio, or "not measured".
fn ratio_of(r: &BenchReport, key: &str) -> String {
    r.get(key).map(ratio).unwrap_or_else(|| NOT_MEASURED.into())
}

/// `key` formatted by `f`, or "not measured".
fn fig(r: &BenchReport, key: &str, f: impl Fn(f64) -> String) -> String {
    r.get(key).map(f).unwrap_or_else(|| NOT_MEASURED.into())
}

/// The target column: the bound of each `(key, before, after)` as the
/// report states it, written `{before}{bound}{after}`, and whether all
/// were met.
fn goal(r: &BenchReport, keys: &[(&str, &str, &str)]) -> String {
    let rows: Vec<_> = keys.iter().filter_map(|(k, b, a)| r.target(k).map(|t| (t, b, a))).collect();
    if rows.len() != keys.len() {
        return String::new();
    }
    let bounds: Vec<String> = rows.iter().map(|(t, b, a)| format!("{b}{}{a}", t.target)).collect();
    let verdict = if rows.iter().any(|(t, _, _)| t.value.is_none()) {
        NOT_MEASURED
    } else if rows.iter().all(|(t, _, _)| t.met) {
        "met"
    } else {
        "missed"
    };
    format!("{}: {verdict}", bounds.join("; "))
}

/// The block's text (a paragraph naming the run, then the table).
pub fn performance(r: &BenchReport) -> String {
    let plan = Plan::named(&r.mode);
    let m = &r.machine;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "From `{}` of {} ({} mode, medians of {} repetitions, {} s) on {} × {}, {} MiB, load average at \
         the start {}; each figure beside what the same run measured for comparison. Every table, the \
         method and the notes: `docs/benchmarks.md`.\n",
        r.command,
        m.date_utc,
        r.mode,
        r.repetitions,
        count(r.seconds),
        m.nproc,
        m.cpu_model,
        m.mem_total_mb,
        m.load_avg_at_start
    );
    let _ = writeln!(s, "| measure | value | beside, same run | target |");
    let _ = writeln!(s, "|---|---|---|---|");
    let mut row = |a: String, b: String, c: String, d: String| {
        let _ = writeln!(s, "| {a} | {b} | {c} | {d} |");
    };
    for c in super::acquire::CLIENTS {
        let k = |x: &str| format!("acquire.c{c}.{x}");
        let target = if c == 16 { goal(r, &[("acquire.c16.p99_ms", "p99 ", " ms")]) } else { String::new() };
        row(
            format!("agent decisions, {c} client{}", if c == 1 { "" } else { "s" }),
            rate_p99(r, &format!("acquire.c{c}"), "decisions_per_s"),
            format!(
                "spend script (ceiling) {}/s; `/healthz` (HTTP floor) {}",
                fig(r, &k("ceiling_per_s"), count),
                rate_p99_of(r, &k("http_floor_per_s"), &k("http_floor_p99_ms"))
            ),
            target,
        );
    }
    row(
        "agent / bare spend script, 16 clients".into(),
        ratio_of(r, "acquire.c16.ratio_to_ceiling"),
        String::new(),
        goal(r, &[("acquire.c16.ratio_to_ceiling", "", "")]),
    );
    row(
        "agent / limitador crate on the same Redis, 16 clients".into(),
        ratio_of(r, "acquire.c16.ratio_to_limitador"),
        format!("limitador (in-process, no HTTP hop) {}", rate_p99(r, "acquire.c16", "limitador_per_s")),
        goal(r, &[("acquire.c16.ratio_to_limitador", "", "")]),
    );
    for (case, what) in
        [("q10k", format!("{} quotas", count(plan.many_quotas as f64))), ("hot", "1 hot quota".into())]
    {
        let k = |x: &str| format!("grants.c64.{case}.{x}");
        row(
            format!("grants, 64 agents, {what}, 1 allocator"),
            rate_p99(r, &format!("grants.c64.{case}.r1"), "grants_per_s"),
            format!(
                "pgbench {} tps (ratio {}); 2 allocators {}",
                fig(r, &format!("grants.c64.pgbench.{case}.tps"), count),
                ratio_of(r, &k("r1.ratio_to_ceiling")),
                rate_p99(r, &format!("grants.c64.{case}.r2"), "grants_per_s")
            ),
            String::new(),
        );
    }
    row(
        format!("grants in batches of 64, {} agents, 1 allocator", super::grants::BATCH_AGENTS),
        rate_p99(r, "grants.batch.b64", "grants_per_s"),
        format!(
            "batches of 16 {}; of 1 {} (p99 per request)",
            rate_p99(r, "grants.batch.b16", "grants_per_s"),
            rate_p99(r, "grants.batch.b1", "grants_per_s")
        ),
        String::new(),
    );
    row(
        "allocator calls per 1,000 admits".into(),
        fig(r, "renewals_per_1000_admits", sig),
        match (r.get("renewal.grant_calls"), r.get("renewal.admits")) {
            (Some(calls), Some(admits)) => format!(
                "{} grant calls for {} admits, steady {} requests a second",
                count(calls),
                count(admits),
                count(plan.steady_rate)
            ),
            _ => String::new(),
        },
        goal(r, &[("renewals_per_1000_admits", "", "")]),
    );
    row(
        "utilization skew / contention: admitted / min(G, demand)".into(),
        format!("{} % / {} %", fig(r, "utilization.skew", sig), fig(r, "utilization.contention", sig)),
        format!(
            "skew: least-served region {} % of its demand; contention: share of admits within {} points of demand",
            fig(r, "utilization.skew.min_region_served_pct", sig),
            fig(r, "utilization.contention.max_share_gap_pts", sig)
        ),
        goal(
            r,
            &[
                ("utilization.skew", "", " %"),
                ("utilization.contention", "", " %"),
                ("utilization.skew.min_region_served_pct", "least-served ", " %"),
                ("utilization.contention.max_share_gap_pts", "gap ", " points"),
            ],
        ),
    );
    row(
        "stranded per window, worst scenario".into(),
        format!("{} % of G", fig(r, "stranded_pct", sig)),
        String::new(),
        goal(r, &[("stranded_pct", "", " %")]),
    );
    let many = plan.scaling_quotas.last().copied().unwrap_or(0);
    row(
        format!("Redis per quota; allocator RSS at {} quotas", count(many as f64)),
        format!(
            "{} B; {} MiB",
            fig(r, "scaling.redis_bytes_per_quota", count),
            fig(r, &format!("scaling.q{many}.allocator_rss_mb"), sig)
        ),
        String::new(),
        String::new(),
    );
    let c = super::tls::CLIENTS;
    for (what, who, prefix, per_s, plain, tls, plain_name) in [
        (
            "agent decisions, Redis over `rediss://`",
            "clients",
            "acquire",
            "decisions_per_s",
            "redis_plain",
            "redis_tls",
            "`redis://`",
        ),
        ("grants, HTTPS with mTLS", "agents", "grants", "grants_per_s", "http", "https", "HTTP"),
    ] {
        row(
            format!("{what}, {c} {who}"),
            rate_p99(r, &format!("{prefix}.c{c}.{tls}"), per_s),
            format!(
                "{plain_name} {} (ratio {})",
                rate_p99(r, &format!("{prefix}.c{c}.{plain}"), per_s),
                ratio_of(r, &format!("{prefix}.c{c}.{tls}.ratio_to_{plain}"))
            ),
            String::new(),
        );
    }
    let c = super::acquire::PER_KEY_CLIENTS;
    let alone = format!(
        "one quota alone {}; ceiling {}/s",
        rate_p99(r, &format!("acquire.c{c}"), "decisions_per_s"),
        fig(r, &format!("acquire.c{c}.ceiling_per_s"), count)
    );
    for (what, case) in [
        ("one quota + a per-key bucket", "per_key"),
        ("two quotas + a per-key bucket each, one decision", "two_quotas_per_key"),
    ] {
        row(
            format!("{what}, {c} clients"),
            rate_p99(r, &format!("acquire.c{c}.{case}"), "decisions_per_s"),
            alone.clone(),
            String::new(),
        );
    }
    for c in super::acquire::CLIENTS {
        row(
            format!("Envoy RLS `ShouldRateLimit`, {c} stream{}", if c == 1 { "" } else { "s" }),
            rate_p99(r, &format!("rls.c{c}"), "decisions_per_s"),
            format!("HTTP acquire {}", rate_p99(r, &format!("acquire.c{c}"), "decisions_per_s")),
            String::new(),
        );
    }
    if r.notes.iter().any(|n| n.starts_with("limitador peer not measured")) {
        let _ = writeln!(
            s,
            "\nThe limitador peer was not measured in this run (see the notes in `docs/benchmarks.md`)."
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::machine::Machine;
    use crate::bench::table;

    fn report(values: &[(&str, f64)], notes: &[&str]) -> BenchReport {
        let mut r = BenchReport {
            command: "cargo lab bench --quick --no-peer".into(),
            argv: Vec::new(),
            mode: "quick".into(),
            repetitions: 3,
            machine: Machine {
                nproc: 2,
                cpu_model: "AMD EPYC".into(),
                mem_total_mb: 24_000,
                kernel: "6.18".into(),
                date_utc: "2026-12-05T08:30:00Z".into(),
                load_avg_at_start: "2.50 2.40 1.60".into(),
            },
            seconds: 301.2,
            results: values.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
            targets: Vec::new(),
            notes: notes.iter().map(|n| n.to_string()).collect(),
        };
        let mut results = crate::bench::Results::default();
        for (k, v) in values {
            results.set(k, *v);
        }
        r.targets = table::targets(&results);
        r
    }

    fn row<'a>(text: &'a str, starts: &str) -> &'a str {
        text.lines().find(|l| l.starts_with(starts)).unwrap_or_else(|| panic!("no row {starts:?} in\n{text}"))
    }

    #[test]
    fn figures_are_formatted_beside_their_ceilings_with_targets() {
        let r = report(
            &[
                ("acquire.c16.decisions_per_s", 11_223.4),
                ("acquire.c16.p99_ms", 4.227),
                ("acquire.c16.ceiling_per_s", 18_601.0),
                ("acquire.c16.http_floor_per_s", 23_009.0),
                ("acquire.c16.http_floor_p99_ms", 3.477),
                ("acquire.c16.ratio_to_ceiling", 0.6034),
                ("renewals_per_1000_admits", 2.918),
                ("grants.batch.b64.grants_per_s", 2_773.88),
                ("grants.batch.b64.p99_ms", 414.98),
                ("grants.batch.b16.grants_per_s", 2_795.76),
                ("grants.batch.b16.p99_ms", 113.66),
            ],
            &["limitador peer not measured: --no-peer"],
        );
        let text = performance(&r);
        assert!(text.starts_with(
            "From `cargo lab bench --quick --no-peer` of 2026-12-05T08:30:00Z (quick mode, medians of 3 \
             repetitions, 301 s) on 2 × AMD EPYC, 24000 MiB, load average at the start 2.50 2.40 1.60;"
        ));
        assert_eq!(
            row(&text, "| agent decisions, 16 clients |"),
            "| agent decisions, 16 clients | 11,223/s, p99 4.23 ms | spend script (ceiling) 18,601/s; \
             `/healthz` (HTTP floor) 23,009/s, p99 3.48 ms | p99 ≤ 1 ms: missed |"
        );
        assert_eq!(
            row(&text, "| agent / bare spend script"),
            "| agent / bare spend script, 16 clients | 0.60 |  | ≥ 0.5: met |"
        );
        assert_eq!(
            row(&text, "| agent / limitador"),
            "| agent / limitador crate on the same Redis, 16 clients | not measured | limitador (in-process, \
             no HTTP hop) not measured | ≥ 1: not measured |"
        );
        assert_eq!(
            row(&text, "| grants in batches of 64"),
            "| grants in batches of 64, 16 agents, 1 allocator | 2,774/s, p99 415 ms | batches of 16 \
             2,796/s, p99 114 ms; of 1 not measured (p99 per request) |  |"
        );
        assert_eq!(
            row(&text, "| allocator calls per 1,000 admits |"),
            "| allocator calls per 1,000 admits | 2.92 |  | ≤ 10: met |"
        );
        assert!(text.ends_with(
            "The limitador peer was not measured in this run (see the notes in `docs/benchmarks.md`).\n"
        ));
    }

    #[test]
    fn the_benchmarks_page_shows_the_run_and_every_table() {
        let r = report(&[("acquire.c16.decisions_per_s", 11_223.4)], &["a note"]);
        let text = table::body(&r);
        assert!(text.starts_with(
            "Command: `cargo lab bench --quick --no-peer` (quick mode, medians of 3 repetitions) — \
             2026-12-05T08:30:00Z — 2 × AMD EPYC, 24000 MiB, Linux 6.18, load at start 2.50 2.40 1.60\n"
        ));
        assert!(text.contains("| 16 | 11223 | – |"), "{text}");
        assert!(text.contains("| 10000 | 1 | – |"), "the quick plan's many-quotas label: {text}");
        assert!(text.ends_with("## Notes\n\n- a note\n"));
        assert_eq!(table::markdown(&r), format!("# Benchmarks\n\n{text}"));
    }
}
