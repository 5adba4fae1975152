//! Priority reserves (issue 30, item 2; seed 001): a policy keeps 20 % of
//! each window for priorities 0-1. Two regions flood the quota at priority
//! 3 while a trickle of priority 1 goes on: priority 1 is never refused
//! while the reserve lasts, priority 3 stops at `G − reserve` across both
//! regions, priority 1 then gets the reserve, and the window admits at most
//! G in all, as the allocator's accounting confirms. Over RLS a reserve's
//! refusal is `OVER_LIMIT` for priority 3 and nothing for priority 1. Real
//! allocator on PostgreSQL, Redis and two agents as processes.

mod common;

use common::World;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use quota_tests::http::{Http, Resp};
use serde_json::json;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const G: i64 = 200;
const RESERVE: i64 = 40; // 20 % of G, kept for priorities 0-1

/// Answers by (priority, status, code or limit).
type Counts = Arc<Mutex<BTreeMap<(u8, u16, String), i64>>>;

async fn ask(http: &Http, priority: u8) -> Resp {
    http.post("/v1/acquire", &json!({"tenant": "atlas", "resource": "search", "priority": priority})).await
}

fn count(counts: &Counts, priority: u8, r: &Resp) {
    let what = match r.status {
        200 => "admitted".to_string(),
        _ => format!("{}/{}", r.error(), r.body["limit"].as_str().unwrap_or("")),
    };
    *counts.lock().unwrap().entry((priority, r.status, what)).or_default() += 1;
}

