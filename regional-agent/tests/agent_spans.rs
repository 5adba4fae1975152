//! Spans in the agent's JSON logs: with `--log-format json` every line
//! names the spans it was written in, so an acquire can be followed by its
//! tenant and resource, a renewal by its quota, and a request by its route
//! and status.

mod common;

use common::{acquire, World};
use serde_json::{json, Value};
use std::time::Duration;

/// The JSON lines of `log` written inside a span named `name` whose fields
/// match `fields`.
fn lines_in_span(log: &str, name: &str, fields: &[(&str, Value)]) -> Vec<Value> {
    log.lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| {
            v["spans"].as_array().is_some_and(|spans| {
                spans.iter().any(|s| s["name"] == name && fields.iter().all(|(k, want)| s[*k] == *want))
            })
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_logs_carry_the_acquire_span_with_tenant_and_resource() {
    let w = World::start().await;
    w.policy("atlas", "read", json!({"limit": 100, "window_secs": 3600})).await;
    // The spans are `info`; the lines inside an acquire are `debug`.
    let env = [("LOG_FORMAT", "json"), ("RUST_LOG", "info,regional_agent=debug")];
    let a = w.agent("eu", "eu-1", None, &env).await;

    acquire(&a.http, "atlas", "read").await.expect(200);

    let acquire_span = [("tenant", json!("atlas")), ("resource", json!("read"))];
    let lines =
        quota_tests::wait::until("a log line inside the acquire span", Duration::from_secs(10), || {
            let found = lines_in_span(&a.log(), "acquire", &acquire_span);
            async move { (!found.is_empty()).then_some(found) }
        })
        .await;
    let answered = lines
        .iter()
        .find(|l| l["message"] == "acquire answered")
        .unwrap_or_else(|| panic!("no 'acquire answered' line in the acquire span: {lines:?}"));
    let spans = answered["spans"].as_array().expect("span list");
    // The acquire span sits in the request's span, which names the route.
    assert_eq!(spans[0]["name"], "request", "{answered}");
    assert_eq!(spans[0]["route"], "/v1/acquire", "{answered}");
    assert_eq!(answered["span"]["outcome"], "lease", "{answered}");

    // The renewer's round that credited the lease runs in a span of the quota.
    let credited = lines_in_span(&a.log(), "renew_once", &acquire_span);
    assert!(credited.iter().any(|l| l["message"] == "lease credited"), "{credited:?}");

    // The request's span gets the answer's status.
    let route = [("route", json!("/v1/acquire")), ("status", json!(200))];
    quota_tests::wait::until("the request span with its status", Duration::from_secs(10), || {
        let found =
            lines_in_span(&a.log(), "request", &route).into_iter().any(|l| l["message"] == "answered");
        async move { found.then_some(()) }
    })
    .await;
}
