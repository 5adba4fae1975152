//! Client retries (seed 002, game days 3 and 10).
//!
//! `retry-wave` (F26): a synchronized wave of clients refused by a spent
//! quota, each retrying once after the `Retry-After` it got, against an
//! agent that answers the bare whole-second wait (`--retry-after-jitter
//! false`) and one that adds 0 or 1 s at random (the default): the retries'
//! peak per 100 ms with jitter must be at most 0.6 of the one without.
//!
//! `retried-debit` (F11): requests whose answers are lost after the agent
//! debited them (a fault proxy in front of the agent swallows every answer,
//! the client times out), then retried until answered. Without a
//! `request_id` the retry debits again; with one it is answered with the
//! first decision and charges nothing. The allocator's count of admits is
//! compared with the admits the clients saw.

use super::harness::{Profile, Run, TENANT};
use crate::bins::Bins;
use crate::report::ScenarioReport;
use crate::stack::StackSpec;
use quota_tests::proxy::{Fault, FaultProxy};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{watch, Semaphore};
use tokio::time::Instant;

/// Offered load on the main quota: light, so the standard window checks run
/// without competing with the drills for the two cores.
const TRAFFIC_SHARE: f64 = 0.2;

/// The agent's switch of server-side jitter on `Retry-After`.
const JITTER_ENV: &str = "AGENT_RETRY_AFTER_JITTER";
/// The quota the wave is refused by (limit 1 per window, spent before).
const WAVE_RESOURCE: &str = "wave";
/// Connections the wave's clients share: a bounded pool keeps the lab's
/// file descriptors (and the agent's `AGENT_MAX_CONNECTIONS`, 1024) far
/// from their limits, as a gateway's pool would.
const WAVE_CONNECTIONS: usize = 64;
/// Width of the buckets the retries are counted in (seed 002 F26: "spiky
/// arrival histogram at 100 ms resolution").
const BUCKET_MS: f64 = 100.0;
/// Highest `Retry-After` a wave client obeys beyond the window length; a
/// longer one is not waited for (the client counts as not retried) so a
/// wrong hint cannot stall the run.
const RETRY_AFTER_SLACK_S: u64 = 3;
/// Polls of the ledger (300 ms apart) that must agree before the
/// retried-debit counts are read: several outbox rounds.
const STABLE_POLLS: usize = 3;
/// The jittered peak may be at most this share of the bare one.
const PEAK_RATIO_MAX: f64 = 0.6;
/// Waves measured; the peaks compared are their means. Half of each
/// wave's clients meet each agent, so a peak counts a few hundred retries,
/// and a split of them at random into two seconds varies by several
/// percent from wave to wave (one wave's ratio ranged 0.44 to 0.59 over
/// 20 runs); the mean of two narrows that spread by about √2.
const WAVES: usize = 2;

/// One wave client: its refusal and its one retry, in ms after the wave
/// was released.
#[derive(Debug, Clone, Default)]
struct Trip {
    status: u16,
    retry_after_s: Option<u64>,
    answered_ms: f64,
    /// When the client sent its retry: its `Retry-After` had passed since
    /// the refusal came.
    retry_sent_ms: Option<f64>,
    /// When one of the lab's shared connections carried it (later than
    /// `retry_sent_ms` while all were busy: a limit of the lab's pool, not
    /// of the clients, so not what the peak counts).
    retry_wire_ms: Option<f64>,
}

/// The clients of one agent in a wave.
struct Wave {
    trips: Vec<Trip>,
}

impl Wave {
    fn refused_with_hint(&self) -> usize {
        self.trips.iter().filter(|t| t.status == 429 && t.retry_after_s.is_some()).count()
    }

    fn retried(&self) -> usize {
        self.trips.iter().filter(|t| t.retry_sent_ms.is_some()).count()
    }

    /// From the release to the last refusal answered, ms.
    fn spread_ms(&self) -> f64 {
        self.trips.iter().map(|t| t.answered_ms).fold(0.0, f64::max)
    }