fn total(counts: &Counts, priority: u8, status: u16) -> i64 {
    counts
        .lock()
        .unwrap()
        .iter()
        .filter(|((p, s, _), _)| *p == priority && *s == status)
        .map(|(_, n)| n)
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn priority_3_stops_at_the_reserve_in_both_regions_and_priority_1_gets_it() {
    let w = World::start().await;
    w.policy(
        "atlas",
        "search",
        json!({"limit": G, "window_secs": 3600, "chunk_min": 5, "chunk_max": 20,
               "reserve": [{"up_to_priority": 1, "pct": 20}]}),
    )
    .await;
    let grpc = format!("127.0.0.1:{}", quota_tests::free_port());
    let eu = w.agent("eu", "eu-1", None, &[("AGENT_GRPC_LISTEN", &grpc)]).await;
    let us = w.agent("us", "us-1", None, &[("AGENT_REDIS_PREFIX", "us:")]).await;
    let counts: Counts = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));

    // Priority 3 from both regions, two clients each, until each has been
    // refused by the reserve 20 times in a row (at most 30 s).
    let deadline = Instant::now() + Duration::from_secs(30);
    let flood = |http: Http| {
        let counts = counts.clone();
        async move {
            let mut in_a_row = 0;
            while in_a_row < 20 && Instant::now() < deadline {
                let r = ask(&http, 3).await;
                count(&counts, 3, &r);
                if r.status == 429 && r.body["limit"] == "reserve" {
                    assert_eq!(r.error(), "quota_exhausted", "{}", r.body);
                    assert!(r.header("retry-after").is_some(), "{}", r.body);
                    in_a_row += 1;
                } else {
                    assert_eq!(r.status, 200, "priority 3 before the reserve: {}", r.body);
                    in_a_row = 0;
                }
            }
        }
    };
    // A trickle of priority 1 meanwhile, one every 25 ms per region.
    let trickle = |http: Http| {
        let (counts, stop) = (counts.clone(), stop.clone());
        async move {
            while !stop.load(Ordering::Acquire) {
                let r = ask(&http, 1).await;
                count(&counts, 1, &r);
                // The client's pace, not a wait for the server.
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
        }
    };
    let trickles = tokio::spawn({
        let (t_eu, t_us) = (trickle(eu.http.clone()), trickle(us.http.clone()));
        async move { futures::join!(t_eu, t_us) }
    });
    futures::join!(
        flood(eu.http.clone()),
        flood(eu.http.clone()),
        flood(us.http.clone()),
        flood(us.http.clone())
    );
    stop.store(true, Ordering::Release);
    trickles.await.expect("trickles");
    let (p3, p1_during) = (total(&counts, 3, 200), total(&counts, 1, 200));
    eprintln!("during the flood: {:?}", counts.lock().unwrap());
    assert_eq!(total(&counts, 1, 429) + total(&counts, 1, 503), 0, "priority 1 refused during the flood");
    assert!(p1_during > 0 && p1_during < RESERVE, "the trickle fits in the reserve: {p1_during}");
    // The reserve holds across regions: priority 3 never takes it.
    assert!(p3 <= G - RESERVE, "priority 3 took {p3} of {G} with {RESERVE} reserved");
    // ... and is not refused far from it (each region's view of the pool
    // is at most one grant behind).
    assert!(p3 >= G - RESERVE - p1_during - 2 * 20, "priority 3 stopped early at {p3}");

    // Over RLS on eu: priority 3 is over the limit, priority 1 is not,
    // unless eu has spent its own share of the reserve: once the pool is
    // drained, the rest of the reserve can sit in us's balance (documented
    // in docs/api.md), and then eu refuses priority 1 for the quota,
    // never for the reserve.
    let r = common::rls_atlas(&grpc, &[("resource", "search"), ("priority", "3")]).await;
    assert_eq!(r.overall_code, Code::OverLimit as i32, "priority 3: {r:?}");
    let r = common::rls_atlas(&grpc, &[("resource", "search"), ("priority", "1")]).await;
    let mut p1 = p1_during;
    if r.overall_code == Code::Ok as i32 {
        p1 += 1;
    } else {
        assert_eq!(r.overall_code, Code::OverLimit as i32, "priority 1: {r:?}");
        let h = ask(&eu.http, 1).await;
        count(&counts, 1, &h);
        assert_eq!(
            (h.status, h.error(), &h.body["limit"]),
            (429, "quota_exhausted", &json!("search")),
            "priority 1 over RLS was over the limit, so eu's share must be spent: {}",
            h.body
        );
    }

    // Priority 1 drains the rest from both regions: the window admits at
    // most G in all, and priority 1 had the reserve.
    for http in [&eu.http, &us.http] {
        loop {
            let r = ask(http, 1).await;
            count(&counts, 1, &r);
            match r.status {
                200 => p1 += 1,
                429 => {
                    assert_eq!(
                        (r.error(), &r.body["limit"]),
                        ("quota_exhausted", &json!("search")),
                        "{}",
                        r.body
                    );
                    break;
                }
                _ => panic!("priority 1 while draining: {} {}", r.status, r.body),
            }
        }
    }
    eprintln!(
        "priority 3 admitted {p3}, priority 1 {p1} (reserve {RESERVE}, G {G}): {:?}",
        counts.lock().unwrap()
    );
    assert!(p3 + p1 <= G, "{p3} + {p1} > {G}");
    assert!(p1 >= RESERVE, "priority 1 got {p1}, less than the reserve {RESERVE}");
    // The allocator counts exactly what the clients were admitted.
    w.wait_consumed("search", p3 + p1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_reserves_are_422_naming_the_entry() {
    let w = World::start().await;
    let cases = [
        (json!([{"up_to_priority": 4, "pct": 10}]), "reserve[0].up_to_priority"),
        (json!([{"up_to_priority": 1, "pct": 0}]), "reserve[0].pct"),
        (
            json!([{"up_to_priority": 1, "pct": 10}, {"up_to_priority": 1, "pct": 5}]),
            "reserve[1].up_to_priority",
        ),
        (json!([{"up_to_priority": 0, "pct": 60}, {"up_to_priority": 1, "pct": 50}]), "reserve"),
        (json!([{"up_to_priority": 1}]), "pct"),
        (json!([{"up_to_priority": 1, "pct": 10, "share": 3}]), "share"),
    ];
    for (reserve, field) in cases {
        let body = json!({"limit": 100, "window_secs": 60, "reserve": reserve});
        let r = w.stack.http.put("/v1/policies/atlas/bad", &body).await;
        assert_eq!(r.status, 422, "{body}: {}", r.body);
        assert!(r.body["message"].as_str().unwrap_or_default().contains(field), "{body}: {}", r.body);
    }
    let ok = w
        .stack
        .http
        .put(
            "/v1/policies/atlas/good",
            &json!({"limit": 100, "window_secs": 60, "reserve": [{"up_to_priority": 1, "pct": 10}, {"up_to_priority": 0, "pct": 5}]}),
        )
        .await
        .expect(200);
    // Kept sorted by priority, shown as written.
    assert_eq!(
        ok.body["reserve"],
        json!([{"up_to_priority": 0, "pct": 5}, {"up_to_priority": 1, "pct": 10}])
    );
}
