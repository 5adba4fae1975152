//! `export-concurrency` (issue 30; seed 002 F27): exports capped at 3 in
//! flight per tenant across regions, at F27's numbers shortened 50 times
//! in time (0.1 exports/s of 90 s each becomes 5/s of 1.8 s: demand at
//! three times the cap), from both regions, while the rate quota's traffic
//! goes on. Live permits are counted from what the clients hold (from the
//! acquire's answer until the holder releases it or its last known expiry
//! passes) and never exceed 3: under load, when a holder dies without
//! releasing (its permit must come back within the TTL), across a double
//! release, and while a region is cut off from the allocator.

use super::harness::{Profile, Run, TENANT};
use crate::bins::Bins;
use crate::report::ScenarioReport;
use quota_tests::http::{Http, Resp};
use quota_tests::proxy::Fault;
use serde_json::json;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The concurrency quota of the scenario.
const EXPORT: &str = "export";
const CAP: usize = 3;
const TTL_SECS: u64 = 3;
/// One export's run (90 s / 50).
const RUN: Duration = Duration::from_millis(1800);
/// The heartbeat period of a running export.
const BEAT: Duration = Duration::from_millis(500);
/// Time between export arrivals in each region (5/s in all: 0.1/s × 50).
const EVERY: Duration = Duration::from_millis(400);

/// What the clients hold and saw.
#[derive(Default)]
struct Held {
    live: Mutex<HashMap<String, Instant>>,
    peak: Mutex<usize>,
    /// Exports run and refusals by region and answer.
    counts: Mutex<HashMap<(String, String), u64>>,
}

impl Held {
    fn add(&self, id: &str, expires_in_ms: u64) {
        let now = Instant::now();
        let mut live = self.live.lock().unwrap();
        live.retain(|_, until| *until > now);
        live.insert(id.to_string(), now + Duration::from_millis(expires_in_ms));
        let mut peak = self.peak.lock().unwrap();
        *peak = (*peak).max(live.len());
    }

    fn renewed(&self, id: &str, expires_in_ms: u64) {
        if let Some(until) = self.live.lock().unwrap().get_mut(id) {
            *until = Instant::now() + Duration::from_millis(expires_in_ms);
        }
    }

    fn gone(&self, id: &str) {
        self.live.lock().unwrap().remove(id);
    }

    fn count(&self, region: &str, what: &str) {
        *self.counts.lock().unwrap().entry((region.to_string(), what.to_string())).or_default() += 1;
    }

    /// Resets the peak (a new phase measures its own).
    fn reset_peak(&self) -> usize {
        std::mem::take(&mut *self.peak.lock().unwrap())
    }

    fn counted(&self, region: &str, what: &str) -> u64 {
        self.counts.lock().unwrap().get(&(region.to_string(), what.to_string())).copied().unwrap_or(0)
    }
}

async fn take(http: &Http) -> Resp {
    http.post("/v1/acquire", &json!({"tenant": TENANT, "resource": EXPORT})).await
}

fn answer(r: &Resp) -> String {
    match r.status {
        200 => "run".into(),
        429 => format!("429/{}", r.body["limit"].as_str().unwrap_or("")),
        s => format!("{s}/{}", r.error()),
    }
}

/// One export: a permit, heartbeats while it runs, then a release; a
/// heartbeat that fails ends it (the job knows it lost its permit).
async fn export(held: Arc<Held>, region: String, http: Http) {
    let r = take(&http).await;
    held.count(&region, &answer(&r));
    if r.status != 200 {
        return;
    }
    let Some(id) = r.body["permit_id"].as_str().map(str::to_string) else { return };
    held.add(&id, r.body["permit_expires_in_ms"].as_u64().unwrap_or(0));
    let end = Instant::now() + RUN;
    while Instant::now() < end {
        // The job's own pace between heartbeats.
        tokio::time::sleep(BEAT.min(end.saturating_duration_since(Instant::now()))).await;
        let n = http.post(&format!("/v1/permits/{id}/renew"), &json!({})).await;
        if n.status != 200 {
            held.count(&region, "heartbeat_failed");
            held.gone(&id);
            return;
        }
        held.renewed(&id, n.body["expires_in_ms"].as_u64().unwrap_or(0));
    }
    held.gone(&id);
    let rel = http.post(&format!("/v1/permits/{id}/release"), &json!({})).await;
    held.count(&region, if rel.status == 200 { "released" } else { "release_failed" });
}

