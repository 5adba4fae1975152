//! Rollover without a gap (DESIGN §4): with demand below G the agent
//! prefetches the next window's lease, so the deny rate in the second after
//! a window boundary is no higher than mid-window.

mod common;

use common::{acquire, World};
use serde_json::json;
use std::time::{Duration, Instant};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_admission_gap_at_the_window_boundary() {
    let secs = 4;
    // The warm-up window starts once the agent is up, not at the next real
    // boundary.
    let w = World::start_clocked(secs, Duration::from_secs(2)).await;
    w.policy("atlas", "roll", json!({"limit": 100_000, "window_secs": secs, "chunk_max": 5000})).await;
    let a = w.agent("eu", "eu-1", None, &[]).await;
    // Warm up into a fresh window so demand is measured.
    let warm_up = w.clock.next_window(secs, Duration::ZERO).await;
    let until = Instant::now() + Duration::from_secs(3 * secs as u64);
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let (http, clock) = (a.http.clone(), w.clock.clone());
        tasks.push(tokio::spawn(async move {
            let mut out = Vec::new();
            while Instant::now() < until {
                let r = acquire(&http, "atlas", "roll").await;
                let at = clock.now().timestamp_millis();
                out.push((at, r.status));
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            out
        }));
    }
    let (mut after, mut after_denied, mut mid, mut mid_denied) = (0, 0, 0, 0);
    let first_window_end = (warm_up + secs) * 1000;
    for t in tasks {
        for (at, status) in t.await.unwrap() {
            if at < first_window_end {
                continue; // the first window is warm-up
            }
            let into = at.rem_euclid(secs * 1000);
            if into < 1000 {
                after += 1;
                after_denied += i32::from(status != 200);
            } else {
                mid += 1;
                mid_denied += i32::from(status != 200);
            }
        }
    }
    assert!(after > 50 && mid > 50, "enough samples: {after} {mid}");
    let after_rate = f64::from(after_denied) / f64::from(after);
    let mid_rate = f64::from(mid_denied) / f64::from(mid);
    assert!(after_rate <= mid_rate, "deny rate after the boundary {after_rate} > mid-window {mid_rate}");
    let m = a.http.get("/metrics").await.body;
    assert!(m.as_str().unwrap_or("").contains("agent_renewals_total{result=\"granted\"}"), "{m}");
}
