//! Staged policy rollouts end to end (issue 31; seed 002 F24/F25): two
//! regions' agents on real Redis and a real allocator, eu the canary. A
//! version 100x tighter halts by itself before its soak time is over, with
//! every refusal in the canary and under the new version; a good version
//! soaks and reaches every agent; versions only move forward.

mod common;

use common::{acquire, World};
use quota_tests::http::{Http, Resp};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::time::Duration;
use tokio::time::Instant;

/// Statuses (the watcher's counts) every 300 ms instead of 2 s.
const STATUS_EVERY: (&str, &str) = ("AGENT_STATUS_INTERVAL_MS", "300");

/// A policy of atlas/read: small leases that live 5 s, so a region meets
/// the allocator (and a new version) often.
fn policy(limit: i64) -> Value {
    json!({"limit": limit, "window_secs": 60, "chunk_min": 5, "chunk_max": 100, "lease_ttl_secs": 5})
}

/// Answers by (status, code, the version the answer names).
#[derive(Debug, Default)]
struct ByVersion(BTreeMap<(u16, String, i64), i64>);

impl ByVersion {
    fn add(&mut self, r: &Resp) {
        assert!(
            r.status == 200 || (r.status, r.error()) == (429, "quota_exhausted"),
            "{} {}",
            r.status,
            r.body
        );
        let v = r.header("quota-policy-version").and_then(|v| v.parse().ok()).unwrap_or(-1);
        *self.0.entry((r.status, r.error().to_string(), v)).or_default() += 1;
    }

    fn refused(&self) -> i64 {
        self.0.iter().filter(|((s, _, _), _)| *s == 429).map(|(_, n)| n).sum()
    }

    fn versions_refused(&self) -> Vec<i64> {
        let mut v: Vec<i64> = self.0.keys().filter(|(s, _, _)| *s == 429).map(|(_, _, v)| *v).collect();
        v.dedup();
        v
    }
}

async fn rollout_of(admin: &Http) -> Value {
    admin.get("/v1/policies/atlas/read").await.expect(200).body["rollout"].clone()
}

