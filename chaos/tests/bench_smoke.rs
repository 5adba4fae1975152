//! The only benchmark CI runs: `quota-lab bench --smoke` (a few seconds of
//! every measurement) must finish and write a report whose headline keys
//! hold finite values, so the harness cannot rot between real runs.

use std::process::Command;

/// Keys that must be measured and positive.
const POSITIVE: [&str; 20] = [
    "acquire.c1.decisions_per_s",
    // A per-key bucket beside the quota alone, same run (issue 17).
    "acquire.c16.per_key.decisions_per_s",
    "acquire.c16.per_key.p99_ms",
    // Two quotas with per-key buckets in one decision (issue 17).
    "acquire.c16.two_quotas_per_key.decisions_per_s",
    "acquire.c16.two_quotas_per_key.p99_ms",
    // Envoy's rate limit service beside HTTP acquire, same run (issue 18).
    "rls.c16.decisions_per_s",
    "rls.c16.p99_ms",
    // TLS beside plain, same run (issue 16).
    "acquire.c16.redis_plain.decisions_per_s",
    "acquire.c16.redis_tls.decisions_per_s",
    "acquire.c16.redis_tls.p99_ms",
    "acquire.c16.redis_tls.ratio_to_redis_plain",
    "grants.c16.http.p99_ms",
    "grants.c16.https.p99_ms",
    "acquire.c16.p99_ms",
    "acquire.c16.decisions_per_s",
    "acquire.c16.ratio_to_ceiling",
    "acquire.c64.decisions_per_s",
    "grants.c64.grants_per_s",
    "grants.c64.ratio_to_ceiling",
    "utilization.skew",
];

/// Keys that must be measured; 0 is a legitimate value for them (no
/// stranded token, no renewal beyond the first grant in a short run).
const NON_NEGATIVE: [&str; 3] = ["renewals_per_1000_admits", "stranded_pct", "utilization.contention"];

#[test]
fn bench_smoke_writes_a_report_with_every_headline_key() {
    let out = tempfile::tempdir().expect("temp dir");
    let status = Command::new(env!("CARGO_BIN_EXE_quota-lab"))
        .args(["bench", "--smoke", "--out"])
        .arg(out.path())
        .status()
        .expect("run quota-lab");
    assert!(status.success(), "quota-lab bench --smoke exited with {status}");
    let text = std::fs::read_to_string(out.path().join("report.json")).expect("report.json written");
    let report: serde_json::Value = serde_json::from_str(&text).expect("report.json is JSON");
    assert!(
        report["machine"]["nproc"].as_u64().unwrap_or(0) >= 1,
        "machine description: {}",
        report["machine"]
    );
    assert_eq!(report["command"], "cargo lab bench --smoke");
    let results = &report["results"];
    for key in POSITIVE {
        let v = results[key].as_f64().unwrap_or_else(|| panic!("{key} missing in {results}"));
        assert!(v.is_finite() && v > 0.0, "{key} = {v}");
    }
    for key in NON_NEGATIVE {
        let v = results[key].as_f64().unwrap_or_else(|| panic!("{key} missing in {results}"));
        assert!(v.is_finite() && v >= 0.0, "{key} = {v}");
    }
    // The agent's memory per known quota is measured over quotas it really
    // holds (50 learned in a smoke run, plus the bench's own).
    let held = results["scaling.agent_quotas_held"].as_f64().unwrap_or(0.0);
    assert!(held >= 51.0, "the agent holds {held} quotas after learning 50 more");
    let kib = results["scaling.agent_kib_per_quota"].as_f64().unwrap_or(-1.0);
    assert!(kib.is_finite() && kib >= 0.0, "agent KiB per quota = {kib}");
    // A smoke run does not build the peer (RocksDB); the report must say so
    // instead of carrying the key.
    assert!(results.get("acquire.c16.ratio_to_limitador").is_none(), "smoke run measured the peer");
    assert!(
        report["notes"].to_string().contains("limitador peer not measured"),
        "no note on the missing peer"
    );
    assert!(std::fs::read_to_string(out.path().join("report.md"))
        .expect("report.md")
        .contains("| clients |"));
    assert!(std::fs::read_to_string(out.path().join("report.md"))
        .expect("report.md")
        .contains("## TLS beside plain"));
}
