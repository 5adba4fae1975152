//! Concurrency quotas (issue 30, item 1; seed 002 F27): an export that
//! runs long is capped at 3 in flight per tenant across two regions. The
//! live permits are counted from what the clients hold (a permit is live
//! for its holder from the acquire's answer until the holder releases it
//! or its last known expiry passes), and never exceed 3: under load from
//! both regions, after a holder dies without releasing, across a
//! partition of one region from the allocator that outlasts its lease, and
//! across a loss of the region's Redis. Real allocator on PostgreSQL,
//! Redis, two agents as processes (one behind a fault proxy).

mod common;

use common::World;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use quota_tests::agent::{AgentOpts, AgentProc};
use quota_tests::http::{metric, Http, Resp};
use quota_tests::proxy::{Fault, FaultProxy};
use serde_json::json;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const CAP: usize = 3;

/// The permits the clients believe they hold, with when each expires.
#[derive(Default)]
struct Held {
    live: Mutex<HashMap<String, Instant>>,
    peak: Mutex<usize>,
    admitted: Mutex<HashMap<&'static str, usize>>,
}

impl Held {
    /// A permit answered: counts the live ones with it and keeps the peak.
    fn add(&self, region: &'static str, r: &Resp) -> String {
        let id = r.body["permit_id"].as_str().unwrap_or_else(|| panic!("permit_id: {}", r.body)).to_string();
        let ms = r.body["permit_expires_in_ms"].as_u64().unwrap_or_else(|| panic!("expiry: {}", r.body));
        let now = Instant::now();
        let mut live = self.live.lock().unwrap();
        live.retain(|_, until| *until > now);
        live.insert(id.clone(), now + Duration::from_millis(ms));
        let n = live.len();
        let mut peak = self.peak.lock().unwrap();
        *peak = (*peak).max(n);
        *self.admitted.lock().unwrap().entry(region).or_default() += 1;
        assert!(n <= CAP, "{n} permits live at once: {:?}", live.keys().collect::<Vec<_>>());
        id
    }

    /// A renewal answered: the permit lives that much longer.
    fn renewed(&self, id: &str, r: &Resp) {
        let ms = r.body["expires_in_ms"].as_u64().unwrap_or(0);
        if let Some(until) = self.live.lock().unwrap().get_mut(id) {
            *until = Instant::now() + Duration::from_millis(ms);
        }
    }

    /// The holder gives the permit up (before it says so to the agent).
    fn drop_id(&self, id: &str) {
        self.live.lock().unwrap().remove(id);
    }

    fn peak(&self) -> usize {
        *self.peak.lock().unwrap()
    }

    fn admitted(&self, region: &str) -> usize {
        self.admitted.lock().unwrap().get(region).copied().unwrap_or(0)
    }
}

async fn take(http: &Http, key: Option<&str>) -> Resp {
    let mut body = json!({"tenant": "atlas", "resource": "export"});
    if let Some(k) = key {
        body["key"] = json!(k);
    }
    http.post("/v1/acquire", &body).await
}

async fn release(http: &Http, id: &str, key: Option<&str>) -> Resp {
    let body = key.map_or(json!({}), |k| json!({"key": k}));
    http.post(&format!("/v1/permits/{id}/release"), &body).await
}

async fn renew(http: &Http, id: &str) -> Resp {
    http.post(&format!("/v1/permits/{id}/renew"), &json!({})).await
}

fn refused_for_concurrency(r: &Resp) -> bool {
    r.status == 429 && r.body["limit"] == "concurrency"
}

/// One export: a permit (polling politely while refused, at most `wait`),
/// held for `run` while renewing every `every`, then released.
async fn export(held: &Held, region: &'static str, http: &Http, run: Duration, every: Duration) -> bool {
    let r = take(http, None).await;
    if r.status != 200 {
        assert!(refused_for_concurrency(&r), "{region}: {} {}", r.status, r.body);
        assert!(r.header("retry-after").is_some(), "{}", r.body);
        return false;
    }
    assert_eq!(r.body["source"], "permit", "{}", r.body);
    let id = held.add(region, &r);
    let end = Instant::now() + run;
    while Instant::now() < end {
        // The job's own pace between heartbeats.
        tokio::time::sleep(every.min(end.saturating_duration_since(Instant::now()))).await;
        let n = renew(http, &id).await;
        assert_eq!(n.status, 200, "renew {id}: {}", n.body);
        held.renewed(&id, &n);
    }
    held.drop_id(&id);
    let rel = release(http, &id, None).await.expect(200);
    assert_eq!(rel.body["released"], true, "{}", rel.body);
    true
}

