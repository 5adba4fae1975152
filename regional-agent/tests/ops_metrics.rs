//! What operators scrape: the allocator's and an agent's `/metrics` after a
//! little traffic are clean for `promtool check metrics`, carry the series
//! the alert rules and the Grafana dashboard use (every metric name in
//! `deploy/grafana/quotas.json` and `deploy/prometheus/alerts.yml` is one
//! the services export), and the new gauges show the scripted numbers.

mod common;

use common::{acquire, World};
use quota_tests::http::metric;
use quota_tests::promtool::{check_metrics, exported_names, metric_names, promtool, workspace};
use quota_tests::wait::until;
use serde_json::{json, Value};
use std::time::Duration;

const PREFIXES: &[&str] = &["agent_", "allocator_"];

/// Every `expr` of the dashboard's panels (rows included).
fn panel_exprs(dash: &Value) -> Vec<(String, String)> {
    fn walk(panels: &Value, out: &mut Vec<(String, String)>) {
        for p in panels.as_array().into_iter().flatten() {
            let title = p["title"].as_str().unwrap_or("?").to_string();
            for t in p["targets"].as_array().into_iter().flatten() {
                out.push((title.clone(), t["expr"].as_str().expect("target without expr").to_string()));
            }
            walk(&p["panels"], out);
        }
    }
    let mut out = Vec::new();
    walk(&dash["panels"], &mut out);
    for v in dash["templating"]["list"].as_array().into_iter().flatten() {
        if let Some(q) = v["query"]["query"].as_str() {
            // Grafana's `label_values(SELECTOR, label)`: the selector is PromQL.
            let selector = q
                .strip_prefix("label_values(")
                .and_then(|inner| inner.rsplit_once(','))
                .map(|(sel, _)| sel.trim())
                .unwrap_or_else(|| panic!("variable {}: not label_values(selector, label): {q}", v["name"]));
            out.push((format!("variable {}", v["name"]), selector.to_string()));
        }
    }
    out
}

/// `expr:` values of a rules file (one-line and `|` blocks).
fn rule_exprs(rules: &str) -> Vec<String> {
    let lines: Vec<&str> = rules.lines().collect();
    let mut out = Vec::new();
    for (i, l) in lines.iter().enumerate() {
        let Some(rest) = l.trim_start().strip_prefix("expr: ") else { continue };
        if rest.trim() == "|" {
            let indent = |s: &str| s.len() - s.trim_start().len();
            let own = indent(l);
            let block: Vec<&str> = lines[i + 1..]
                .iter()
                .take_while(|b| b.trim().is_empty() || indent(b) > own)
                .copied()
                .collect();
            out.push(block.join("\n"));
        } else {
            out.push(rest.to_string());
        }
    }
    out
}

