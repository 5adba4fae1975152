//! The `allocator` binary driven from outside, as operators and other
//! services see it: configuration errors, migrations at start, graceful
//! shutdown on SIGTERM, epochs monotonic across process restarts.

use quota_tests::allocator_proc::AllocatorProc;
use quota_tests::pg::TestDb;
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

/// The allocator binary over `db_url` on a free port, started with `args`
/// (logs `<dir>/<name>.<start>.log`), ready.
async fn spawn(db_url: &str, dir: &std::path::Path, name: &str, args: &[&str]) -> AllocatorProc {
    let mut a =
        AllocatorProc::new(std::path::Path::new(env!("CARGO_BIN_EXE_allocator")), db_url, dir.join(name));
    a.set_args(args);
    a.start().expect("spawn allocator");
    wait_healthy(&a).await;
    a
}

async fn wait_healthy(a: &AllocatorProc) {
    a.ready(Duration::from_secs(30)).await.unwrap_or_else(|e| panic!("{e}"));
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
    let mut a = spawn(&db.url, dir.path(), "a", &["--log-format", "json"]).await;
    let http = a.http();
    let e1 =
        http.post("/v1/agents/register", &json!({"region": "eu", "agent": "eu-1"})).await.expect(200).body
            ["epoch"]
            .as_i64()
            .unwrap();
    let status = a.stop(libc::SIGTERM, Duration::from_secs(15)).expect("exit");
    assert!(status.success(), "graceful exit on SIGTERM, got {status}");
    let log = a.log();
    let first = log.lines().find(|l| l.contains("allocator listening")).expect("listening line");
    let v: serde_json::Value = serde_json::from_str(first).expect("JSON log line");
    assert_eq!(v["level"], "INFO");
    assert!(log.contains("allocator stopped"), "{log}");

    // A killed process loses nothing committed: epochs keep increasing.
    // Restarts keep the port, without the JSON log format.
    a.set_args(&[]);
    a.start().expect("spawn allocator");
    wait_healthy(&a).await;
    let e2 =
        http.post("/v1/agents/register", &json!({"region": "eu", "agent": "eu-1"})).await.expect(200).body
            ["epoch"]
            .as_i64()
            .unwrap();
    assert!(e2 > e1);
    a.stop(libc::SIGKILL, Duration::from_secs(5));

    a.start().expect("spawn allocator");
    wait_healthy(&a).await;
    let e3 =
        http.post("/v1/agents/register", &json!({"region": "eu", "agent": "eu-1"})).await.expect(200).body
            ["epoch"]
            .as_i64()
            .unwrap();
    assert!(e3 > e2, "epoch {e3} after SIGKILL and restart must exceed {e2}");
}

/// The database's clock, read as the test's own client sees it.
async fn db_now(pg: &sqlx::PgPool) -> chrono::DateTime<chrono::Utc> {
    quota_tests::db::clock_timestamp(pg).await
}

