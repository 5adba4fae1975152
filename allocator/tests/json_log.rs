//! `--log-format json` as an operator reads it: a grant's log line carries
//! the grant span (tenant, resource, region, lease id) inside the request
//! span (route template and status).

use quota_tests::http::Http;
use quota_tests::pg::TestDb;
use quota_tests::procs::Child;
use serde_json::{json, Value};
use std::process::Command;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_s_json_log_line_carries_the_grant_and_request_spans() {
    let db = TestDb::start().await;
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("allocator.log");
    let port = quota_tests::free_port();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_allocator"));
    for var in ["ALLOCATOR_LISTEN", "QUOTA_AGENT_TOKEN", "QUOTA_ADMIN_TOKEN", "LOG_FORMAT"] {
        cmd.env_remove(var);
    }
    // "lease granted" is a debug event of the grants module, "answered" one
    // of the request span's layer.
    cmd.env("DATABASE_URL", &db.url)
        .env("RUST_LOG", "info,allocator::grants=debug,allocator::http::trace=debug")
        .args(["--listen", &format!("127.0.0.1:{port}"), "--log-format", "json"]);
    let _allocator = Child::spawn("allocator", cmd, &log, None).expect("spawn allocator");
    let http = Http::new(&format!("http://127.0.0.1:{port}"));
    quota_tests::wait::until("allocator /readyz", Duration::from_secs(30), || async {
        (http.get_status("/readyz").await == Some(200)).then_some(())
    })
    .await;

    http.put("/v1/policies/atlas/read", &json!({"limit": 1000, "window_secs": 60})).await.expect(200);
    let epoch =
        http.post("/v1/agents/register", &json!({"region": "eu", "agent": "eu-1"})).await.expect(200).body
            ["epoch"]
            .as_i64()
            .unwrap();
    let grant = http
        .post(
            "/v1/grants",
            &json!({"tenant": "atlas", "resource": "read", "region": "eu", "agent": "eu-1",
                "epoch": epoch, "seq": 1, "want": 10, "demand_per_sec": 5.0}),
        )
        .await
        .expect(200)
        .body;
    let lease_id = grant["lease_id"].as_str().expect("lease_id").to_string();

    let find = |message: &'static str, route: &'static str| {
        let log = log.clone();
        move || {
            let log = log.clone();
            async move {
                let text = std::fs::read_to_string(&log).ok()?;
                text.lines()
                    .filter_map(|l| serde_json::from_str::<Value>(l).ok())
                    .find(|v| v["message"] == message && v["spans"][0]["route"] == route)
            }
        }
    };
    let line = quota_tests::wait::until(
        "the grant's log line",
        Duration::from_secs(10),
        find("lease granted", "/v1/grants"),
    )
    .await;

    assert_eq!(line["level"], "DEBUG", "{line}");
    assert_eq!(line["tokens"], grant["tokens"], "{line}");
    // The innermost span is the grant transaction's.
    let span = &line["span"];
    assert_eq!(span["name"], "grant", "{line}");
    assert_eq!(span["tenant"], "atlas", "{line}");
    assert_eq!(span["resource"], "read", "{line}");
    assert_eq!(span["region"], "eu", "{line}");
    assert_eq!(span["agent"], "eu-1", "{line}");
    assert_eq!(span["epoch"], epoch, "{line}");
    assert_eq!(span["lease_id"], lease_id.as_str(), "{line}");
    // Outermost first: the request's span with its route template (the
    // status is recorded only when the answer leaves, after this line).
    let spans = line["spans"].as_array().expect("span list");
    let names: Vec<&str> = spans.iter().filter_map(|s| s["name"].as_str()).collect();
    assert_eq!(names, ["http", "grant"], "{line}");
    assert_eq!(spans[0]["route"], "/v1/grants", "{line}");
    assert_eq!(spans[0]["method"], "POST", "{line}");

    // The answer's line carries the status in the request span.
    let answered = quota_tests::wait::until(
        "the grant's answered line",
        Duration::from_secs(10),
        find("answered", "/v1/grants"),
    )
    .await;
    assert_eq!(answered["span"]["name"], "http", "{answered}");
    assert_eq!(answered["span"]["status"], 200, "{answered}");
}