async fn scrape(http: &quota_tests::http::Http) -> String {
    let r = http.get("/metrics").await.expect(200);
    r.body.as_str().expect("metrics text").to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scrapes_are_promtool_clean_and_carry_every_metric_the_dashboard_and_alerts_use() {
    let w = World::start().await;
    w.policy("atlas", "read", json!({"limit": 20, "window_secs": 3600, "chunk_min": 5, "chunk_max": 10}))
        .await;
    // The agent's clock runs 5 s ahead; the allocator's does not.
    let a = w.agent("eu", "eu-1", None, &[("AGENT_TEST_CLOCK_OFFSET_MS", "5000")]).await;

    // Spend the whole limit, then one more: a 429.
    let mut admitted = 0;
    for _ in 0..100 {
        let r = acquire(&a.http, "atlas", "read").await;
        match r.status {
            200 => admitted += 1,
            429 => break,
            s => panic!("acquire answered {s}: {}", r.body),
        }
    }
    assert_eq!(admitted, 20);

    // The agent reports what it admitted; the allocator's window gauges show it.
    let admitted_series = "allocator_window_admitted_tokens{tenant=\"atlas\",resource=\"read\",window=\"open\",region=\"eu\",source=\"lease\"}";
    let alloc_text = until("the reports to reach the allocator", Duration::from_secs(20), || async {
        let text = scrape(&w.stack.http).await;
        (metric(&text, admitted_series) == Some(20.0)).then_some(text)
    })
    .await;
    let open = "{tenant=\"atlas\",resource=\"read\",window=\"open\"}";
    assert_eq!(
        metric(&alloc_text, &format!("allocator_window_limit_tokens{open}")),
        Some(20.0),
        "{alloc_text}"
    );
    assert_eq!(
        metric(&alloc_text, &format!("allocator_window_bound_tokens{open}")),
        Some(20.0),
        "{alloc_text}"
    );
    assert_eq!(metric(&alloc_text, &format!("allocator_window_bound_held{open}")), Some(1.0), "{alloc_text}");
    assert_eq!(
        metric(&alloc_text, &format!("allocator_window_stranded_tokens{open}")),
        Some(0.0),
        "{alloc_text}"
    );

    let agent_text = until("the agent's gauges", Duration::from_secs(10), || async {
        let text = scrape(&a.http).await;
        (metric(&text, "agent_quota_mode{quota=\"atlas/read\",mode=\"exhausted\"}") == Some(1.0))
            .then_some(text)
    })
    .await;
    assert_eq!(metric(&agent_text, "agent_info{region=\"eu\",agent=\"eu-1\"}"), Some(1.0), "{agent_text}");
    assert_eq!(metric(&agent_text, "agent_quota_mode{quota=\"atlas/read\",mode=\"leased\"}"), Some(0.0));
    assert_eq!(metric(&agent_text, "agent_policy_version{quota=\"atlas/read\"}"), Some(1.0), "{agent_text}");
    assert!(
        metric(
            &agent_text,
            "agent_quota_refusals_total{quota=\"atlas/read\",code=\"quota_exhausted\",version=\"1\"}"
        )
        .is_some_and(|v| v >= 1.0),
        "{agent_text}"
    );
    assert!(
        metric(&agent_text, "agent_quota_decisions_total{quota=\"atlas/read\",version=\"1\"}")
            .is_some_and(|v| v >= 2.0),
        "{agent_text}"
    );
    let offset = metric(&agent_text, "agent_allocator_clock_offset_seconds").expect("clock offset");
    assert!((-6.0..=-4.0).contains(&offset), "the allocator's clock is 5 s behind the agent's: {offset}");

    // promtool accepts both scrapes as they are.
    check_metrics("allocator", &alloc_text);
    check_metrics("agent", &agent_text);

    let mut exported = exported_names(&alloc_text);
    exported.extend(exported_names(&agent_text));

    let dash: Value = serde_json::from_str(
        &std::fs::read_to_string(workspace().join("deploy/grafana/quotas.json")).expect("quotas.json"),
    )
    .expect("the dashboard is JSON");
    let panels = panel_exprs(&dash);
    assert!(panels.len() >= 15, "{panels:?}");
    let rules =
        std::fs::read_to_string(workspace().join("deploy/prometheus/alerts.yml")).expect("alerts.yml");
    let alerts: Vec<(String, String)> =
        rule_exprs(&rules).into_iter().map(|e| ("alerts.yml".to_string(), e)).collect();
    assert!(alerts.len() >= 12, "{alerts:?}");
    for (where_, expr) in panels.iter().chain(&alerts) {
        let names = metric_names(expr, PREFIXES);
        assert!(!names.is_empty(), "{where_}: no metric in {expr}");
        for n in names {
            assert!(exported.contains(&n), "{where_}: {n} is not exported by either service ({expr})");
        }
    }

    // Every panel query is valid PromQL: promtool checks them as recording rules.
    let dir = tempfile::tempdir().expect("temp dir");
    let mut file = String::from("groups:\n  - name: dashboard\n    rules:\n");
    for (i, (_, expr)) in panels.iter().enumerate() {
        file.push_str(&format!("      - record: dashboard:query{i}\n        expr: {}\n", json!(expr)));
    }
    std::fs::write(dir.path().join("dashboard_rules.yml"), file).expect("write rules");
    let run = promtool(dir.path(), &["check", "rules", "dashboard_rules.yml"], None);
    assert!(run.ok, "dashboard queries are not valid PromQL:\n{}", run.output);
}