/// Export arrivals in every region until `stop`.
fn arrivals(run: &Run, held: &Arc<Held>, stop: &Arc<AtomicBool>) -> Vec<tokio::task::JoinHandle<()>> {
    run.stack
        .agent_urls()
        .into_iter()
        .map(|(region, agents)| {
            let (held, stop) = (held.clone(), stop.clone());
            tokio::spawn(async move {
                let clients: Vec<Http> = agents.iter().map(|a| Http::new(a)).collect();
                let mut jobs = Vec::new();
                let mut i = 0;
                while !stop.load(Ordering::Acquire) {
                    let http = clients[i % clients.len()].clone();
                    i += 1;
                    jobs.push(tokio::spawn(export(held.clone(), region.clone(), http)));
                    // The arrival rate, not a wait for the server.
                    tokio::time::sleep(EVERY).await;
                }
                for j in jobs {
                    let _ = j.await;
                }
            })
        })
        .collect()
}

async fn load_for(run: &Run, held: &Arc<Held>, d: Duration) {
    let stop = Arc::new(AtomicBool::new(false));
    let tasks = arrivals(run, held, &stop);
    tokio::time::sleep(d).await;
    stop.store(true, Ordering::Release);
    for t in tasks {
        let _ = t.await;
    }
}

/// A permit from `http`, polling while refused, at most `within`.
async fn permit_within(http: &Http, within: Duration) -> Option<(String, u64)> {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        let r = take(http).await;
        if r.status == 200 {
            let id = r.body["permit_id"].as_str()?.to_string();
            return Some((id, r.body["permit_expires_in_ms"].as_u64().unwrap_or(0)));
        }
        // A client's polite retry pace.
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    None
}

