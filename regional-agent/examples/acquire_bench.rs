//! Acquire latency and throughput at 64 concurrent clients against one
//! agent process (release build), a real allocator and Redis:
//!
//! ```text
//! cargo build --release -p regional-agent
//! cargo run --release -p regional-agent --example acquire_bench -- [AGENT_BIN] [SECONDS]
//! ```

use quota_tests::agent::{AgentOpts, AgentProc};
use quota_tests::fixtures::{put_policy, Stack};
use quota_tests::redis::TestRedis;
use serde_json::json;
use std::path::PathBuf;
use std::time::{Duration, Instant};

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let bin = args.get(1).map(PathBuf::from).unwrap_or_else(|| {
        let exe = std::env::current_exe().expect("exe");
        exe.parent().and_then(|p| p.parent()).expect("target dir").join("regional-agent")
    });
    let secs: u64 = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(10);
    let stack = Stack::start().await;
    let redis = TestRedis::start();
    put_policy(
        &stack.http,
        "bench",
        "read",
        json!({"limit": 100_000_000, "window_secs": 86_400, "chunk_max": 1_000_000}),
    )
    .await;
    let agent = AgentProc::spawn(&bin, AgentOpts::new("eu", "eu-1", &stack.alloc.base, &redis.url)).await;
    // reqwest uses rustls without a built-in provider here (see client.rs).
    let _ = rustls::crypto::ring::default_provider().install_default();
    let client = reqwest::Client::builder().pool_max_idle_per_host(128).build().expect("client");
    let url = format!("{}/v1/acquire", agent.base);
    // Warm-up: learn the policy and get a first lease.
    for _ in 0..200 {
        let _ = client.post(&url).json(&json!({"tenant": "bench", "resource": "read"})).send().await;
    }
    let deadline = Instant::now() + Duration::from_secs(secs);
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..64 {
        let (client, url) = (client.clone(), url.clone());
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::new();
            let mut ok = 0u64;
            while Instant::now() < deadline {
                let t = Instant::now();
                let r = client.post(&url).json(&json!({"tenant": "bench", "resource": "read"})).send().await;
                if let Ok(r) = r {
                    if r.status().as_u16() == 200 {
                        ok += 1;
                    }
                    let _ = r.bytes().await;
                }
                lat.push(t.elapsed());
            }
            (lat, ok)
        }));
    }
    let mut all = Vec::new();
    let mut ok = 0;
    for t in tasks {
        let (l, o) = t.await.expect("client");
        all.extend(l);
        ok += o;
    }
    let elapsed = started.elapsed().as_secs_f64();
    all.sort();
    let pct = |p: f64| all[((all.len() as f64 * p) as usize).min(all.len() - 1)];
    println!(
        "64 clients, {secs} s: {} decisions ({ok} admitted), {:.0} decisions/s, p50 {:?}, p99 {:?}",
        all.len(),
        all.len() as f64 / elapsed,
        pct(0.50),
        pct(0.99)
    );
    drop(agent);
}
