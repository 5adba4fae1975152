//! Demand-weighted sharing (DESIGN §4) end to end: two regions' agents (one
//! Redis, a key prefix per region), steady load per region, client-side
//! counts of 200s in one full window aligned to a window boundary (after
//! one warm-up window at the same rates, so demand is measured).

mod common;

use common::{acquire, norm, World};
use quota_tests::http::Http;
use serde_json::json;
use std::time::Duration;
use tokio::time::Instant;

const SECS: i64 = 5;
const G: i64 = 1000;

/// Sends `per_window` acquires per window at a steady rate from `start`
/// for `windows` windows; returns the 200s answered for the window that
/// starts at `measured` (RFC 3339, normalised).
async fn drive(
    http: Http,
    resource: &'static str,
    per_window: i64,
    start: Instant,
    windows: i64,
    measured: String,
) -> i64 {
    let period = Duration::from_secs(SECS as u64) / per_window as u32;
    let mut tasks = Vec::new();
    for i in 0..per_window * windows {
        tokio::time::sleep_until(start + period * i as u32).await;
        let http = http.clone();
        tasks.push(tokio::spawn(async move {
            let r = acquire(&http, "atlas", resource).await;
            assert!(
                r.status == 200 || (r.status, r.error()) == (429, "quota_exhausted"),
                "{} {}",
                r.status,
                r.body
            );
            (r.status == 200).then(|| norm(r.body["window_start"].as_str().unwrap_or_default()))
        }));
    }
    let mut admitted = 0;
    for t in tasks {
        if t.await.unwrap().as_deref() == Some(measured.as_str()) {
            admitted += 1;
        }
    }
    admitted
}

/// Starts both regions' agents, drives one warm-up window and one measured
/// window at the given demands; returns the 200s of (EU, US) in the measured
/// window.
async fn run(resource: &'static str, eu_demand: i64, us_demand: i64) -> (i64, i64) {
    // The warm-up window starts once both agents are up, not at the next
    // real boundary.
    let w = World::start_clocked(SECS, Duration::from_secs(3)).await;
    w.policy("atlas", resource, json!({"limit": G, "window_secs": SECS})).await;
    let eu = w.agent("eu", "eu-1", None, &[("AGENT_REDIS_PREFIX", "eu:")]).await;
    let us = w.agent("us", "us-1", None, &[("AGENT_REDIS_PREFIX", "us:")]).await;
    // Align to a window boundary: one warm-up window (demand is measured),
    // then the measured window.
    let mut first = w.clock.next_boundary(SECS);
    if first * 1000 - w.clock.now().timestamp_millis() < 300 {
        first += SECS;
    }
    let measured_start = first + SECS;
    let measured = norm(&chrono::DateTime::from_timestamp(measured_start, 0).unwrap().to_rfc3339());
    w.clock.until(chrono::DateTime::from_timestamp(first, 0).unwrap()).await;
    let start = Instant::now();
    let a = tokio::spawn(drive(eu.http.clone(), resource, eu_demand, start, 2, measured.clone()));
    let b = tokio::spawn(drive(us.http.clone(), resource, us_demand, start, 2, measured.clone()));
    let (ea, ua) = (a.await.unwrap(), b.await.unwrap());
    eprintln!("{resource}: EU {ea}/{eu_demand}, US {ua}/{us_demand} admitted in the measured window");
    (ea, ua)
}

/// Contention: G = 1000, EU 2000 and US 500 per window → at least 97 % of G
/// admitted, EU's share of admits within 10 points of its 80 % of demand.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn contended_pool_is_shared_in_proportion_to_demand() {
    let (eu, us) = run("contend", 2000, 500).await;
    let total = eu + us;
    assert!(total <= G, "never more than G: {total}");
    assert!(total * 100 >= 97 * G, "admitted {total} of {G} (EU {eu}, US {us})");
    let share = eu as f64 / total as f64;
    assert!((share - 0.8).abs() <= 0.10, "EU share {share:.3} (EU {eu}, US {us})");
}

/// Skew: G = 1000, EU 900 and US 100 per window → each region admits at
/// least 98 % of its demand (a static 50/50 split would admit 60 %).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn skewed_demand_is_admitted_almost_fully_in_both_regions() {
    let (eu, us) = run("skew", 900, 100).await;
    assert!(eu + us <= G, "never more than G: {}", eu + us);
    assert!(eu * 100 >= 98 * 900, "EU admitted {eu} of 900");
    assert!(us * 100 >= 98 * 100, "US admitted {us} of 100");
}