pub async fn export_concurrency(p: &Profile, bins: Bins) -> Result<ScenarioReport, String> {
    let mut run = Run::start("export-concurrency", p, bins, None, true).await?;
    crate::pools::put_policy(
        &run.stack.admin,
        TENANT,
        EXPORT,
        &json!({"kind": "concurrency", "max_in_flight": CAP, "permit_ttl_secs": TTL_SECS, "fail_mode": "strict"}),
    )
    .await?;
    run.traffic(&[("eu", 0.3), ("us", 0.3)]);
    let held = Arc::new(Held::default());
    run.note(format!(
        "exports: cap {CAP}, permit TTL {TTL_SECS} s, one arrival every {EVERY:?} per region running {RUN:?} \
         (F27's 0.1/s × 90 s shortened 50×), heartbeat every {BEAT:?}"
    ));

    // 1. Load from both regions.
    load_for(&run, &held, Duration::from_secs(8)).await;
    let peak = held.reset_peak();
    let (eu, us) = (held.counted("eu", "run"), held.counted("us", "run"));
    run.check(peak <= CAP, format!("under load: at most {peak} permits live at once (cap {CAP})"));
    run.check(peak == CAP, format!("under load the cap was reached: peak {peak}"));
    run.check(eu > 0 && us > 0, format!("exports run: eu {eu}, us {us}"));
    let refused = held.counted("eu", "429/concurrency") + held.counted("us", "429/concurrency");
    run.check(refused > 0, format!("{refused} exports refused with 429 limit concurrency"));
    let other: Vec<String> = held
        .counts
        .lock()
        .unwrap()
        .iter()
        .filter(|((_, w), _)| !["run", "429/concurrency", "released"].contains(&w.as_str()))
        .map(|((r, w), n)| format!("{r} {w} ×{n}"))
        .collect();
    run.check(other.is_empty(), format!("no other answer under load: {other:?}"));

    // 2. A holder dies: three permits held (two in eu, one in us) and the
    // holder of one of eu's is killed: no release, no heartbeat. The
    // living two keep heartbeating; us polls until it gets the dead one.
    let eu_http = Http::new(&run.stack.region("eu").agents[0].base);
    let us_http = Http::new(&run.stack.region("us").agents[0].base);
    // The job that will die takes its permit last, so its acquire is its
    // last sign of life: ids = [dying (eu), living (eu), living (us)].
    let mut got = Vec::new();
    for http in [&eu_http, &us_http, &eu_http] {
        let Some((id, ms)) = permit_within(http, Duration::from_secs(10)).await else {
            run.check(false, "three permits held before the holder's death");
            return run.finish().await;
        };
        held.add(&id, ms);
        got.push(id);
    }
    let died = Instant::now();
    let mut ids = vec![got[2].clone(), got[0].clone(), got[1].clone()];
    let mut back = None;
    while died.elapsed() < Duration::from_secs(TTL_SECS + 10) {
        for (region, http, id) in [("eu", &eu_http, &ids[1]), ("us", &us_http, &ids[2])] {
            let n = http.post(&format!("/v1/permits/{id}/renew"), &json!({})).await;
            if n.status == 200 {
                held.renewed(id, n.body["expires_in_ms"].as_u64().unwrap_or(0));
            } else {
                // Counted as a failed heartbeat (checked below); the job
                // keeps counting its permit live until its known expiry.
                held.count(region, "heartbeat_failed");
            }
        }
        let r = take(&us_http).await;
        if r.status == 200 {
            let id = r.body["permit_id"].as_str().unwrap_or_default().to_string();
            held.add(&id, r.body["permit_expires_in_ms"].as_u64().unwrap_or(0));
            back = Some(died.elapsed());
            ids.push(id);
            break;
        }
        // A client's polite retry pace.
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    match back {
        Some(t) => run.check(
            t >= Duration::from_millis(TTL_SECS * 1000 - 100) && t <= Duration::from_secs(TTL_SECS + 5),
            format!(
                "a dead holder's permit reached the other region {:.2} s after its last sign of life (TTL {TTL_SECS} s: not before, at most a 2 s tidy + 3 s margin after)",
                t.as_secs_f64()
            ),
        ),
        None => run.check(false, "a dead holder's permit never came back"),
    }

    // 3. Double release: the second changes nothing; exactly one permit
    // comes back.
    held.gone(&ids[1]);
    let first = eu_http.post(&format!("/v1/permits/{}/release", ids[1]), &json!({})).await;
    let second = eu_http.post(&format!("/v1/permits/{}/release", ids[1]), &json!({})).await;
    run.check(
        first.body["released"] == json!(true) && second.body["released"] == json!(false),
        format!("double release: first {}, second {}", first.body, second.body),
    );
    let again = permit_within(&eu_http, Duration::from_secs(5)).await;
    let extra = take(&eu_http).await;
    run.check(
        again.is_some() && extra.status == 429,
        format!(
            "after the double release one permit came back ({}) and the next acquire was {}",
            again.is_some(),
            extra.status
        ),
    );
    if let Some((id, ms)) = &again {
        held.add(id, *ms);
        ids.push(id.clone());
    }
    for id in &ids[2..] {
        held.gone(id);
        for http in [&eu_http, &us_http] {
            http.post(&format!("/v1/permits/{id}/release"), &json!({})).await;
        }
    }
    let peak = held.reset_peak();
    run.check(peak <= CAP, format!("holder death and double release: at most {peak} live"));

    // 4. us cut off from the allocator while exports go on.
    run.stack.region("us").alloc_link.set(Fault::Blackhole);
    run.note("us cut off from the allocator (blackhole) for 8 s while exports go on");
    let before = held.counted("us", "run");
    load_for(&run, &held, Duration::from_secs(8)).await;
    run.stack.region("us").alloc_link.set(Fault::Pass);
    let peak = held.reset_peak();
    run.check(peak <= CAP, format!("during the partition: at most {peak} permits live at once"));
    let during = held.counted("us", "run") - before;
    let unavailable = held.counted("us", "503/allocator_unreachable");
    run.note(format!(
        "us while cut off: {during} exports run on the permits its lease held, {unavailable} answered 503"
    ));
    let lost: u64 = ["eu", "us"].iter().map(|r| held.counted(r, "heartbeat_failed")).sum();
    run.check(
        lost == 0,
        format!(
            "{lost} heartbeats of running exports failed in the whole run (the lease outlives an 8 s cut)"
        ),
    );
    // No region's Redis lost anything here: no permit state was lost.
    let mut lost_states = 0.0;
    for (_, agents) in run.stack.agent_urls() {
        for a in agents {
            let m = Http::new(&a).get("/metrics").await;
            lost_states += quota_tests::http::metric(
                m.body.as_str().unwrap_or_default(),
                "agent_permit_state_lost_total",
            )
            .unwrap_or(f64::NAN);
        }
    }
    run.check(
        lost_states == 0.0,
        format!("agent_permit_state_lost_total summed over the agents: {lost_states}"),
    );
    run.finish().await
}
