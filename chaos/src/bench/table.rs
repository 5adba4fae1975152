//! The report as Markdown tables, and the targets of issue 6 checked
//! against the measured figures.

use super::report::{BenchReport, TargetRow};
use super::view::cell;
use super::{acquire, envoy, grants, renewal, tls, utilization};
use super::{Plan, Results};
use std::fmt::Write as _;

/// Every target with its key, bound and direction (`true`: at least).
const TARGETS: [(&str, &str, f64, bool); 9] = [
    ("acquire.c16.p99_ms", "agent decision p99 at 16 clients (ms)", 1.0, false),
    ("acquire.c16.ratio_to_ceiling", "agent / bare spend script at 16 clients", 0.5, true),
    ("acquire.c16.ratio_to_limitador", "agent / limitador on the same Redis at 16 clients", 1.0, true),
    ("renewals_per_1000_admits", "allocator calls per 1,000 admits", 10.0, false),
    ("utilization.skew", "skew: admitted / min(G, demand) (%)", 99.0, true),
    ("utilization.contention", "contention: admitted / min(G, demand) (%)", 99.0, true),
    ("stranded_pct", "stranded per window, worst scenario (% of G)", 2.0, false),
    ("utilization.skew.min_region_served_pct", "skew: least-served region (% of its demand)", 98.0, true),
    (
        "utilization.contention.max_share_gap_pts",
        "contention: share of admits vs demand (points)",
        10.0,
        false,
    ),
];

/// The targets checked against `r`.
pub fn targets(r: &Results) -> Vec<TargetRow> {
    TARGETS
        .iter()
        .map(|(key, what, bound, at_least)| {
            let value = r.get(key);
            let met = value.is_some_and(|v| if *at_least { v >= *bound } else { v <= *bound });
            let target = format!("{} {bound}", if *at_least { "≥" } else { "≤" });
            TargetRow { key: key.to_string(), what: what.to_string(), value, target, met }
        })
        .collect()
}

/// The whole report (`report.md`).
pub fn markdown(r: &BenchReport) -> String {
    format!("# Benchmarks\n\n{}", body(r))
}

/// Every table of the report, under `##` headings: the body of
/// `report.md` and the generated block of `docs/benchmarks.md`. Labels
/// that depend on the mode (the many-quotas count, the steady rate) come
/// from the plan of the report's mode.
pub fn body(r: &BenchReport) -> String {
    let plan = Plan::named(&r.mode);
    let m = &r.machine;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "Command: `{}` ({} mode, medians of {} repetitions) — {} — {} × {}, {} MiB, Linux {}, load at start {}\n",
        r.command,
        r.mode,
        r.repetitions,
        m.date_utc,
        m.nproc,
        m.cpu_model,
        m.mem_total_mb,
        m.kernel,
        m.load_avg_at_start
    );

    decisions(&mut s);
    decisions_table(&mut s, r);
    rls_table(&mut s, r);
    envoy_table(&mut s, r);
    stages_table(&mut s, r);
    grants_table(&mut s, r, &plan);
    batch_table(&mut s, r, &plan);
    tls_table(&mut s, r);
    scaling_table(&mut s, r, &plan);

    let _ = writeln!(s, "\n## Targets\n");
    let _ = writeln!(s, "| target | value | required | met |");
    let _ = writeln!(s, "|---|---|---|---|");
    for t in &r.targets {
        let _ = writeln!(
            s,
            "| {} (`{}`) | {} | {} | {} |",
            t.what,
            t.key,
            cell(r.get(&t.key)),
            t.target,
            match (t.met, t.value) {
                (true, _) => "yes",
                (false, Some(_)) => "**no**",
                (false, None) => "not measured",
            }
        );
    }
    if !r.notes.is_empty() {
        let _ = writeln!(s, "\n## Notes\n");
        for n in &r.notes {
            let _ = writeln!(s, "- {n}");
        }
    }
    s
}

fn decisions(s: &mut String) {
    let _ = writeln!(s, "## Agent decisions (`POST /v1/acquire`, warm lease, keep-alive clients)\n");
}