fn at(s: &serde_json::Value) -> chrono::DateTime<chrono::Utc> {
    s.as_str().expect("timestamp").parse().expect("RFC 3339")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_30_s_apart_grant_only_the_database_s_current_or_next_window() {
    let db = TestDb::start().await;
    let pg = sqlx::PgPool::connect(&db.url).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let pa = spawn(&db.url, dir.path(), "a", &[]).await;
    // The hidden test flag: this replica's own clock runs 30 s ahead.
    let pb = spawn(&db.url, dir.path(), "b", &["--test-clock-offset-ms", "30000"]).await;
    let (a, b) = (pa.http(), pb.http());
    // 20 s windows: 30 s of skew always lands in another window, so a
    // replica deciding on its own clock would fail every "current" grant.
    // A lease may live a whole window, so "next" is always allowed.
    let w = 20;
    a.put("/v1/policies/atlas/read", &json!({"limit": 1_000_000, "window_secs": w, "lease_ttl_secs": w}))
        .await
        .expect(200);
    let epoch =
        a.post("/v1/agents/register", &json!({"region": "eu", "agent": "eu-1"})).await.expect(200).body
            ["epoch"]
            .as_i64()
            .unwrap();
    let mut seq = 0;
    for round in 0..6 {
        for (name, http) in [("a", &a), ("b (+30 s)", &b)] {
            for sel in ["current", "next"] {
                seq += 1;
                let body = json!({"tenant": "atlas", "resource": "read", "region": "eu", "agent": "eu-1",
                    "epoch": epoch, "seq": seq, "want": 1, "demand_per_sec": 1.0, "window": sel});
                let before = db_now(&pg).await;
                let g = http.post("/v1/grants", &body).await.expect(200).body;
                let after = db_now(&pg).await;
                let start = at(&g["window_start"]).timestamp();
                let end = at(&g["window_end"]);
                let shift = if sel == "next" { w } else { 0 };
                let allowed = [
                    before.timestamp().div_euclid(w) * w + shift,
                    after.timestamp().div_euclid(w) * w + shift,
                ];
                assert!(
                    allowed.contains(&start),
                    "round {round}, replica {name}, {sel}: window {start} is not the database's {sel} window {allowed:?}"
                );
                // I2 against the database's clock, and expires_in_ms counted
                // from it (between the two reads, a few ms of slack).
                let expires_at = at(&g["expires_at"]);
                assert!(expires_at <= end, "I2: {g}");
                let in_ms = g["expires_in_ms"].as_i64().unwrap();
                let lo = (expires_at - after).num_milliseconds() - 5;
                let hi = (expires_at - before).num_milliseconds() + 5;
                assert!(
                    (lo..=hi).contains(&in_ms),
                    "replica {name}, {sel}: expires_in_ms {in_ms} not within [{lo}, {hi}] of the database's clock"
                );
            }
        }
    }
    // Every lease row, whichever replica wrote it, belongs to the window of
    // its issue instant on the database's clock, or the next one.
    assert_eq!(quota_tests::db::leases_off_window(&pg).await, 0);
}

/// Sends SIGTERM (and, when `second` is set, a second one 200 ms later)
/// to an allocator whose PostgreSQL is paused with a request in flight;
/// answers how long the process took to exit.
async fn stop_with_postgres_paused(deadline_secs: &str, second: bool) -> Duration {
    let db = TestDb::start().await;
    let dir = tempfile::tempdir().unwrap();
    let mut child = spawn(&db.url, dir.path(), "a", &["--shutdown-timeout-secs", deadline_secs]).await;
    let http = child.http();
    http.post("/v1/agents/register", &json!({"region": "eu", "agent": "eu-1"})).await.expect(200);

    // A request in flight inside its transaction: it waits for a row lock
    // the test holds, then PostgreSQL is paused, so neither the lock nor the
    // statement timeout (both server-side) can ever end it.
    let pg = sqlx::PgPool::connect(&db.url).await.unwrap();
    let mut holder = allocator::tx::begin(&pg).await.unwrap();
    quota_tests::db::lock_agent_row(&mut holder, "eu", "eu-1").await;
    let client = reqwest::Client::builder().timeout(Duration::from_secs(60)).build().unwrap();
    let url = format!("http://{}/v1/agents/register", child.addr);
    let mut in_flight = tokio::spawn(async move {
        client.post(url).json(&json!({"region": "eu", "agent": "eu-1"})).send().await.map(|r| r.status())
    });
    quota_tests::wait::until("the registration to wait on the row lock", Duration::from_secs(10), || {
        let pg = pg.clone();
        async move { (quota_tests::db::lock_waiters(&pg, "insert into agent (").await > 0).then_some(()) }
    })
    .await;
    db.signal_all(libc::SIGSTOP);
    if let Ok(r) = tokio::time::timeout(Duration::from_millis(300), &mut in_flight).await {
        panic!("the request must be stuck on the paused database, got {r:?}");
    }

    let started = std::time::Instant::now();
    child.signal(libc::SIGTERM);
    if second {
        // Past the first signal's handling, well before any deadline.
        tokio::time::sleep(Duration::from_millis(200)).await;
        child.signal(libc::SIGTERM);
    }
    let status = quota_tests::wait::until("the allocator to exit", Duration::from_secs(40), || {
        let s = child.try_wait();
        async move { s }
    })
    .await;
    let took = started.elapsed();
    db.signal_all(libc::SIGCONT);
    drop(holder);
    let log = child.log();
    if second {
        assert!(!status.success(), "a second signal exits at once, non-zero: {status}\n{log}");
    } else {
        assert!(status.success(), "{status}\n{log}");
        assert!(log.contains("cut at the shutdown deadline"), "{log}");
    }
    took
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_stops_within_the_deadline_with_postgres_paused() {
    let took = stop_with_postgres_paused("2", false).await;
    assert!(
        took >= Duration::from_millis(1900) && took < Duration::from_secs(5),
        "exit after {took:?}, the deadline is 2 s"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_sigterm_exits_at_once_with_postgres_paused() {
    let took = stop_with_postgres_paused("30", true).await;
    assert!(took < Duration::from_secs(3), "exit after {took:?}, the deadline is 30 s");
}
