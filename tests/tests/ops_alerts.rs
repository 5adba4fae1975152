//! The alert rules of `deploy/prometheus/alerts.yml`: valid for Prometheus
//! (`promtool check rules`), every rule carries a runbook line, and every
//! rule is unit-tested in `alerts_test.yml` (`promtool test rules`) with a
//! case where it fires and one where it does not.

use quota_tests::promtool::{prometheus_dir, promtool};

fn alert_names(rules: &str) -> Vec<String> {
    rules.lines().filter_map(|l| l.trim().strip_prefix("- alert: ")).map(|n| n.trim().to_string()).collect()
}

#[test]
fn alert_rules_are_valid_for_promtool() {
    let run = promtool(&prometheus_dir(), &["check", "rules", "alerts.yml"], None);
    assert!(run.ok, "promtool check rules:\n{}", run.output);
    assert!(run.output.contains("SUCCESS"), "{}", run.output);
}

#[test]
fn alert_rules_pass_their_promtool_unit_tests() {
    let run = promtool(&prometheus_dir(), &["test", "rules", "alerts_test.yml"], None);
    assert!(run.ok, "promtool test rules:\n{}", run.output);
    assert!(run.output.contains("SUCCESS"), "{}", run.output);
}

#[test]
fn every_alert_has_a_runbook_line_and_is_tested_firing_and_silent() {
    let dir = prometheus_dir();
    let rules = std::fs::read_to_string(dir.join("alerts.yml")).expect("alerts.yml");
    let tests = std::fs::read_to_string(dir.join("alerts_test.yml")).expect("alerts_test.yml");
    let names = alert_names(&rules);
    assert!(names.len() >= 12, "{names:?}");
    let runbooks = rules.lines().filter(|l| l.trim_start().starts_with("runbook: ")).count();
    assert_eq!(runbooks, names.len(), "one runbook annotation per rule");
    for name in &names {
        // Each `alertname:` line is followed by its exp_alerts: `[]` (must
        // not fire) or a list of expected alerts (must fire).
        let cases: Vec<bool> = tests
            .lines()
            .zip(tests.lines().skip(1))
            .filter(|(l, _)| l.trim() == format!("alertname: {name}"))
            .map(|(_, next)| next.trim() != "exp_alerts: []")
            .collect();
        assert!(cases.contains(&true), "{name} has no case where it fires");
        assert!(cases.contains(&false), "{name} has no case where it stays silent");
    }
}