/// The acquire part at each client count, beside its ceilings.
fn decisions_table(s: &mut String, r: &BenchReport) {
    let _ = writeln!(
        s,
        "| clients | decisions/s | p50 ms | p99 ms | p99.9 ms | spend script/s (ceiling) | script p50 ms | script p99 ms | ratio to ceiling | `/healthz`/s (HTTP floor) | floor p50 ms | floor p99 ms | limitador/s | limitador p99 ms | ratio to limitador |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for c in acquire::CLIENTS {
        let m = acquire::Measured::at(r, c);
        let cells = [
            m.decisions_per_s,
            m.p50_ms,
            m.p99_ms,
            m.p999_ms,
            m.ceiling_per_s,
            m.ceiling_p50_ms,
            m.ceiling_p99_ms,
            m.ratio_to_ceiling,
            m.http_floor_per_s,
            m.http_floor_p50_ms,
            m.http_floor_p99_ms,
            m.limitador_per_s,
            m.limitador_p99_ms,
            m.ratio_to_limitador,
        ];
        let _ = writeln!(s, "| {c} | {} |", cells.map(cell).join(" | "));
    }
    let c = acquire::PER_KEY_CLIENTS;
    let m = acquire::Measured::at(r, c);
    let _ = writeln!(
        s,
        "\nWith a per-key bucket (issue 17: the same quota and one bucket per client, checked first in the \
         same script run), {c} clients: {} decisions/s, p50 {} ms, p99 {} ms (`acquire.c{c}.per_key.*`), \
         and with two quotas of the tenant each with a per-key bucket in one atomic decision \
         (`resources`, `acquire.c{c}.two_quotas_per_key.*`): {} decisions/s, p50 {} ms, p99 {} ms; \
         beside one quota alone {} decisions/s, p99 {} ms and the spend-script ceiling {}/s of the same run.",
        cell(m.per_key.decisions_per_s),
        cell(m.per_key.p50_ms),
        cell(m.per_key.p99_ms),
        cell(m.two_quotas_per_key.decisions_per_s),
        cell(m.two_quotas_per_key.p50_ms),
        cell(m.two_quotas_per_key.p99_ms),
        cell(m.decisions_per_s),
        cell(m.p99_ms),
        cell(m.ceiling_per_s),
    );
}

/// Envoy's rate limit service beside HTTP acquire of the same run.
fn rls_table(s: &mut String, r: &BenchReport) {
    let _ = writeln!(
        s,
        "\nEnvoy's rate limit service on the same agent (issue 18: `ShouldRateLimit`, one descriptor \
         naming the same quota, one HTTP/2 connection with one stream per client, the request \
         framed once and sent with its headers in one write as Envoy sends it, \
         `rls.c<n>.*`), beside HTTP acquire of the same run:\n"
    );
    let _ = writeln!(
        s,
        "| streams | RLS decisions/s | RLS p50 ms | RLS p99 ms | gRPC floor (Health/Check) /s | gRPC floor p99 ms | HTTP acquire decisions/s | HTTP p99 ms | RLS / HTTP | agent CPU µs per decision, RLS / HTTP |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|---|");
    for c in acquire::CLIENTS {
        let (g, h) = (acquire::RlsMeasured::at(r, c), acquire::Measured::at(r, c));
        let ratio = match (g.decisions_per_s, h.decisions_per_s) {
            (Some(g), Some(h)) if h > 0.0 => format!("{:.2}", g / h),
            _ => "–".into(),
        };
        let _ = writeln!(
            s,
            "| {c} | {} | {} | {} | {} | {} | {} | {} | {ratio} | {} / {} |",
            cell(g.decisions_per_s),
            cell(g.p50_ms),
            cell(g.p99_ms),
            cell(g.grpc_floor.per_s),
            cell(g.grpc_floor.p99_ms),
            cell(h.decisions_per_s),
            cell(h.p99_ms),
            cell(g.agent_cpu_us_per_decision),
            cell(h.agent_cpu_us_per_decision),
        );
    }
}

