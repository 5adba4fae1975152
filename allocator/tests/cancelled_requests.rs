//! Requests cancelled at random points never leave a pooled PostgreSQL
//! connection inside a transaction (issue 35): clients that give up
//! mid-grant or mid-report, behind a slow link to the database, with the
//! allocator paused (SIGSTOP) while requests are in flight. A connection
//! that went back to its pool with an open transaction would run the next
//! request's statements inside it ("there is already a transaction in
//! progress"), where a write the caller was told about can still be
//! rolled back with the stale transaction.

use quota_tests::allocator_proc::AllocatorProc;
use quota_tests::fixtures::grant_body;
use quota_tests::pg::TestDb;
use quota_tests::proxy::{Fault, FaultProxy};
use rand::Rng;
use serde_json::json;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// `url` with its `host:port` replaced by `addr`.
fn through(url: &str, addr: &str) -> String {
    let at = url.find('@').map(|i| i + 1).unwrap_or("postgres://".len());
    let end = url[at..].find('/').map(|i| at + i).unwrap_or(url.len());
    format!("{}{}{}", &url[..at], addr, &url[end..])
}

/// The `host:port` of a PostgreSQL URL.
fn upstream(url: &str) -> String {
    let at = url.find('@').map(|i| i + 1).unwrap_or("postgres://".len());
    let end = url[at..].find('/').map(|i| at + i).unwrap_or(url.len());
    url[at..end].to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_cancelled_at_random_points_leave_no_transaction_open() {
    let db = TestDb::start().await;
    // Every chunk either way waits 4 ms: a grant's round trips each take
    // about 8 ms, so a client's random deadline falls inside any of them,
    // BEGIN included.
    let link = FaultProxy::start(vec![upstream(&db.url)]).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut alloc = AllocatorProc::new(
        std::path::Path::new(env!("CARGO_BIN_EXE_allocator")),
        &through(&db.url, &link.addr),
        dir.path().join("a"),
    );
    // Two connections: a connection handed back dirty is the next
    // request's at once.
    alloc.set_args(&["--db-max-connections", "2"]);
    alloc.start_ready(Duration::from_secs(30)).await.unwrap();
    let http = alloc.http();
    for q in 0..8 {
        http.put(
            &format!("/v1/policies/atlas/q{q}"),
            &json!({"limit": 1_000_000, "window_secs": 3600, "chunk_min": 1, "chunk_max": 50, "lease_ttl_secs": 3600}),
        )
        .await
        .expect(200);
    }
    let epoch =
        http.post("/v1/agents/register", &json!({"region": "eu", "agent": "eu-1"})).await.expect(200).body
            ["epoch"]
            .as_i64()
            .unwrap();
    let window_start = http
        .post("/v1/grants", &grant_body("atlas", "q0", "eu", "eu-1", epoch, 100_000, 5, 10.0))
        .await
        .expect(200)
        .body["window_start"]
        .clone();
    link.set(Fault::Latency(4));

    // Four clients, each sending grants and reports one after another,
    // most with a random deadline between 1 ms and 250 ms.
    let answered: Arc<Mutex<Vec<String>>> = Arc::default();
    let cancelled = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let base = format!("http://{}", alloc.addr);
    let mut clients = Vec::new();
    for c in 0..4i64 {
        let (base, answered, cancelled) = (base.clone(), answered.clone(), cancelled.clone());
        let window_start = window_start.clone();
        clients.push(tokio::spawn(async move {
            for n in 0..60i64 {
                // Every fifth waits long enough to be answered however
                // loaded the machine is: those are the leases checked below,
                // and they run on connections the others left behind.
                let deadline = if n % 5 == 0 {
                    Duration::from_secs(10)
                } else {
                    Duration::from_millis(rand::rng().random_range(1..=250))
                };
                let client = reqwest::Client::builder().timeout(deadline).build().unwrap();
                let seq = c * 1000 + n;
                let q = format!("q{}", seq % 8);
                let sent = if n % 4 == 3 {
                    let body = json!({"region": "eu", "agent": "eu-1", "epoch": epoch,
                        "report_id": format!("r-{seq}"),
                        "items": [{"tenant": "atlas", "resource": q, "window_start": window_start,
                                   "consumed": 1, "fallback_admitted": 0}]});
                    client.post(format!("{base}/v1/reports")).json(&body).send().await.map(|r| (r, None))
                } else {
                    let body = grant_body("atlas", &q, "eu", "eu-1", epoch, seq, 5, 10.0);
                    client.post(format!("{base}/v1/grants")).json(&body).send().await.map(|r| (r, Some(())))
                };
                match sent {
                    Ok((r, grant)) if r.status() == 200 => {
                        if let (Some(()), Ok(b)) = (grant, r.json::<serde_json::Value>().await) {
                            if let Some(id) = b["lease_id"].as_str() {
                                answered.lock().unwrap().push(id.to_string());
                            }
                        }
                    }
                    Ok(_) => {}
                    Err(_) => {
                        cancelled.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                }
            }
        }));
    }
    // Paused with requests in flight: their clients give up meanwhile, and
    // the allocator finds them gone when it resumes.
    tokio::time::sleep(Duration::from_millis(600)).await;
    alloc.signal(libc::SIGSTOP);
    tokio::time::sleep(Duration::from_millis(700)).await;
    alloc.signal(libc::SIGCONT);
    for c in clients {
        c.await.unwrap();
    }
    link.set(Fault::Pass);
    let cancelled = cancelled.load(std::sync::atomic::Ordering::Relaxed);
    assert!(cancelled >= 30, "only {cancelled} of 240 requests were cancelled: the test did not test");

    // No session of the allocator stays inside a transaction once its
    // requests have ended.
    let pg = sqlx::PgPool::connect(&db.url).await.unwrap();
    quota_tests::wait::until("no allocator session idle in a transaction", Duration::from_secs(10), || {
        let pg = pg.clone();
        async move { (quota_tests::db::idle_in_transaction(&pg).await == 0).then_some(()) }
    })
    .await;
    // A grant after all that runs in a transaction of its own.
    let r = http.post("/v1/grants", &grant_body("atlas", "q0", "eu", "eu-1", epoch, 99_999, 5, 10.0)).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    answered.lock().unwrap().push(r.body["lease_id"].as_str().unwrap().to_string());

    // Killed outright, so an open transaction would roll back now: every
    // lease a client was told about is committed, and the pools add up (I1).
    alloc.kill(libc::SIGKILL);
    let log = alloc.log();
    let stale: Vec<&str> = log.lines().filter(|l| l.contains("already a transaction in progress")).collect();
    assert!(stale.is_empty(), "{} statements ran in a stale transaction, e.g.\n{}", stale.len(), stale[0]);
    let answered = answered.lock().unwrap().clone();
    assert!(answered.len() >= 10, "only {} grants were answered", answered.len());
    for id in &answered {
        assert!(quota_tests::db::lease_exists(&pg, id).await, "lease {id} was answered but is not committed");
    }
    let bad = quota_tests::db::pools_out_of_balance(&pg).await;
    assert!(bad.is_empty(), "pools that do not add up: {bad:?}");
}