    /// Most retries sent within any 100 ms (a sliding bucket: fixed bucket
    /// edges would make the peak depend on where they fall in a burst of a
    /// few hundred ms).
    fn peak(&self) -> usize {
        let mut sent: Vec<f64> = self.trips.iter().filter_map(|t| t.retry_sent_ms).collect();
        sent.sort_by(f64::total_cmp);
        let mut first = 0;
        let mut most = 0;
        for (i, s) in sent.iter().enumerate() {
            while sent[first] <= s - BUCKET_MS {
                first += 1;
            }
            most = most.max(i + 1 - first);
        }
        most
    }

    /// Mean and longest wait of a sent retry for a free connection, ms.
    fn wire_lag_ms(&self) -> (f64, f64) {
        let lags: Vec<f64> =
            self.trips.iter().filter_map(|t| Some(t.retry_wire_ms? - t.retry_sent_ms?)).collect();
        let mean = lags.iter().sum::<f64>() / lags.len().max(1) as f64;
        (mean, lags.iter().copied().fold(0.0, f64::max))
    }

    /// `Retry-After` values with their counts, in words.
    fn hints(&self) -> String {
        let mut by: BTreeMap<u64, usize> = BTreeMap::new();
        for ra in self.trips.iter().filter_map(|t| t.retry_after_s) {
            *by.entry(ra).or_default() += 1;
        }
        by.iter().map(|(s, n)| format!("{n}×{s} s")).collect::<Vec<_>>().join(", ")
    }
}

/// One wave client: waits for the release, is refused, sleeps the
/// `Retry-After` it got from the instant the answer came, retries once.
async fn wave_client(
    http: reqwest::Client,
    url: String,
    conns: Arc<Semaphore>,
    mut go: watch::Receiver<Option<Instant>>,
    max_wait_s: u64,
) -> Trip {
    // Copied out at once: the watch's guard must not live across an await.
    let t0 = match go.wait_for(Option::is_some).await {
        Ok(t) => (*t).unwrap_or_else(Instant::now),
        Err(_) => return Trip::default(),
    };
    let ms = |t: Instant| t.duration_since(t0).as_secs_f64() * 1000.0;
    let body = json!({"tenant": TENANT, "resource": WAVE_RESOURCE});
    let mut trip = Trip::default();
    let first = {
        let Ok(_conn) = conns.acquire().await else { return trip };
        let r = http.post(&url).json(&body).send().await;
        let answered = Instant::now();
        match r {
            Ok(r) => {
                let ra = r.headers().get("retry-after").and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
                let status = r.status().as_u16();
                // Read to the end, so the connection goes back to the pool.
                let _ = r.bytes().await;
                Some((status, ra, answered))
            }
            Err(_) => None,
        }
    };
    let Some((status, ra, answered)) = first else { return trip };
    trip.status = status;
    trip.retry_after_s = ra;
    trip.answered_ms = ms(answered);
    let Some(ra) = ra.filter(|ra| status == 429 && *ra <= max_wait_s) else { return trip };
    tokio::time::sleep_until(answered + Duration::from_secs(ra)).await;
    trip.retry_sent_ms = Some(ms(Instant::now()));
    let Ok(_conn) = conns.acquire().await else { return trip };
    trip.retry_wire_ms = Some(ms(Instant::now()));
    if let Ok(r) = http.post(&url).json(&body).send().await {
        let _ = r.bytes().await;
    }
    trip
}