/// Requests through a real Envoy with and without the filter.
fn envoy_table(s: &mut String, r: &BenchReport) {
    let c = envoy::CONNECTIONS;
    let e = envoy::Measured::of(r);
    let _ = writeln!(
        s,
        "
Through Envoy (issue 33): one Envoy (1 worker thread) in front of a small upstream, {c} keep-alive connections, two routes that differ only in the rate limit filter asking the agent (`envoy.c{c}.*`):
"
    );
    let _ = writeln!(s, "| route | requests/s | p50 ms | p99 ms |");
    let _ = writeln!(s, "|---|---|---|---|");
    for (label, per_s, p50, p99) in [
        ("with the rate limit filter", e.with_filter_per_s, e.with_filter_p50_ms, e.with_filter_p99_ms),
        ("without it", e.without_filter_per_s, e.without_filter_p50_ms, e.without_filter_p99_ms),
    ] {
        let _ = writeln!(s, "| {label} | {} | {} | {} |", cell(per_s), cell(p50), cell(p99));
    }
    let _ = writeln!(
        s,
        "
With / without the filter: {}; the agent's CPU per decision on that path: {} µs.",
        cell(e.filter_ratio),
        cell(e.agent_cpu_us_per_decision)
    );
}

/// Where a decision's time goes, by the agent's own histograms.
fn stages_table(s: &mut String, r: &BenchReport) {
    let _ = writeln!(s, "\n### Where a decision's time goes (means per decision, µs)\n");
    let _ = writeln!(
        s,
        "Client mean latency split by the agent's own histograms (`agent_acquire_seconds`, \
         `agent_acquire_store_seconds`, `agent_spend_runs_total`, read from `/metrics` around \
         each run). Concurrent decisions on one quota share a run of the spend script; the Redis \
         column is a decision's wait for the runs in flight plus its own run.\n"
    );
    let _ = writeln!(s, "| clients | client, loopback and HTTP outside the handler | agent's own work | waiting on the spend script (Redis) | decisions per script run |");
    let _ = writeln!(s, "|---|---|---|---|---|");
    for c in acquire::CLIENTS {
        let m = acquire::Measured::at(r, c);
        let _ = writeln!(
            s,
            "| {c} | {} | {} | {} | {} |",
            cell(m.stage.client_and_http_us),
            cell(m.stage.agent_us),
            cell(m.stage.redis_us),
            cell(m.decisions_per_script_run),
        );
    }
}

/// The allocator's grants beside pgbench with the same shape.
fn grants_table(s: &mut String, r: &BenchReport, plan: &Plan) {
    let _ = writeln!(s, "\n## Allocator grants (64 concurrent agents, want 1)\n");
    let _ = writeln!(
        s,
        "| quotas | replicas | grants/s | p50 ms | p99 ms | pgbench tps (ceiling) | ratio to ceiling |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|---|");
    for (case, quotas, replicas, pg) in [
        ("hot.r1", "1 hot".to_string(), 1, "hot"),
        ("hot.r2", "1 hot".to_string(), 2, "hot"),
        ("q10k.r1", format!("{}", plan.many_quotas), 1, "q10k"),
        ("q10k.r2", format!("{}", plan.many_quotas), 2, "q10k"),
    ] {
        let m = grants::Measured::of(r, case);
        let _ = writeln!(
            s,
            "| {quotas} | {replicas} | {} | {} | {} | {} | {} |",
            cell(m.grants_per_s),
            cell(m.p50_ms),
            cell(m.p99_ms),
            cell(grants::Pgbench::of(r, pg).tps),
            cell(m.ratio_to_ceiling),
        );
    }
}

/// Grants asked for in batches (`POST /v1/grants` with `items`).
fn batch_table(s: &mut String, r: &BenchReport, plan: &Plan) {
    let b = grants::BATCH_AGENTS;
    let _ = writeln!(
        s,
        "\n## Allocator grants in batches ({b} concurrent agents, {} quotas, 1 replica)\n",
        plan.many_quotas
    );
    let _ = writeln!(s, "| items per request | grants/s | p50 ms (request) | p99 ms (request) |");
    let _ = writeln!(s, "|---|---|---|---|");
    for size in grants::BATCH_SIZES {
        let m = grants::Measured::batch(r, size);
        let _ =
            writeln!(s, "| {size} | {} | {} | {} |", cell(m.grants_per_s), cell(m.p50_ms), cell(m.p99_ms));
    }
}

