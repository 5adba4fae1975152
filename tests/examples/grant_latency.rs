//! Grant latency with 64 concurrent clients against one in-process allocator
//! over an ephemeral PostgreSQL (the harness's).
//!
//! `cargo run --release -p quota-tests --example grant_latency -- [SECS] [CLIENTS]`
//!
//! Two runs: every client on one hot quota (all grants serialise on one pool
//! row lock), and each client on its own quota. Prints grants/s and
//! p50/p90/p99 in milliseconds.

use quota_tests::fixtures::{grant_body, put_policy, register};
use quota_tests::http::Http;
use serde_json::json;
use std::time::{Duration, Instant};

async fn run(http: &Http, clients: usize, secs: u64, hot: bool) -> (f64, Vec<f64>) {
    let mut epochs = Vec::new();
    for c in 0..clients {
        epochs.push(register(http, "bench", &format!("c{c}")).await);
        if !hot {
            put_policy(
                http,
                "bench",
                &format!("q{c}"),
                json!({"limit": 1_000_000_000, "window_secs": 86400}),
            )
            .await;
        }
    }
    let deadline = Instant::now() + Duration::from_secs(secs);
    let started = Instant::now();
    let tasks: Vec<_> = (0..clients)
        .map(|c| {
            let http = http.clone();
            let epoch = epochs[c];
            let resource = if hot { "hot".to_string() } else { format!("q{c}") };
            tokio::spawn(async move {
                let mut lat = Vec::new();
                let mut seq = 0;
                while Instant::now() < deadline {
                    seq += 1;
                    let body = grant_body("bench", &resource, "bench", &format!("c{c}"), epoch, seq, 1, 10.0);
                    let t = Instant::now();
                    let r = http.post("/v1/grants", &body).await;
                    assert_eq!(r.status, 200, "{}", r.body);
                    lat.push(t.elapsed().as_secs_f64() * 1000.0);
                }
                lat
            })
        })
        .collect();
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    let rate = all.len() as f64 / started.elapsed().as_secs_f64();
    all.sort_by(|a, b| a.partial_cmp(b).unwrap());
    (rate, all)
}

fn pct(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let secs: u64 = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(10);
    let clients: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(64);
    let db = quota_tests::pg::TestDb::start().await;
    let alloc = quota_tests::app::TestAllocator::spawn_with(
        &db.url,
        quota_tests::app::Options { max_connections: Some(32), ..Default::default() },
    )
    .await;
    let http = Http::new(&alloc.base);
    put_policy(&http, "bench", "hot", json!({"limit": 1_000_000_000, "window_secs": 86400})).await;
    println!("| quotas | clients | secs | grants | grants/s | p50 ms | p90 ms | p99 ms |");
    println!("|---|---|---|---|---|---|---|---|");
    for hot in [true, false] {
        let (rate, lat) = run(&http, clients, secs, hot).await;
        println!(
            "| {} | {clients} | {secs} | {} | {rate:.0} | {:.2} | {:.2} | {:.2} |",
            if hot { "1 hot" } else { "one per client" },
            lat.len(),
            pct(&lat, 0.5),
            pct(&lat, 0.9),
            pct(&lat, 0.99)
        );
    }
}