async fn concurrency_world(ttl: u64) -> World {
    let w = World::start().await;
    let p = w
        .policy(
            "atlas",
            "export",
            json!({"kind": "concurrency", "max_in_flight": CAP, "permit_ttl_secs": ttl, "fail_mode": "strict"}),
        )
        .await;
    assert_eq!(
        (p["kind"].as_str(), p["max_in_flight"].as_u64()),
        (Some("concurrency"), Some(CAP as u64)),
        "{p}"
    );
    w
}

/// Live permits the allocator sees leased to regions.
async fn leased(w: &World) -> i64 {
    let v = w.stack.http.get("/v1/permits/atlas/export").await.expect(200);
    v.body["held"].as_i64().unwrap_or(-1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exports_from_two_regions_never_exceed_three_and_a_dead_holders_permit_comes_back_within_its_ttl() {
    const TTL: u64 = 3;
    let w = concurrency_world(TTL).await;
    let grpc = format!("127.0.0.1:{}", quota_tests::free_port());
    let eu = w.agent("eu", "eu-1", None, &[("AGENT_GRPC_LISTEN", &grpc)]).await;
    let us = w.agent("us", "us-1", None, &[("AGENT_REDIS_PREFIX", "us:")]).await;
    let held = Arc::new(Held::default());

    // F27 shortened: exports arrive every 150 ms in each region and run
    // 900 ms with a heartbeat every 300 ms: three times the cap in demand.
    let arrivals = |region: &'static str, http: Http| {
        let held = held.clone();
        async move {
            let mut jobs = Vec::new();
            for _ in 0..30 {
                let (held, http) = (held.clone(), http.clone());
                jobs.push(tokio::spawn(async move {
                    export(&held, region, &http, Duration::from_millis(900), Duration::from_millis(300)).await
                }));
                // The arrival rate, not a wait for the server.
                tokio::time::sleep(Duration::from_millis(150)).await;
            }
            let mut done = 0;
            for j in jobs {
                done += usize::from(j.await.expect("export"));
            }
            done
        }
    };
    let (eu_done, us_done) = futures::join!(arrivals("eu", eu.http.clone()), arrivals("us", us.http.clone()));
    eprintln!("exports run: eu {eu_done}, us {us_done}, peak live {}", held.peak());
    assert!(held.peak() <= CAP);
    assert_eq!(held.peak(), CAP, "demand at three times the cap reaches it");
    assert!(eu_done >= 1 && us_done >= 1, "both regions ran exports: eu {eu_done}, us {us_done}");
    assert!(eu_done + us_done >= 8, "the cap is used: {eu_done} + {us_done} exports in ~5 s");
    assert_eq!((held.admitted("eu"), held.admitted("us")), (eu_done, us_done));

    // Three holders: eu two (one of them a job that will die), us one.
    // The job that will die takes its permit last, so its acquire is its
    // last sign of life: ids = [dying (eu), living (eu), living (us)].
    let mut got = Vec::new();
    for (region, http) in [("eu", &eu.http), ("us", &us.http), ("eu", &eu.http)] {
        let r = quota_tests::wait::until("a permit", Duration::from_secs(10), || async {
            let r = take(http, None).await;
            (r.status == 200).then_some(r)
        })
        .await;
        got.push(held.add(region, &r));
    }
    let last_seen = Instant::now();
    let ids = [got[2].clone(), got[0].clone(), got[1].clone()];
    // Full everywhere: a 429 naming the limit, with a Retry-After.
    for http in [&eu.http, &us.http] {
        let r = take(http, None).await;
        assert!(refused_for_concurrency(&r), "{} {}", r.status, r.body);
        assert_eq!(r.error(), "quota_exhausted", "{}", r.body);
        assert!(r.header("retry-after").is_some(), "{}", r.body);
    }
    assert!(leased(&w).await <= CAP as i64);
    // The region's view in /v1/status: two handed out under the lease.
    let st = eu.http.get("/v1/status").await.expect(200);
    let mine = st.body["permits"]
        .as_array()
        .and_then(|a| a.iter().find(|p| p["resource"] == "export").cloned())
        .unwrap_or_else(|| panic!("no export in {}", st.body));
    assert_eq!((mine["live"].as_i64(), mine["max_in_flight"].as_i64()), (Some(2), Some(3)), "{mine}");
    assert!(mine["cap"].as_i64().is_some_and(|c| c >= 2) && mine["lost"] == false, "{mine}");

    // The holder of ids[0] dies (SIGKILL of the job: no release, no more
    // heartbeats). Its permit expires within the TTL, and then another
    // region gets it: us polls until it does.
    // The two living jobs keep heartbeating meanwhile.
    let r = quota_tests::wait::until("the dead holder's permit", Duration::from_secs(TTL + 10), || async {
        for (http, id) in [(&eu.http, &ids[1]), (&us.http, &ids[2])] {
            let n = renew(http, id).await.expect(200);
            held.renewed(id, &n);
        }
        let r = take(&us.http, None).await;
        if r.status == 200 {
            return Some(r);
        }
        assert!(refused_for_concurrency(&r), "{} {}", r.status, r.body);
        None
    })
    .await;
    let back = last_seen.elapsed();
    // Counted as live by its dead holder until its expiry.
    let id = held.add("us", &r);
    eprintln!("a dead holder's permit reached another region {back:?} after the holder's last sign of life (TTL {TTL} s)");
    // Not before its expiry; then eu gives its idle permit back (one 2 s
    // tidy tick at most) and us asks: TTL + 2 s, with 3 s of margin for a
    // slow machine.
    assert!(back >= Duration::from_millis(TTL * 1000 - 100), "{back:?}");
    assert!(back <= Duration::from_secs(TTL + 5), "{back:?}");
    // us's two jobs heartbeat until they end below.
    let us_jobs = {
        let (held, http, ids) = (held.clone(), us.http.clone(), [ids[2].clone(), id.clone()]);
        tokio::spawn(async move {
            loop {
                for id in &ids {
                    let n = renew(&http, id).await.expect(200);
                    held.renewed(id, &n);
                }
                // The jobs' heartbeat period.
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        })
    };
    let renewed = renew(&eu.http, &ids[0]).await;
    assert_eq!((renewed.status, renewed.error()), (404, "permit_not_found"), "{}", renewed.body);

    // Double release: the first returns the permit, the second changes nothing.
    held.drop_id(&ids[1]);
    assert_eq!(release(&eu.http, &ids[1], None).await.expect(200).body["released"], true);
    assert_eq!(release(&eu.http, &ids[1], None).await.expect(200).body["released"], false);
    assert_eq!(release(&us.http, &ids[1], None).await.expect(200).body["released"], false);
    // Exactly one permit came back: one acquire succeeds, the next is refused.
    let r = quota_tests::wait::until("the released permit", Duration::from_secs(10), || async {
        let r = take(&eu.http, Some("alice")).await;
        (r.status == 200).then_some(r)
    })
    .await;
    let alices = held.add("eu", &r);
    assert!(refused_for_concurrency(&take(&eu.http, None).await));
    assert!(refused_for_concurrency(&take(&us.http, None).await));

    // Another holder's release changes nothing; the holder's renewal works.
    let bob = release(&eu.http, &alices, Some("bob")).await;
    assert_eq!((bob.status, bob.error()), (409, "not_holder"), "{}", bob.body);
    assert_eq!(renew(&eu.http, &alices).await.status, 200);
    assert!(refused_for_concurrency(&take(&eu.http, None).await));

    // A retried acquire with the same request id gets the same permit;
    // the same request id from another key is refused.
    let first = eu
        .http
        .post(
            "/v1/acquire",
            &json!({"tenant": "atlas", "resource": "export", "key": "alice", "request_id": "job-42"}),
        )
        .await;
    assert!(refused_for_concurrency(&first), "full: {}", first.body);
    held.drop_id(&alices);
    assert_eq!(release(&eu.http, &alices, Some("alice")).await.expect(200).body["released"], true);
    let body = json!({"tenant": "atlas", "resource": "export", "key": "alice", "request_id": "job-42"});
    let r = eu.http.post("/v1/acquire", &body).await.expect(200);
    let alices = held.add("eu", &r);
    let again = eu.http.post("/v1/acquire", &body).await.expect(200);
    assert_eq!(again.body["permit_id"], json!(alices), "{}", again.body);
    let other = eu
        .http
        .post(
            "/v1/acquire",
            &json!({"tenant": "atlas", "resource": "export", "key": "bob", "request_id": "job-42"}),
        )
        .await;
    assert_eq!((other.status, other.error()), (409, "request_id_mismatch"), "{}", other.body);

    // Bad input names the problem.
    let bad = release(&eu.http, "not-a-permit", None).await;
    assert_eq!((bad.status, bad.body["field"].as_str()), (422, Some("permit_id")), "{}", bad.body);
    let cost =
        eu.http.post("/v1/acquire", &json!({"tenant": "atlas", "resource": "export", "cost": 2})).await;
    assert_eq!((cost.status, cost.body["field"].as_str()), (422, Some("cost")), "{}", cost.body);
    w.policy("atlas", "read", json!({"limit": 100, "window_secs": 60})).await;
    // A permit id naming a rate quota finds no permit and changes nothing:
    // the quota stays a rate quota.
    let forged = format!("atlas~read~{}", "0".repeat(32));
    for route in ["release", "renew"] {
        let r = eu.http.post(&format!("/v1/permits/{forged}/{route}"), &json!({})).await;
        let want = if route == "release" { 200 } else { 404 };
        assert_eq!(r.status, want, "{route}: {}", r.body);
    }
    let read = eu.http.post("/v1/acquire", &json!({"tenant": "atlas", "resource": "read"})).await.expect(200);
    assert_eq!(read.body["source"], "lease", "{}", read.body);
    // A TTL of an hour: the lease's slack grows with it, so a permit fits.
    w.policy("atlas", "report", json!({"kind": "concurrency", "max_in_flight": 1, "permit_ttl_secs": 3600}))
        .await;
    let long = quota_tests::wait::until("a one-hour permit", Duration::from_secs(10), || async {
        let r = eu.http.post("/v1/acquire", &json!({"tenant": "atlas", "resource": "report"})).await;
        (r.status == 200).then_some(r)
    })
    .await;
    assert_eq!(long.body["permit_expires_in_ms"], 3_600_000, "{}", long.body);
    let long_id = long.body["permit_id"].as_str().unwrap_or_default().to_string();
    assert_eq!(release(&eu.http, &long_id, None).await.expect(200).body["released"], true);
    let multi = eu
        .http
        .post(
            "/v1/acquire",
            &json!({"tenant": "atlas", "resources": [{"resource": "read"}, {"resource": "export"}]}),
        )
        .await;
    assert_eq!(multi.status, 422, "{}", multi.body);
    assert!(multi.body["message"].as_str().unwrap_or_default().contains("concurrency"), "{}", multi.body);
    // Over RLS (Envoy never releases): refused, with the reason.
    let rls = common::rls_atlas(&grpc, &[("resource", "export")]).await;
    assert_eq!(rls.overall_code, Code::OverLimit as i32, "{rls:?}");
    let reason =
        rls.response_headers_to_add.iter().find(|h| h.key == "x-quota-refused").map(|h| h.value.clone());
    assert_eq!(reason.as_deref(), Some("concurrency"), "{rls:?}");

    // Everything released: the permits go back to the allocator.
    us_jobs.abort();
    let _ = us_jobs.await;
    for id in [&ids[2], &id] {
        held.drop_id(id);
        assert_eq!(release(&us.http, id, None).await.expect(200).body["released"], true);
    }
    held.drop_id(&alices);
    assert_eq!(release(&eu.http, &alices, Some("alice")).await.expect(200).body["released"], true);
    quota_tests::wait::until("every permit back at the allocator", Duration::from_secs(10), || async {
        (leased(&w).await == 0).then_some(())
    })
    .await;
    let m = eu.http.get("/metrics").await.expect(200);
    let text = m.body.as_str().unwrap_or_default();
    assert!(
        metric(text, "agent_permit_decisions_total{outcome=\"granted\"}").unwrap_or(0.0) >= 1.0,
        "{text}"
    );
    assert!(metric(text, "agent_permit_decisions_total{outcome=\"not_holder\"}").unwrap_or(0.0) >= 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_longer_than_the_lease_and_a_lost_redis_keep_the_bound() {
    const TTL: u64 = 2;
    let mut w = concurrency_world(TTL).await;
    let sw = FaultProxy::in_front_of(&w.stack.alloc.base).await.expect("fault proxy");
    let eu =
        AgentProc::spawn(common::bin(), AgentOpts::new("eu", "eu-1", &sw.http_url(), w.redis_url())).await;
    let us = w.agent("us", "us-1", None, &[("AGENT_REDIS_PREFIX", "us:")]).await;
    let held = Arc::new(Held::default());

    // eu's two jobs keep their permits by heartbeats, each until a
    // heartbeat fails (then the job stops: it knows it lost its permit).
    let mut eu_ids = Vec::new();
    for _ in 0..2 {
        let r = quota_tests::wait::until("an eu permit", Duration::from_secs(10), || async {
            let r = take(&eu.http, None).await;
            (r.status == 200).then_some(r)
        })
        .await;
        eu_ids.push(held.add("eu", &r));
    }
    let heartbeats = {
        let (held, http, ids) = (held.clone(), eu.http.clone(), eu_ids.clone());
        tokio::spawn(async move {
            let mut alive = ids;
            while !alive.is_empty() {
                // The jobs' heartbeat period.
                tokio::time::sleep(Duration::from_millis(500)).await;
                let mut still = Vec::new();
                for id in alive {
                    let r = renew(&http, &id).await;
                    if r.status == 200 {
                        held.renewed(&id, &r);
                        still.push(id);
                    } else {
                        assert_eq!(r.error(), "permit_not_found", "{}", r.body);
                        held.drop_id(&id);
                    }
                }
                alive = still;
            }
        })
    };

    // eu is cut off from the allocator. Its jobs keep their permits while
    // its lease lasts; us gets the one permit left, never more.
    sw.set(Fault::Blackhole);
    let cut = Instant::now();
    let mut us_ids = Vec::new();
    let mut eu_refusals = HashMap::<String, usize>::new();
    let mut eu_lost_at = None;
    while us_ids.len() < CAP {
        assert!(cut.elapsed() < Duration::from_secs(60), "us never got all permits: {us_ids:?}");
        let r = take(&us.http, None).await;
        if r.status == 200 {
            us_ids.push(held.add("us", &r));
            // us's jobs keep theirs by the heartbeats below.
        } else {
            assert!(refused_for_concurrency(&r), "{} {}", r.status, r.body);
        }
        let e = take(&eu.http, None).await;
        if e.status == 200 {
            held.add("eu", &e);
        } else {
            *eu_refusals.entry(format!("{}/{}", e.status, e.error())).or_default() += 1;
        }
        if eu_lost_at.is_none()
            && held.live.lock().unwrap().keys().filter(|k| eu_ids.contains(k)).count() == 0
        {
            eu_lost_at = Some(cut.elapsed());
        }
        for id in &us_ids {
            let r = renew(&us.http, id).await.expect(200);
            held.renewed(id, &r);
        }
        // The polling pace of the clients.
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let us_all = cut.elapsed();
    heartbeats.await.expect("heartbeats");
    eprintln!(
        "partition: eu's jobs lost their permits {eu_lost_at:?} after the cut, us held all {CAP} {us_all:?} after it; \
         eu's refusals meanwhile {eu_refusals:?}; peak live {}",
        held.peak()
    );
    // eu's permits lived until its lease ended, no later than permit TTL +
    // the lease's 30 s slack after its last renewal.
    assert!(us_all >= Duration::from_secs(20), "us got eu's permits before eu's lease could end: {us_all:?}");
    assert!(us_all <= Duration::from_secs(TTL + 30 + 8), "{us_all:?}");
    // Cut off with its permits held, eu refuses: 429 while full, 503 once
    // its lease is too short for a full permit.
    assert!(
        eu_refusals.keys().all(|k| k == "429/quota_exhausted" || k == "503/allocator_unreachable"),
        "{eu_refusals:?}"
    );
    sw.set(Fault::Pass);

    // us's Redis (shared with eu here) is lost while us holds all three.
    // Its jobs' permits are forgotten, but they may still be running: no
    // permit is handed out in either region until they could have expired.
    w.redis.restart_empty();
    let lost = Instant::now();
    let r = quota_tests::wait::until("a permit after the loss", Duration::from_secs(30), || async {
        for http in [&us.http, &eu.http] {
            let r = take(http, None).await;
            if r.status == 200 {
                return Some(r);
            }
            assert!(
                refused_for_concurrency(&r) || r.status == 503,
                "after the loss: {} {}",
                r.status,
                r.body
            );
        }
        None
    })
    .await;
    let resumed = lost.elapsed();
    // The old permits, never renewed since, are counted live by their
    // holders until their expiry: the new one must fit beside them.
    held.add("after-loss", &r);
    // us's jobs learn they lost their permits at their next heartbeat.
    for id in &us_ids {
        let r = renew(&us.http, id).await;
        assert_eq!((r.status, r.error()), (404, "permit_not_found"), "{}", r.body);
        held.drop_id(id);
    }
    eprintln!("after the Redis loss, hand-outs resumed in {resumed:?} (TTL {TTL} s)");
    assert!(resumed >= Duration::from_secs(TTL), "{resumed:?}");
    let m = us.http.get("/metrics").await.expect(200);
    let text = m.body.as_str().unwrap_or_default();
    assert!(metric(text, "agent_permit_state_lost_total").unwrap_or(0.0) >= 1.0, "{text}");
    assert!(held.peak() <= CAP);
}