/// Each link with TLS beside plain.
fn tls_table(s: &mut String, r: &BenchReport) {
    let c = tls::CLIENTS;
    let _ = writeln!(s, "\n## TLS beside plain ({c} clients, same run, keep-alive connections)\n");
    let _ = writeln!(s, "| link | plain /s | plain p50 ms | plain p99 ms | TLS /s | TLS p50 ms | TLS p99 ms | TLS / plain throughput |");
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|");
    for (what, part, plain, secure) in [
        ("agent decisions, Redis `redis://` vs `rediss://`", "acquire", "redis_plain", "redis_tls"),
        ("allocator grants, HTTP vs HTTPS with mTLS", "grants", "http", "https"),
    ] {
        let (p, t) = (tls::Side::of(r, part, plain), tls::Side::of(r, part, secure));
        let _ = writeln!(
            s,
            "| {what} | {} | {} | {} | {} | {} | {} | {} |",
            cell(p.per_s()),
            cell(p.p50_ms),
            cell(p.p99_ms),
            cell(t.per_s()),
            cell(t.p50_ms),
            cell(t.p99_ms),
            cell(t.ratio_to_redis_plain.or(t.ratio_to_http)),
        );
    }
}

/// Renewal cost, utilization and what grows with the number of quotas.
fn scaling_table(s: &mut String, r: &BenchReport, plan: &Plan) {
    let _ = writeln!(s, "\n## Renewal cost, utilization, scaling\n");
    let _ = writeln!(s, "| measure | value |");
    let _ = writeln!(s, "|---|---|");
    let renewal = renewal::Measured::of(r);
    let scaling = super::view::Scaling::of(r);
    let mut rows: Vec<(String, String)> = vec![
        (
            format!("allocator calls per 1,000 admits ({} req/s steady, default policy)", plan.steady_rate),
            cell(r.get("renewals_per_1000_admits")),
        ),
        (
            "grant calls / admits counted".into(),
            format!("{} / {}", cell(renewal.grant_calls), cell(renewal.admits)),
        ),
    ];
    for sc in ["skew", "contention"] {
        let u = utilization::Measured::of(r, sc);
        rows.push((format!("{sc}: admitted / min(G, demand) %"), cell(u.value)));
        rows.push((format!("{sc}: stranded per window, % of G"), cell(u.stranded_pct)));
        for region in utilization::REGIONS {
            let g = utilization::Region::of(r, sc, region);
            rows.push((
                format!("{sc}: region {region} served % / share of admits % / stranded % of G"),
                format!(
                    "{} / {} / {}",
                    cell(g.served_pct),
                    cell(g.share_of_admits_pct),
                    cell(g.stranded_pct)
                ),
            ));
        }
        rows.push((format!("{sc}: max gap share of admits vs demand (points)"), cell(u.max_share_gap_pts)));
        rows.push((format!("{sc}: quota-windows measured"), cell(u.quota_windows)));
    }
    rows.push((
        "Redis bytes per quota (MEMORY USAGE, summed over its keys)".into(),
        cell(scaling.redis_bytes_per_quota),
    ));
    rows.push((
        format!(
            "agent KiB per known quota (RSS growth over learned quotas; holds {})",
            cell(scaling.agent_quotas_held)
        ),
        cell(scaling.agent_kib_per_quota),
    ));
    for &n in &plan.scaling_quotas {
        let q = grants::AtQuotas::of(r, n);
        rows.push((format!("{n} quotas: allocator RSS MiB"), cell(q.allocator_rss_mb)));
        rows.push((format!("{n} quotas: grant p99 ms (64 agents, 1 replica)"), cell(q.grant_p99_ms)));
        rows.push((format!("{n} quotas: grants/s"), cell(q.grants_per_s)));
    }
    rows.push((
        format!(
            "ledger rows/s at {} admits/s on one quota (extrapolated ×3600 → per hour)",
            cell(renewal.admits_per_s)
        ),
        format!("{} → {}", cell(scaling.ledger_rows_per_s), cell(scaling.ledger_rows_per_hour)),
    ));
    rows.push(("ledger rows per grant (whole run)".into(), cell(scaling.ledger_rows_per_grant)));
    for (a, b) in rows {
        let _ = writeln!(s, "| {a} | {b} |");
    }
}
