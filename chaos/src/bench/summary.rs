//! The README's performance table (the `performance` generated block): the
//! headline figures of one published run, each beside what the same run
//! measured for comparison, and the targets of issue 6. A pure function of
//! the report; `table` renders every figure for `docs/benchmarks.md`.

use super::report::BenchReport;
use super::{acquire, grants, renewal, tls, utilization, Plan};
use crate::figures::number::{count, ratio, sig};
use std::fmt::Write as _;

const NOT_MEASURED: &str = "not measured";

/// `rate/s, p99 x ms`, or "not measured".
fn rate_p99(rate: Option<f64>, p99: Option<f64>) -> String {
    match (rate, p99) {
        (Some(n), Some(p)) => format!("{}/s, p99 {} ms", count(n), sig(p)),
        (Some(n), None) => format!("{}/s", count(n)),
        _ => NOT_MEASURED.into(),
    }
}

/// A ratio, or "not measured".
fn ratio_of(x: Option<f64>) -> String {
    x.map(ratio).unwrap_or_else(|| NOT_MEASURED.into())
}

/// A figure formatted by `f`, or "not measured".
fn fig(x: Option<f64>, f: impl Fn(f64) -> String) -> String {
    x.map(f).unwrap_or_else(|| NOT_MEASURED.into())
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
    for c in acquire::CLIENTS {
        let m = acquire::Measured::at(r, c);
        let target = if c == 16 { goal(r, &[("acquire.c16.p99_ms", "p99 ", " ms")]) } else { String::new() };
        row(
            format!("agent decisions, {c} client{}", if c == 1 { "" } else { "s" }),
            rate_p99(m.decisions_per_s, m.p99_ms),
            format!(
                "spend script (ceiling) {}/s; `/healthz` (HTTP floor) {}",
                fig(m.ceiling_per_s, count),
                rate_p99(m.http_floor_per_s, m.http_floor_p99_ms)
            ),
            target,
        );
    }
    let c16 = acquire::Measured::at(r, 16);
    row(
        "agent / bare spend script, 16 clients".into(),
        ratio_of(c16.ratio_to_ceiling),
        String::new(),
        goal(r, &[("acquire.c16.ratio_to_ceiling", "", "")]),
    );
    row(
        "agent / limitador crate on the same Redis, 16 clients".into(),
        ratio_of(c16.ratio_to_limitador),
        format!(
            "limitador (in-process, no HTTP hop) {}",
            rate_p99(c16.limitador_per_s, c16.limitador_p99_ms)
        ),
        goal(r, &[("acquire.c16.ratio_to_limitador", "", "")]),
    );
    for (case, what) in
        [("q10k", format!("{} quotas", count(plan.many_quotas as f64))), ("hot", "1 hot quota".into())]
    {
        let (r1, r2) =
            (grants::Measured::of(r, &format!("{case}.r1")), grants::Measured::of(r, &format!("{case}.r2")));
        row(
            format!("grants, 64 agents, {what}, 1 allocator"),
            rate_p99(r1.grants_per_s, r1.p99_ms),
            format!(
                "pgbench {} tps (ratio {}); 2 allocators {}",
                fig(grants::Pgbench::of(r, case).tps, count),
                ratio_of(r1.ratio_to_ceiling),
                rate_p99(r2.grants_per_s, r2.p99_ms)
            ),
            String::new(),
        );
    }
    let renewal = renewal::Measured::of(r);
    let batch = |size: usize| grants::Measured::batch(r, size);
    let (b64, b16, b1) = (batch(64), batch(16), batch(1));
    row(
        format!("grants in batches of 64, {} agents, 1 allocator", grants::BATCH_AGENTS),
        rate_p99(b64.grants_per_s, b64.p99_ms),
        format!(
            "batches of 16 {}; of 1 {} (p99 per request)",
            rate_p99(b16.grants_per_s, b16.p99_ms),
            rate_p99(b1.grants_per_s, b1.p99_ms)
        ),
        String::new(),
    );
    row(
        "allocator calls per 1,000 admits".into(),
        fig(r.get("renewals_per_1000_admits"), sig),
        match (renewal.grant_calls, renewal.admits) {
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
    let (skew, contention) =
        (utilization::Measured::of(r, "skew"), utilization::Measured::of(r, "contention"));
    row(
        "utilization skew / contention: admitted / min(G, demand)".into(),
        format!("{} % / {} %", fig(skew.value, sig), fig(contention.value, sig)),
        format!(
            "skew: least-served region {} % of its demand; contention: share of admits within {} points of demand",
            fig(skew.min_region_served_pct, sig),
            fig(contention.max_share_gap_pts, sig)
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
        format!("{} % of G", fig(r.get("stranded_pct"), sig)),
        String::new(),
        goal(r, &[("stranded_pct", "", " %")]),
    );
    let many = plan.scaling_quotas.last().copied().unwrap_or(0);
    row(
        format!("Redis per quota; allocator RSS at {} quotas", count(many as f64)),
        format!(
            "{} B; {} MiB",
            fig(super::view::Scaling::of(r).redis_bytes_per_quota, count),
            fig(grants::AtQuotas::of(r, many).allocator_rss_mb, sig)
        ),
        String::new(),
        String::new(),
    );
    let c = tls::CLIENTS;
    for (what, who, part, plain, secure, plain_name) in [
        (
            "agent decisions, Redis over `rediss://`",
            "clients",
            "acquire",
            "redis_plain",
            "redis_tls",
            "`redis://`",
        ),
        ("grants, HTTPS with mTLS", "agents", "grants", "http", "https", "HTTP"),
    ] {
        let (p, t) = (tls::Side::of(r, part, plain), tls::Side::of(r, part, secure));
        row(
            format!("{what}, {c} {who}"),
            rate_p99(t.per_s(), t.p99_ms),
            format!(
                "{plain_name} {} (ratio {})",
                rate_p99(p.per_s(), p.p99_ms),
                ratio_of(t.ratio_to_redis_plain.or(t.ratio_to_http))
            ),
            String::new(),
        );
    }
    let c = acquire::PER_KEY_CLIENTS;
    let m = acquire::Measured::at(r, c);
    let alone = format!(
        "one quota alone {}; ceiling {}/s",
        rate_p99(m.decisions_per_s, m.p99_ms),
        fig(m.ceiling_per_s, count)
    );
    for (what, case) in [
        ("one quota + a per-key bucket", m.per_key),
        ("two quotas + a per-key bucket each, one decision", m.two_quotas_per_key),
    ] {
        row(
            format!("{what}, {c} clients"),
            rate_p99(case.decisions_per_s, case.p99_ms),
            alone.clone(),
            String::new(),
        );
    }
    for c in acquire::CLIENTS {
        let (g, h) = (acquire::RlsMeasured::at(r, c), acquire::Measured::at(r, c));
        row(
            format!("Envoy RLS `ShouldRateLimit`, {c} stream{}", if c == 1 { "" } else { "s" }),
            rate_p99(g.decisions_per_s, g.p99_ms),
            format!("HTTP acquire {}", rate_p99(h.decisions_per_s, h.p99_ms)),
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