/// Sends acquires of the wave quota to `agent` until one is refused (the
/// pool of the current window is spent, and the agent knows it); answers
/// whether it was.
async fn spend_wave_pool(http: &reqwest::Client, agent: &str) -> bool {
    let body = json!({"tenant": TENANT, "resource": WAVE_RESOURCE});
    // The limit is 1: at most one admit, then a refusal; a few more tries
    // cover a slow first grant.
    for _ in 0..20 {
        match http.post(format!("{agent}/v1/acquire")).json(&body).send().await {
            Ok(r) if r.status().as_u16() == 429 => return true,
            Ok(r) => {
                let _ = r.bytes().await;
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
    false
}

/// Spends the wave quota's pool, then releases `n` clients at `at_ms` into
/// a window, every other one to each of `agents`, all through one pool of
/// connections; waits for every retry to be answered. One [`Wave`] per
/// agent: interleaved in one queue for the connections, the agents' clients
/// are answered over the same few hundred ms, so the two peaks differ by
/// what the agents told them, not by how fast each wave was served.
async fn wave(run: &Run, agents: &[String], n: usize, at_ms: i64) -> Result<Vec<Wave>, String> {
    let w = run.p.window_secs * 1000;
    let http = quota_tests::http::client_builder()
        .timeout(Duration::from_secs(10))
        .pool_max_idle_per_host(WAVE_CONNECTIONS)
        .build()
        .map_err(|e| format!("http client: {e}"))?;
    // Spent early in the window the wave is released in (the pool is
    // the window's).
    run.at_phase(0.05).await;
    for a in agents {
        if !spend_wave_pool(&http, a).await {
            return Err(format!("{a}: the wave quota was never refused after 20 acquires"));
        }
    }
    let conns = Arc::new(Semaphore::new(WAVE_CONNECTIONS));
    let (go, rx) = watch::channel(None);
    let max_wait_s = run.p.window_secs as u64 + RETRY_AFTER_SLACK_S;
    let tasks: Vec<_> = (0..n)
        .map(|i| {
            let url = format!("{}/v1/acquire", agents[i % agents.len()]);
            tokio::spawn(wave_client(http.clone(), url, conns.clone(), rx.clone(), max_wait_s))
        })
        .collect();
    run.at_phase(at_ms as f64 / w as f64).await;
    go.send_replace(Some(Instant::now()));
    // Every client is done within its wait plus two answers (10 s each at most).
    let deadline = Duration::from_secs(max_wait_s + 25);
    let mut waves: Vec<Wave> = agents.iter().map(|_| Wave { trips: Vec::new() }).collect();
    for (i, t) in tasks.into_iter().enumerate() {
        match tokio::time::timeout(deadline, t).await {
            Ok(Ok(trip)) => waves[i % agents.len()].trips.push(trip),
            Ok(Err(e)) => return Err(format!("a wave client failed: {e}")),
            Err(_) => return Err(format!("a wave client was not done after {deadline:?}")),
        }
    }
    Ok(waves)
}

/// Restarts `region`'s agents with `env` added.
async fn restart_with(run: &mut Run, region: &str, env: (&str, &str)) {
    for a in &mut run.stack.region_mut(region).agents {
        a.opts.env.push((env.0.to_string(), env.1.to_string()));
        a.stop(libc::SIGTERM);
        a.start().await;
    }
}

pub async fn retry_wave(p: &Profile, bins: Bins) -> Result<ScenarioReport, String> {
    let n: usize = if p.name == "long" { 2000 } else { 1000 };
    let spec = StackSpec::two_regions();
    let mut run = Run::start("retry-wave", p, bins, Some(spec), false).await?;
    // eu keeps the default (jitter on); us answers the bare wait.
    restart_with(&mut run, "us", (JITTER_ENV, "false")).await;
    crate::pools::put_limit(&run.stack.admin, TENANT, WAVE_RESOURCE, 1, p.window_secs).await?;
    run.traffic(&[("eu", TRAFFIC_SHARE), ("us", TRAFFIC_SHARE)]);
    let eu = run.stack.region("eu").agents[0].base.clone();
    let us = run.stack.region("us").agents[0].base.clone();
    // Released when the window's end is a whole number of seconds and
    // 900 ms away: the bare hint (the wait rounded up) is then the same for
    // every client answered within the next 900 ms, as in F26's wave where
    // all were told the same.
    let at_ms = (p.window_secs * 1000 / 2 / 1000) * 1000 - 900;
    let half = n / 2;
    run.note(format!(
        "{WAVES} waves, each of {n} clients released together {at_ms} ms into a window against a spent \
         quota ({WAVE_RESOURCE}, limit 1), every other one to us (no jitter) and to eu (jitter), over \
         {WAVE_CONNECTIONS} shared connections; each client retries once after its Retry-After"
    ));
    // Σ over the waves of each agent's peak.
    let (mut sum_bare, mut sum_jitter) = (0usize, 0usize);
    for k in 1..=WAVES {
        let waves = wave(&run, &[us.clone(), eu.clone()], half * 2, at_ms).await?;
        let (bare, jittered) = (&waves[0], &waves[1]);
        for (label, w) in [("without jitter (us)", bare), ("with jitter (eu)", jittered)] {
            let (lag_mean, lag_max) = w.wire_lag_ms();
            run.note(format!(
                "wave {k} {label}: {half} clients, refusals answered within {:.0} ms; Retry-After {}; \
                 {} retried, peak {} retries per 100 ms; a retry waited {lag_mean:.0} ms on average \
                 (at most {lag_max:.0} ms) for one of the lab's connections",
                w.spread_ms(),
                w.hints(),
                w.retried(),
                w.peak()
            ));
            run.check(
                w.refused_with_hint() == half && w.retried() == half,
                format!(
                    "wave {k} {label}: {} of {half} clients refused with a Retry-After, {} retried once \
                     after it",
                    w.refused_with_hint(),
                    w.retried()
                ),
            );
        }
        sum_bare += bare.peak();
        sum_jitter += jittered.peak();
    }
    let peak_bare = sum_bare as f64 / WAVES as f64;
    let peak_jitter = sum_jitter as f64 / WAVES as f64;
    let ratio = if sum_bare > 0 { peak_jitter / peak_bare } else { f64::INFINITY };
    run.figure("clients", (half * 2) as f64);
    run.figure("waves", WAVES as f64);
    run.figure("retries_peak_per_100ms_no_jitter", peak_bare);
    run.figure("retries_peak_per_100ms_jitter", peak_jitter);
    run.figure("peak_ratio", ratio);
    run.check(
        ratio <= PEAK_RATIO_MAX,
        format!(
            "retries' peak per 100 ms (mean of {WAVES} waves) with jitter {peak_jitter:.1} / without \
             {peak_bare:.1} = {ratio:.2} (at most {PEAK_RATIO_MAX})"
        ),
    );
    run.finish().await
}

/// Requests of each case of `retried-debit`.
const DEBITS: usize = 200;
/// The client's deadline on a first attempt: well above the agent's
/// answer time, so the debit has happened when the client gives up.
const FIRST_TIMEOUT: Duration = Duration::from_millis(600);
/// The client's deadline on a retry, and how many it makes at most.
const RETRY_TIMEOUT: Duration = Duration::from_secs(3);
const MAX_RETRIES: usize = 5;
/// Limit of the debit quotas: far above what the drill spends, so every
/// request is admitted and each debit shows in the allocator's count.
const DEBIT_LIMIT: i64 = 100_000;

/// What the clients of one case saw.
#[derive(Debug, Default)]
struct Debits {
    /// First attempts whose answer never came (the debit is unknown).
    timeouts: usize,
    /// Admits the clients saw (warm-up included).
    seen_admits: usize,
    /// Requests never answered 200 in the end.
    unresolved: usize,
    /// Windows (Unix s) of the admits the clients saw.
    windows: Vec<i64>,
}

/// One acquire; `None` when no answer came in time.
async fn acquire(http: &reqwest::Client, url: &str, body: &Value, timeout: Duration) -> Option<(u16, Value)> {
    let r = http.post(url).json(body).timeout(timeout).send().await.ok()?;
    let status = r.status().as_u16();
    let body = r.json::<Value>().await.unwrap_or(Value::Null);
    Some((status, body))
}

/// The window (Unix s) an admit was charged to.
fn admit_window(body: &Value) -> Option<i64> {
    let ws = body["window_start"].as_str()?;
    chrono::DateTime::parse_from_rfc3339(ws).ok().map(|t| t.timestamp())
}

/// One case: `DEBITS` requests of `resource` through `proxy` while it
/// swallows every answer, then each retried (same body, same `request_id`
/// when `with_id`) once answers flow again, until answered.
async fn debit_case(proxy: &FaultProxy, resource: &str, with_id: bool, tag: &str) -> Result<Debits, String> {
    let http = quota_tests::http::client_builder()
        .pool_max_idle_per_host(DEBITS)
        .build()
        .map_err(|e| format!("http client: {e}"))?;
    let url = format!("{}/v1/acquire", proxy.http_url());
    let bodies: Vec<Value> = (0..DEBITS)
        .map(|i| {
            if with_id {
                json!({"tenant": TENANT, "resource": resource, "request_id": format!("{tag}-{i}")})
            } else {
                json!({"tenant": TENANT, "resource": resource})
            }
        })
        .collect();
    let mut d = Debits::default();
    proxy.set(Fault::DropReplies);
    let firsts =
        futures::future::join_all(bodies.iter().map(|b| acquire(&http, &url, b, FIRST_TIMEOUT))).await;
    proxy.set(Fault::Pass);
    let mut pending = Vec::new();
    for (b, r) in bodies.iter().zip(firsts) {
        match r {
            Some((200, body)) => {
                d.seen_admits += 1;
                d.windows.extend(admit_window(&body));
            }
            Some(_) => pending.push(b),
            None => {
                d.timeouts += 1;
                pending.push(b);
            }
        }
    }
    // Each retried until answered, as a client library with retries would.
    let retries = futures::future::join_all(pending.into_iter().map(|b| {
        let (http, url) = (&http, &url);
        async move {
            for _ in 0..MAX_RETRIES {
                if let Some(r) = acquire(http, url, b, RETRY_TIMEOUT).await {
                    return Some(r);
                }
            }
            None
        }
    }))
    .await;
    for r in retries {
        match r {
            Some((200, body)) => {
                d.seen_admits += 1;
                d.windows.extend(admit_window(&body));
            }
            _ => d.unresolved += 1,
        }
    }
    Ok(d)
}

/// Σ admitted of `resource` over the windows starting in `[from, to)` (Unix
/// s), and whether all of them have closed.
async fn ledger_admitted(run: &Run, resource: &str, from: i64, to: i64) -> Result<(i64, bool), String> {
    let acc = crate::accounts::windows(&run.stack.admin, TENANT, resource, from, to).await?;
    Ok((acc.values().map(|w| w.admitted).sum(), acc.values().all(|w| w.closed)))
}

pub async fn retried_debit(p: &Profile, bins: Bins) -> Result<ScenarioReport, String> {
    let spec = StackSpec::two_regions();
    let mut run = Run::start("retried-debit", p, bins, Some(spec), false).await?;
    let (noid, withid) = ("debit-noid", "debit-id");
    for r in [noid, withid] {
        crate::pools::put_limit(&run.stack.admin, TENANT, r, DEBIT_LIMIT, p.window_secs).await?;
    }
    run.traffic(&[("eu", TRAFFIC_SHARE), ("us", TRAFFIC_SHARE)]);
    // Only the drill's clients go through this proxy; the main traffic
    // reaches the agent directly.
    let agent = run.stack.region("us").agents[0].base.clone();
    let proxy = FaultProxy::in_front_of(&agent).await.map_err(|e| format!("fault proxy: {e}"))?;
    let http = quota_tests::http::client_builder().build().map_err(|e| format!("http client: {e}"))?;
    // The start of the window the drill begins in.
    let from = chrono::Utc::now().timestamp().div_euclid(p.window_secs) * p.window_secs;
    let tag = format!("debit-{}", chrono::Utc::now().timestamp_millis());
    // Warm-up: the agent learns both policies and holds a lease, so the
    // first attempts are decided at once (and not while the client waits).
    // With a request id of its own, so that a warm-up retried after a
    // timeout cannot debit twice either.
    let mut warm: BTreeMap<&str, usize> = BTreeMap::new();
    for r in [noid, withid] {
        let body = json!({"tenant": TENANT, "resource": r, "request_id": format!("{tag}-warm-{r}")});
        for _ in 0..MAX_RETRIES {
            if let Some((200, _)) = acquire(&http, &format!("{agent}/v1/acquire"), &body, RETRY_TIMEOUT).await
            {
                *warm.entry(r).or_default() += 1;
                break;
            }
        }
    }
    // Each case early in a window of its own, so its retries are decided
    // in the window of its first attempts (a request id is remembered
    // within its window). The case with ids first: the later one's admits
    // reaching the allocator show that the agent's reports of the earlier
    // ones were sent too (one outbox round cuts every quota).
    run.at_phase(0.05).await;
    let with = debit_case(&proxy, withid, true, &tag).await?;
    run.at_phase(0.05).await;
    let without = debit_case(&proxy, noid, false, &tag).await?;
    let to = chrono::Utc::now().timestamp() + p.window_secs;
    let seen_noid = (without.seen_admits + warm.get(noid).copied().unwrap_or(0)) as i64;
    let seen_id = (with.seen_admits + warm.get(withid).copied().unwrap_or(0)) as i64;
    // Settled when both windows have closed, each case shows at least what
    // its clients saw, and the counts held still over STABLE_POLLS polls
    // (the agents cut and send every outbox round, 200 ms): how many of
    // the unanswered attempts were decided, and so debited, is what the
    // drill measures, not something to wait for.
    let deadline = Instant::now() + Duration::from_secs(p.window_secs as u64 + 20);
    let (mut last, mut same) = ((-1, -1), 0);
    let (ledger_noid, ledger_id) = loop {
        let (n, c1) = ledger_admitted(&run, noid, from, to).await?;
        let (i, c2) = ledger_admitted(&run, withid, from, to).await?;
        same = if (n, i) == last { same + 1 } else { 0 };
        last = (n, i);
        let settled = c1 && c2 && n >= seen_noid && i >= seen_id && same >= STABLE_POLLS;
        if settled || Instant::now() >= deadline {
            if !settled {
                run.note(format!("the ledger's counts had not settled by the deadline: {n} and {i}"));
            }
            break (n, i);
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    let extra_noid = ledger_noid - seen_noid;
    let extra_id = ledger_id - seen_id;
    run.figure("requests_without_id", DEBITS as f64);
    run.figure("timeouts_without_id", without.timeouts as f64);
    run.figure("extra_debits_without_id", extra_noid as f64);
    run.figure("requests_with_id", DEBITS as f64);
    run.figure("timeouts_with_id", with.timeouts as f64);
    run.figure("extra_debits_with_id", extra_id as f64);
    for (label, d, seen, ledger, res) in [
        ("without request_id", &without, seen_noid, ledger_noid, noid),
        ("with request_id", &with, seen_id, ledger_id, withid),
    ] {
        let windows: std::collections::BTreeSet<_> = d.windows.iter().collect();
        let warmed = warm.get(res).copied().unwrap_or(0);
        run.note(format!(
            "{label} ({res}): {DEBITS} requests, {} first attempts timed out, clients saw {seen} admits \
             ({warmed} of a warm-up), the allocator counts {ledger}; the clients' admits in {} window(s)",
            d.timeouts,
            windows.len()
        ));
        run.check(
            d.unresolved == 0,
            format!("{label}: {} requests never admitted after retries", d.unresolved),
        );
    }
    run.check(
        without.timeouts > 0 && with.timeouts > 0,
        format!(
            "the first attempts were ambiguous: {} and {} of {DEBITS} timed out with their answers \
             swallowed (without and with request_id)",
            without.timeouts, with.timeouts
        ),
    );
    run.check(
        extra_noid > 0 && extra_noid <= without.timeouts as i64,
        format!(
            "without request_id the retries debited again: {extra_noid} extra debits for {} ambiguous attempts \
             (at most one each)",
            without.timeouts
        ),
    );
    run.check(
        extra_id == 0,
        format!("with request_id the retries charged nothing: {extra_id} extra debits (must be 0)"),
    );
    drop(proxy);
    run.finish().await
}
