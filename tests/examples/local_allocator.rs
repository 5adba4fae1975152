//! Runs the allocator locally over an embedded, ephemeral PostgreSQL (the
//! test harness's), writes a sample policy and serves until Ctrl-C, then
//! removes everything it started.
//!
//! `cargo run -p quota-tests --example local_allocator -- [LISTEN]`

use quota_tests::http::Http;
use serde_json::json;

#[tokio::main]
async fn main() {
    let listen = std::env::args().nth(1).unwrap_or_else(|| "127.0.0.1:7070".to_string());
    allocator::telemetry::init(allocator::config::LogFormat::Text);
    eprintln!("starting an embedded PostgreSQL ...");
    let db = quota_tests::pg::TestDb::start().await;
    let pool = allocator::connect(&db.url, 16).await.unwrap_or_else(|e| panic!("{e}"));
    let listener = tokio::net::TcpListener::bind(&listen)
        .await
        .unwrap_or_else(|e| panic!("cannot listen on {listen}: {e}"));
    let base = format!("http://{}", listener.local_addr().expect("addr"));
    let server = tokio::spawn(allocator::run(
        listener,
        allocator::AppState::new(pool),
        allocator::telemetry::shutdown_signal(),
    ));
    let policy = json!({"limit": 1000, "window_secs": 10, "fallback_per_region": 100});
    let r = Http::new(&base).put("/v1/policies/atlas/read", &policy).await;
    println!("allocator at {base} (PostgreSQL at {})", db.url);
    println!("sample policy atlas/read: {}", r.body);
    println!("try: curl -s {base}/v1/policies/atlas/read ; Ctrl-C stops and removes everything");
    let _ = server.await;
}
