//! Demand-weighted allocation (DESIGN §4) measured over the grant API: two
//! regions renew ahead of need the way an agent does, and the test counts
//! what each could admit from what it was granted.

use quota_tests::fixtures::{grant, grant_body, put_policy, register, Stack};
use quota_tests::http::Http;
use serde_json::json;

/// Steps a window is simulated in.
const STEPS: i64 = 20;

struct Region {
    name: &'static str,
    demand: i64,
    epoch: i64,
    seq: i64,
    balance: i64,
    admitted: i64,
    granted: i64,
}

/// Runs one window: every step each region renews when its balance covers
/// less than two steps of demand (asking for four), then admits what its
/// demand for the step asks, up to its balance.
async fn simulate(http: &Http, regions: &mut [Region]) {
    for step in 0..STEPS {
        // Alternate who asks first, as concurrent regions would.
        let order: Vec<usize> =
            if step % 2 == 0 { (0..regions.len()).collect() } else { (0..regions.len()).rev().collect() };
        for &i in &order {
            let r = &mut regions[i];
            let per_step = r.demand / STEPS;
            if r.balance < 2 * per_step {
                r.seq += 1;
                let body = grant_body(
                    "atlas",
                    "read",
                    r.name,
                    &format!("{}-1", r.name),
                    r.epoch,
                    r.seq,
                    4 * per_step,
                    r.demand as f64,
                );
                let tokens = grant(http, &body).await.expect(200).body["tokens"].as_i64().unwrap();
                r.balance += tokens;
                r.granted += tokens;
            }
        }
        for r in regions.iter_mut() {
            let spend = (r.demand / STEPS).min(r.balance);
            r.balance -= spend;
            r.admitted += spend;
        }
    }
}

async fn setup(demands: &[(&'static str, i64)]) -> (Stack, Vec<Region>) {
    let s = Stack::start().await;
    put_policy(&s.http, "atlas", "read", json!({"limit": 1000, "window_secs": 3600, "chunk_min": 10, "chunk_max": 500, "lease_ttl_secs": 3600})).await;
    let mut regions = Vec::new();
    for (name, demand) in demands {
        let epoch = register(&s.http, name, &format!("{name}-1")).await;
        regions.push(Region { name, demand: *demand, epoch, seq: 0, balance: 0, admitted: 0, granted: 0 });
    }
    (s, regions)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn skew_900_100_admits_at_least_98_percent_of_each_regions_demand() {
    let (s, mut regions) = setup(&[("eu", 900), ("us", 100)]).await;
    simulate(&s.http, &mut regions).await;
    for r in &regions {
        let pct = r.admitted as f64 / r.demand as f64;
        assert!(pct >= 0.98, "{} admitted {} of {} ({:.1} %)", r.name, r.admitted, r.demand, pct * 100.0);
    }
    assert!(regions.iter().map(|r| r.granted).sum::<i64>() <= 1000);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contention_2000_500_uses_97_percent_of_g_and_shares_by_demand() {
    let (s, mut regions) = setup(&[("eu", 2000), ("us", 500)]).await;
    simulate(&s.http, &mut regions).await;
    let total: i64 = regions.iter().map(|r| r.admitted).sum();
    assert!(total >= 970, "admitted {total} of G = 1000");
    let eu_share = regions[0].admitted as f64 / total as f64;
    assert!((eu_share - 0.8).abs() <= 0.10, "EU share of admits {:.3}, demand share 0.8", eu_share);
    assert!(regions.iter().map(|r| r.granted).sum::<i64>() <= 1000);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_region_without_demand_parks_at_most_chunk_min() {
    let (s, regions) = setup(&[("eu", 900), ("us", 0)]).await;
    let us = &regions[1];
    let body = grant_body("atlas", "read", "us", "us-1", us.epoch, 1, 400, 0.0);
    let r = grant(&s.http, &body).await.expect(200);
    assert_eq!(r.body["tokens"], 10, "idle region gets chunk_min, not its want");
}
