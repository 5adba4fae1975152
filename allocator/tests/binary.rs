//! The `allocator` binary driven from outside, as operators and other
//! services see it: configuration errors, migrations at start, graceful
//! shutdown on SIGTERM, epochs monotonic across process restarts.

use quota_tests::http::Http;
use quota_tests::pg::TestDb;
use quota_tests::procs::Child;
use serde_json::json;
use std::process::Command;
use std::time::Duration;

fn allocator_cmd() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_allocator"));
    for var in ["DATABASE_URL", "ALLOCATOR_LISTEN", "QUOTA_AGENT_TOKEN", "QUOTA_ADMIN_TOKEN", "LOG_FORMAT"] {
        cmd.env_remove(var);
    }
    cmd
}

fn spawn(db_url: &str, port: u16, log: &std::path::Path, extra: &[&str]) -> Child {
    let mut cmd = allocator_cmd();
    cmd.env("DATABASE_URL", db_url).args(["--listen", &format!("127.0.0.1:{port}")]).args(extra);
    Child::spawn("allocator", cmd, log, None).expect("spawn allocator")
}

async fn wait_healthy(http: &Http) {
    quota_tests::wait::until("allocator /readyz", Duration::from_secs(30), || async {
        (http.get_status("/readyz").await == Some(200)).then_some(())
    })
    .await;
}

#[test]
fn missing_database_url_is_a_clear_error() {
    let out = allocator_cmd().output().expect("run allocator");
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("DATABASE_URL is not set"), "{err}");
}

#[test]
fn refuses_a_public_listener_without_tokens() {
    let out = allocator_cmd()
        .env("DATABASE_URL", "postgres://nobody@127.0.0.1:1/none")
        .args(["--listen", "0.0.0.0:0"])
        .output()
        .expect("run allocator");
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("QUOTA_AGENT_TOKEN") && err.contains("loopback"), "{err}");
}

#[test]
fn unreachable_database_is_a_clear_error() {
    let port = quota_tests::free_port();
    let out = allocator_cmd()
        .env("DATABASE_URL", format!("postgres://nobody@127.0.0.1:{port}/none"))
        .output()
        .expect("run allocator");
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot connect to PostgreSQL"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrates_serves_stops_on_sigterm_and_keeps_epochs_across_restarts() {
    let db = TestDb::start().await;
    let dir = tempfile::tempdir().unwrap();
    let port = quota_tests::free_port();
    let http = Http::new(&format!("http://127.0.0.1:{port}"));

    let mut child = spawn(&db.url, port, &dir.path().join("a1.log"), &["--log-format", "json"]);
    wait_healthy(&http).await;
    let e1 =
        http.post("/v1/agents/register", &json!({"region": "eu", "agent": "eu-1"})).await.expect(200).body
            ["epoch"]
            .as_i64()
            .unwrap();
    let status = child.stop(libc::SIGTERM, Duration::from_secs(15)).expect("exit");
    assert!(status.success(), "graceful exit on SIGTERM, got {status}");
    let log = std::fs::read_to_string(dir.path().join("a1.log")).unwrap();
    let first = log.lines().find(|l| l.contains("allocator listening")).expect("listening line");
    let v: serde_json::Value = serde_json::from_str(first).expect("JSON log line");
    assert_eq!(v["level"], "INFO");
    assert!(log.contains("allocator stopped"), "{log}");

    // A killed process loses nothing committed: epochs keep increasing.
    let mut child = spawn(&db.url, port, &dir.path().join("a2.log"), &[]);
    wait_healthy(&http).await;
    let e2 =
        http.post("/v1/agents/register", &json!({"region": "eu", "agent": "eu-1"})).await.expect(200).body
            ["epoch"]
            .as_i64()
            .unwrap();
    assert!(e2 > e1);
    child.stop(libc::SIGKILL, Duration::from_secs(5));

    let _child = spawn(&db.url, port, &dir.path().join("a3.log"), &[]);
    wait_healthy(&http).await;
    let e3 =
        http.post("/v1/agents/register", &json!({"region": "eu", "agent": "eu-1"})).await.expect(200).body
            ["epoch"]
            .as_i64()
            .unwrap();
    assert!(e3 > e2, "epoch {e3} after SIGKILL and restart must exceed {e2}");
}
