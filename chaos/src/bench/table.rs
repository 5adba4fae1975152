//! The report as Markdown tables, and the targets of issue 6 checked
//! against the measured figures.

use super::report::BenchReport;
use super::{Plan, Results};
use serde::{Deserialize, Serialize};
use std::fmt::Write as _;

/// One target and whether the run met it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TargetRow {
    pub key: String,
    pub what: String,
    pub value: Option<f64>,
    pub target: String,
    pub met: bool,
}

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

fn v(r: &BenchReport, key: &str) -> String {
    match r.get(key) {
        Some(x) if x.abs() >= 100.0 => format!("{x:.0}"),
        Some(x) if x.abs() >= 10.0 => format!("{x:.1}"),
        Some(x) => format!("{x:.3}"),
        None => "–".into(),
    }
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

    let _ = writeln!(s, "## Agent decisions (`POST /v1/acquire`, warm lease, keep-alive clients)\n");
    let _ = writeln!(
        s,
        "| clients | decisions/s | p50 ms | p99 ms | p99.9 ms | spend script/s (ceiling) | script p50 ms | script p99 ms | ratio to ceiling | `/healthz`/s (HTTP floor) | floor p50 ms | floor p99 ms | limitador/s | limitador p99 ms | ratio to limitador |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for c in super::acquire::CLIENTS {
        let k = |x: &str| format!("acquire.c{c}.{x}");
        let _ = writeln!(
            s,
            "| {c} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            v(r, &k("decisions_per_s")),
            v(r, &k("p50_ms")),
            v(r, &k("p99_ms")),
            v(r, &k("p999_ms")),
            v(r, &k("ceiling_per_s")),
            v(r, &k("ceiling_p50_ms")),
            v(r, &k("ceiling_p99_ms")),
            v(r, &k("ratio_to_ceiling")),
            v(r, &k("http_floor_per_s")),
            v(r, &k("http_floor_p50_ms")),
            v(r, &k("http_floor_p99_ms")),
            v(r, &k("limitador_per_s")),
            v(r, &k("limitador_p99_ms")),
            v(r, &k("ratio_to_limitador")),
        );
    }

    let c = super::acquire::PER_KEY_CLIENTS;
    let k = |x: &str| format!("acquire.c{c}.{x}");
    let _ = writeln!(
        s,
        "\nWith a per-key bucket (issue 17: the same quota and one bucket per client, checked first in the \
         same script run), {c} clients: {} decisions/s, p50 {} ms, p99 {} ms (`acquire.c{c}.per_key.*`), \
         and with two quotas of the tenant each with a per-key bucket in one atomic decision \
         (`resources`, `acquire.c{c}.two_quotas_per_key.*`): {} decisions/s, p50 {} ms, p99 {} ms; \
         beside one quota alone {} decisions/s, p99 {} ms and the spend-script ceiling {}/s of the same run.",
        v(r, &k("per_key.decisions_per_s")),
        v(r, &k("per_key.p50_ms")),
        v(r, &k("per_key.p99_ms")),
        v(r, &k("two_quotas_per_key.decisions_per_s")),
        v(r, &k("two_quotas_per_key.p50_ms")),
        v(r, &k("two_quotas_per_key.p99_ms")),
        v(r, &k("decisions_per_s")),
        v(r, &k("p99_ms")),
        v(r, &k("ceiling_per_s")),
    );

    let _ = writeln!(
        s,
        "\nEnvoy's rate limit service on the same agent (issue 18: `ShouldRateLimit`, one descriptor \
         naming the same quota, one HTTP/2 connection with one stream per client, \
         `rls.c<n>.*`), beside HTTP acquire of the same run:\n"
    );
    let _ = writeln!(
        s,
        "| streams | RLS decisions/s | RLS p50 ms | RLS p99 ms | gRPC floor (Health/Check) /s | gRPC floor p99 ms | HTTP acquire decisions/s | HTTP p99 ms | RLS / HTTP | agent CPU µs per decision, RLS / HTTP |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|---|");
    for c in super::acquire::CLIENTS {
        let ratio = match (
            r.get(&format!("rls.c{c}.decisions_per_s")),
            r.get(&format!("acquire.c{c}.decisions_per_s")),
        ) {
            (Some(g), Some(h)) if h > 0.0 => format!("{:.2}", g / h),
            _ => "–".into(),
        };
        let _ = writeln!(
            s,
            "| {c} | {} | {} | {} | {} | {} | {} | {} | {ratio} | {} / {} |",
            v(r, &format!("rls.c{c}.decisions_per_s")),
            v(r, &format!("rls.c{c}.p50_ms")),
            v(r, &format!("rls.c{c}.p99_ms")),
            v(r, &format!("rls.c{c}.grpc_floor.per_s")),
            v(r, &format!("rls.c{c}.grpc_floor.p99_ms")),
            v(r, &format!("acquire.c{c}.decisions_per_s")),
            v(r, &format!("acquire.c{c}.p99_ms")),
            v(r, &format!("rls.c{c}.agent_cpu_us_per_decision")),
            v(r, &format!("acquire.c{c}.agent_cpu_us_per_decision")),
        );
    }

    let c = super::envoy::CONNECTIONS;
    let e = |k: &str| v(r, &format!("envoy.c{c}.{k}"));
    let _ = writeln!(
        s,
        "
Through Envoy (issue 33): one Envoy (1 worker thread) in front of a small upstream, {c} keep-alive connections, two routes that differ only in the rate limit filter asking the agent (`envoy.c{c}.*`):
"
    );
    let _ = writeln!(s, "| route | requests/s | p50 ms | p99 ms |");
    let _ = writeln!(s, "|---|---|---|---|");
    for (label, k) in [("with the rate limit filter", "with_filter"), ("without it", "without_filter")] {
        let _ = writeln!(
            s,
            "| {label} | {} | {} | {} |",
            e(&format!("{k}_per_s")),
            e(&format!("{k}_p50_ms")),
            e(&format!("{k}_p99_ms"))
        );
    }
    let _ = writeln!(
        s,
        "
With / without the filter: {}; the agent's CPU per decision on that path: {} µs.",
        e("filter_ratio"),
        e("agent_cpu_us_per_decision")
    );

    let _ = writeln!(s, "\n### Where a decision's time goes (means per decision, µs)\n");
    let _ = writeln!(
        s,
        "Client mean latency split by the agent's own histograms (`agent_acquire_seconds`, \
         `agent_acquire_store_seconds`, `agent_spend_runs_total`, read from `/metrics` around \
         each run). Concurrent decisions on one quota share a run of the spend script; the Redis \
         column is a decision's wait for the run in flight plus its own run.\n"
    );
    let _ = writeln!(s, "| clients | client, loopback and HTTP outside the handler | agent's own work | waiting on the spend script (Redis) | decisions per script run |");
    let _ = writeln!(s, "|---|---|---|---|---|");
    for c in super::acquire::CLIENTS {
        let k = |x: &str| format!("acquire.c{c}.stage.{x}");
        let _ = writeln!(
            s,
            "| {c} | {} | {} | {} | {} |",
            v(r, &k("client_and_http_us")),
            v(r, &k("agent_us")),
            v(r, &k("redis_us")),
            v(r, &format!("acquire.c{c}.decisions_per_script_run")),
        );
    }

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
        let k = |x: &str| format!("grants.c64.{case}.{x}");
        let _ = writeln!(
            s,
            "| {quotas} | {replicas} | {} | {} | {} | {} | {} |",
            v(r, &k("grants_per_s")),
            v(r, &k("p50_ms")),
            v(r, &k("p99_ms")),
            v(r, &format!("grants.c64.pgbench.{pg}.tps")),
            v(r, &k("ratio_to_ceiling")),
        );
    }

    let b = super::grants::BATCH_AGENTS;
    let _ = writeln!(
        s,
        "\n## Allocator grants in batches ({b} concurrent agents, {} quotas, 1 replica)\n",
        plan.many_quotas
    );
    let _ = writeln!(s, "| items per request | grants/s | p50 ms (request) | p99 ms (request) |");
    let _ = writeln!(s, "|---|---|---|---|");
    for size in super::grants::BATCH_SIZES {
        let k = |x: &str| format!("grants.batch.b{size}.{x}");
        let _ = writeln!(
            s,
            "| {size} | {} | {} | {} |",
            v(r, &k("grants_per_s")),
            v(r, &k("p50_ms")),
            v(r, &k("p99_ms")),
        );
    }

    let c = super::tls::CLIENTS;
    let _ = writeln!(s, "\n## TLS beside plain ({c} clients, same run, keep-alive connections)\n");
    let _ = writeln!(s, "| link | plain /s | plain p50 ms | plain p99 ms | TLS /s | TLS p50 ms | TLS p99 ms | TLS / plain throughput |");
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|");
    for (what, prefix, per_s, plain, tls) in [
        (
            "agent decisions, Redis `redis://` vs `rediss://`",
            "acquire",
            "decisions_per_s",
            "redis_plain",
            "redis_tls",
        ),
        ("allocator grants, HTTP vs HTTPS with mTLS", "grants", "grants_per_s", "http", "https"),
    ] {
        let k = |side: &str, x: &str| format!("{prefix}.c{c}.{side}.{x}");
        let _ = writeln!(
            s,
            "| {what} | {} | {} | {} | {} | {} | {} | {} |",
            v(r, &k(plain, per_s)),
            v(r, &k(plain, "p50_ms")),
            v(r, &k(plain, "p99_ms")),
            v(r, &k(tls, per_s)),
            v(r, &k(tls, "p50_ms")),
            v(r, &k(tls, "p99_ms")),
            v(r, &k(tls, &format!("ratio_to_{plain}"))),
        );
    }

    let _ = writeln!(s, "\n## Renewal cost, utilization, scaling\n");
    let _ = writeln!(s, "| measure | value |");
    let _ = writeln!(s, "|---|---|");
    let mut rows: Vec<(String, String)> = vec![
        (
            format!("allocator calls per 1,000 admits ({} req/s steady, default policy)", plan.steady_rate),
            v(r, "renewals_per_1000_admits"),
        ),
        (
            "grant calls / admits counted".into(),
            format!("{} / {}", v(r, "renewal.grant_calls"), v(r, "renewal.admits")),
        ),
    ];
    for sc in ["skew", "contention"] {
        let k = |x: &str| format!("utilization.{sc}.{x}");
        rows.push((format!("{sc}: admitted / min(G, demand) %"), v(r, &format!("utilization.{sc}"))));
        rows.push((format!("{sc}: stranded per window, % of G"), v(r, &k("stranded_pct"))));
        for region in super::utilization::REGIONS {
            rows.push((
                format!("{sc}: region {region} served % / share of admits % / stranded % of G"),
                format!(
                    "{} / {} / {}",
                    v(r, &k(&format!("{region}.served_pct"))),
                    v(r, &k(&format!("{region}.share_of_admits_pct"))),
                    v(r, &k(&format!("{region}.stranded_pct")))
                ),
            ));
        }
        rows.push((
            format!("{sc}: max gap share of admits vs demand (points)"),
            v(r, &k("max_share_gap_pts")),
        ));
        rows.push((format!("{sc}: quota-windows measured"), v(r, &k("quota_windows"))));
    }
    rows.push((
        "Redis bytes per quota (MEMORY USAGE, summed over its keys)".into(),
        v(r, "scaling.redis_bytes_per_quota"),
    ));
    rows.push((
        format!(
            "agent KiB per known quota (RSS growth over learned quotas; holds {})",
            v(r, "scaling.agent_quotas_held")
        ),
        v(r, "scaling.agent_kib_per_quota"),
    ));
    for n in &plan.scaling_quotas {
        let k = |x: &str| format!("scaling.q{n}.{x}");
        rows.push((format!("{n} quotas: allocator RSS MiB"), v(r, &k("allocator_rss_mb"))));
        rows.push((format!("{n} quotas: grant p99 ms (64 agents, 1 replica)"), v(r, &k("grant_p99_ms"))));
        rows.push((format!("{n} quotas: grants/s"), v(r, &k("grants_per_s"))));
    }
    rows.push((
        format!(
            "ledger rows/s at {} admits/s on one quota (extrapolated ×3600 → per hour)",
            v(r, "renewal.admits_per_s")
        ),
        format!("{} → {}", v(r, "scaling.ledger_rows_per_s"), v(r, "scaling.ledger_rows_per_hour")),
    ));
    rows.push(("ledger rows per grant (whole run)".into(), v(r, "scaling.ledger_rows_per_grant")));
    for (a, b) in rows {
        let _ = writeln!(s, "| {a} | {b} |");
    }

    let _ = writeln!(s, "\n## Targets\n");
    let _ = writeln!(s, "| target | value | required | met |");
    let _ = writeln!(s, "|---|---|---|---|");
    for t in &r.targets {
        let _ = writeln!(
            s,
            "| {} (`{}`) | {} | {} | {} |",
            t.what,
            t.key,
            v(r, &t.key),
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
