//! The allocator's per-window gauges (`allocator_window_*`): the open and
//! the previous window of the busiest quotas, with the numbers of
//! `GET /v1/windows`, and bounded cardinality (`--window-metrics-quotas`):
//! a quota that drops out of the top N leaves its series.

use quota_tests::app::Options;
use quota_tests::fixtures::{at, grant, grant_body, operator_scenario_played, put_policy, register, Stack};
use quota_tests::http::{metric, Http};
use quota_tests::wait::until;
use serde_json::json;
use std::time::Duration;

async fn scrape(http: &Http) -> String {
    http.get("/metrics").await.expect(200).body.as_str().expect("text").to_string()
}

fn window(text: &str, family: &str, tenant: &str, which: &str, extra: &str) -> Option<f64> {
    metric(text, &format!("{family}{{tenant=\"{tenant}\",resource=\"read\",window=\"{which}\"{extra}}}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn window_gauges_show_the_open_and_previous_window_of_the_scripted_scenario() {
    let (_db, clock, _alloc, http) = operator_scenario_played().await;

    // 10:01:30: window 10:01 is open (reports above the bound), 10:00 closed.
    clock.set_now(at("2026-12-02T10:01:30Z"));
    let t = scrape(&http).await;
    let g = |family: &str, which: &str| window(&t, family, "atlas", which, "");
    let admitted = |which: &str, region: &str, source: &str| {
        window(
            &t,
            "allocator_window_admitted_tokens",
            "atlas",
            which,
            &format!(",region=\"{region}\",source=\"{source}\""),
        )
    };
    assert_eq!(g("allocator_window_limit_tokens", "previous"), Some(1000.0), "{t}");
    assert_eq!(g("allocator_window_bound_tokens", "previous"), Some(1100.0), "{t}");
    assert_eq!(g("allocator_window_granted_tokens", "previous"), Some(500.0), "{t}");
    assert_eq!(g("allocator_window_stranded_tokens", "previous"), Some(50.0), "{t}");
    assert_eq!(g("allocator_window_bound_held", "previous"), Some(1.0), "{t}");
    assert_eq!(admitted("previous", "eu", "lease"), Some(250.0), "{t}");
    assert_eq!(admitted("previous", "us", "lease"), Some(150.0), "{t}");
    assert_eq!(admitted("previous", "us", "fallback"), Some(40.0), "{t}");
    assert_eq!(admitted("previous", "eu", "fallback"), Some(0.0), "{t}");
    assert_eq!(g("allocator_window_bound_held", "open"), Some(0.0), "{t}");
    assert_eq!(g("allocator_window_bound_tokens", "open"), Some(1100.0), "{t}");
    assert_eq!(admitted("open", "eu", "lease"), Some(950.0), "{t}");
    assert_eq!(admitted("open", "us", "fallback"), Some(200.0), "{t}");

    // 10:02:30: 10:01 is the previous window (bound not held); no pool is
    // open, so the open window's series leave.
    clock.set_now(at("2026-12-02T10:02:30Z"));
    let t = until("the open window's series to leave", Duration::from_secs(15), || async {
        let t = scrape(&http).await;
        window(&t, "allocator_window_bound_held", "atlas", "open", "").is_none().then_some(t)
    })
    .await;
    assert_eq!(window(&t, "allocator_window_bound_held", "atlas", "previous", ""), Some(0.0), "{t}");
    assert!(!t.contains("window=\"open\""), "{t}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_busiest_quotas_get_window_gauges_and_a_quota_that_drops_out_leaves_them() {
    // The stack lives to the test's end; `http` is its client.
    let stack = Stack::with(Options { window_metrics_quotas: Some(1), ..Default::default() }).await;
    let http = stack.http.clone();
    for tenant in ["atlas", "birch"] {
        put_policy(&http, tenant, "read", json!({"limit": 1000, "window_secs": 3600, "chunk_max": 100}))
            .await;
    }
    let epoch = register(&http, "eu", "eu-1").await;
    grant(&http, &grant_body("atlas", "read", "eu", "eu-1", epoch, 1, 30, 1.0)).await.expect(200);
    grant(&http, &grant_body("birch", "read", "eu", "eu-1", epoch, 2, 10, 1.0)).await.expect(200);
    let t = scrape(&http).await;
    assert_eq!(window(&t, "allocator_window_granted_tokens", "atlas", "open", ""), Some(30.0), "{t}");
    assert!(!t.contains("tenant=\"birch\""), "only the busiest quota is shown: {t}");

    // birch becomes the busiest: it replaces atlas.
    grant(&http, &grant_body("birch", "read", "eu", "eu-1", epoch, 3, 50, 1.0)).await.expect(200);
    let t = until("atlas to leave the window gauges", Duration::from_secs(15), || async {
        let t = scrape(&http).await;
        (!t.contains("tenant=\"atlas\"")).then_some(t)
    })
    .await;
    assert_eq!(window(&t, "allocator_window_granted_tokens", "birch", "open", ""), Some(60.0), "{t}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zero_window_metrics_quotas_turns_the_gauges_off() {
    // The stack lives to the test's end; `http` is its client.
    let stack = Stack::with(Options { window_metrics_quotas: Some(0), ..Default::default() }).await;
    let http = stack.http.clone();
    put_policy(&http, "atlas", "read", json!({"limit": 1000, "window_secs": 3600})).await;
    let epoch = register(&http, "eu", "eu-1").await;
    grant(&http, &grant_body("atlas", "read", "eu", "eu-1", epoch, 1, 30, 1.0)).await.expect(200);
    let t = scrape(&http).await;
    assert!(t.contains("allocator_grants_total"), "{t}");
    assert!(!t.contains("allocator_window_"), "{t}");
}
