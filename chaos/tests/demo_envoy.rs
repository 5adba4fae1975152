//! `cargo lab demo --envoy`, short: the real quota-lab binary runs the
//! whole stack with the shipped Envoy example in front of every agent for
//! 10 s of traffic (a partition included) and must end with both quotas'
//! tables and charts, every window within its bound and the ledger equal
//! to what the clients saw through Envoy. Skipped, loudly, only where
//! Envoy can be neither found nor installed (`QUOTA_REQUIRE_ENVOY` makes
//! that a failure, as in CI).

use std::process::Command;

#[test]
fn the_demo_runs_through_envoy_and_every_window_holds() {
    let Some(envoy) = quota_tests::envoy::for_test("demo_envoy") else { return };
    let charts = tempfile::tempdir().expect("temp dir");
    let started = std::time::Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_quota-lab"))
        .args(["demo", "--envoy", "--duration", "10", "--chart"])
        .arg(charts.path().join("windows.svg"))
        // The Envoy this test found or installed, whatever PATH says.
        .env("ENVOY_BIN", &envoy)
        .output()
        .expect("run quota-lab");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    eprintln!("{stdout}\n{stderr}\n({:.0} s)", started.elapsed().as_secs_f64());
    assert!(out.status.success(), "quota-lab demo --envoy exited with {}", out.status);

    // Every agent got its Envoy, and the live lines count through them.
    assert_eq!(stderr.matches("demo: starting Envoy on ").count(), 3, "one Envoy per agent");
    assert!(stdout.lines().any(|l| l.starts_with("t=") && l.contains(" 5xx ")), "no live line");
    // A table per quota of the example, each with a chart.
    for (quota, chart) in [
        ("atlas/catalog (every request):", "windows-catalog.svg"),
        ("atlas/search (searches", "windows-search.svg"),
    ] {
        assert!(stdout.contains(quota), "no table for {quota}");
        let svg =
            std::fs::read_to_string(charts.path().join(chart)).unwrap_or_else(|e| panic!("{chart}: {e}"));
        assert!(svg.starts_with("<svg"), "{chart}");
    }
    assert!(stdout.contains("bound held"), "no table header");
    // Traffic was admitted through Envoy and reached the upstream.
    let admitted: u64 = stdout
        .lines()
        .find_map(|l| l.strip_prefix("through Envoy: clients saw "))
        .and_then(|l| l.split(" × 200").next())
        .and_then(|n| n.parse().ok())
        .expect("a `through Envoy: clients saw N × 200` line");
    assert!(admitted > 0, "nothing admitted through Envoy");
    assert!(
        stdout.contains("every window held its bound, and the allocator's ledger equals what clients saw"),
        "the demo's verdict"
    );
}