/// Sends a round of acquires to each region (10 each, ~50/s per region)
/// until the rollout is no longer `canary` or `deadline` passes; answers
/// the last rollout state seen and each region's tally.
async fn drive_until_ended(
    admin: &Http,
    eu: &Http,
    us: &Http,
    deadline: Instant,
) -> (Value, ByVersion, ByVersion) {
    let (mut e, mut u) = (ByVersion::default(), ByVersion::default());
    loop {
        for _ in 0..10 {
            let (a, b) = tokio::join!(acquire(eu, "atlas", "read"), acquire(us, "atlas", "read"));
            e.add(&a);
            u.add(&b);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let r = rollout_of(admin).await;
        if r["state"] != "canary" || Instant::now() >= deadline {
            return (r, e, u);
        }
    }
}

/// Polls acquires of `http` until one names `version` (answers under an
/// older one while the region renews are expected).
async fn until_on_version(http: &Http, version: i64, within: Duration) -> Resp {
    let deadline = Instant::now() + within;
    loop {
        let r = acquire(http, "atlas", "read").await;
        if r.status == 200 && r.body["policy_version"].as_i64() == Some(version) {
            return r;
        }
        assert!(
            Instant::now() < deadline,
            "never admitted under version {version}: last {} {}",
            r.status,
            r.body
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_100x_tighter_halts_by_itself_in_the_canary_and_a_good_one_reaches_every_agent() {
    let w = World::start().await;
    let admin = &w.stack.http;
    assert_eq!(w.policy("atlas", "read", policy(100_000)).await["version"], 1);
    let eu = w.agent("eu", "eu-1", None, &[("AGENT_REDIS_PREFIX", "eu:"), STATUS_EVERY]).await;
    let us = w.agent("us", "us-1", None, &[("AGENT_REDIS_PREFIX", "us:"), STATUS_EVERY]).await;
    until_on_version(&eu.http, 1, Duration::from_secs(10)).await;
    until_on_version(&us.http, 1, Duration::from_secs(10)).await;

    // F25: 1,000 per window published instead of 100,000, to eu first.
    let soak = 60;
    let mut bad = policy(1_000);
    bad["rollout"] = json!({"canary_regions": ["eu"], "soak_secs": soak, "min_decisions": 50});
    let started = Instant::now();
    let p = admin.put("/v1/policies/atlas/read", &bad).await.expect(200).body;
    assert_eq!((p["version"].as_i64(), p["limit"].as_i64()), (Some(1), Some(100_000)), "{p}");
    assert_eq!(p["rollout"]["state"], "canary");
    assert_eq!((p["rollout"]["version"].as_i64(), p["rollout"]["limit"].as_i64()), (Some(2), Some(1_000)));

    let deadline = started + Duration::from_secs(soak as u64);
    let (r, e, u) = drive_until_ended(admin, &eu.http, &us.http, deadline).await;
    let took = started.elapsed();
    eprintln!("halted after {took:?}: {r}\neu {:?}\nus {:?}", e.0, u.0);
    assert_eq!(r["state"], "halted", "the rollout did not halt within its soak time: {r}");
    assert_eq!(r["ended_by"], "rollout-watcher");
    assert!(took < Duration::from_secs(soak as u64), "halted after the soak time: {took:?}");
    let measured = &r["measured"];
    assert!(measured["new"]["refused"].as_i64() > Some(0), "{r}");
    // Refusals only in the canary, and only under the new version.
    assert_eq!(u.refused(), 0, "a region outside the canary refused: {:?}", u.0);
    assert!(e.refused() > 0, "the canary never refused: {:?}", e.0);
    assert_eq!(e.versions_refused(), [2], "{:?}", e.0);

    // The canary is back on the old policy, published as version 3; the
    // other region moves to 3 as well (same content), never back to 2.
    let halted_to = r["halted_to_version"].as_i64().expect("halted_to_version");
    assert_eq!(halted_to, 3);
    let p = admin.get("/v1/policies/atlas/read").await.expect(200).body;
    assert_eq!((p["version"].as_i64(), p["limit"].as_i64()), (Some(3), Some(100_000)), "{p}");
    let back = until_on_version(&eu.http, 3, Duration::from_secs(15)).await;
    assert_eq!(back.header("quota-policy-version"), Some("3"));
    until_on_version(&us.http, 3, Duration::from_secs(15)).await;
    // Once on 3, never back to 2 (a late answer naming the candidate is ignored).
    for _ in 0..20 {
        let r = acquire(&eu.http, "atlas", "read").await;
        assert_eq!(r.header("quota-policy-version"), Some("3"), "{} {}", r.status, r.body);
    }
    // A late halt or promote naming the old candidate changes nothing.
    let late = admin.post("/v1/policies/atlas/read/rollout/promote", &json!({"version": 2})).await;
    assert_eq!((late.status, late.error()), (409, "no_live_rollout"), "{}", late.body);

    // A good version (twice the limit) soaks 3 s and reaches every agent.
    let mut good = policy(200_000);
    good["rollout"] = json!({"canary_regions": ["eu"], "soak_secs": 3, "min_decisions": 20});
    let p = admin.put("/v1/policies/atlas/read", &good).await.expect(200).body;
    assert_eq!(p["rollout"]["version"], 4, "{p}");
    let (r, e, u) =
        drive_until_ended(admin, &eu.http, &us.http, Instant::now() + Duration::from_secs(30)).await;
    assert_eq!(r["state"], "promoted", "{r}");
    assert_eq!((e.refused(), u.refused()), (0, 0), "eu {:?} us {:?}", e.0, u.0);
    let p = admin.get("/v1/policies/atlas/read").await.expect(200).body;
    assert_eq!((p["version"].as_i64(), p["limit"].as_i64()), (Some(4), Some(200_000)), "{p}");
    until_on_version(&us.http, 4, Duration::from_secs(15)).await;
    until_on_version(&eu.http, 4, Duration::from_secs(15)).await;
}
