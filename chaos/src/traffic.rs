//! Client traffic and its ground truth: every answer a client saw, counted
//! per region and per the window the agent charged (`window_start` of a 200)
//! or, for refusals, the window the client was in.
//!
//! A request whose answer never arrived (connection reset, timeout) is
//! counted as `ambiguous`: the agent may or may not have admitted it.
//!
//! The clients either call the agents' `POST /v1/acquire` ([`Traffic::start`])
//! or send plain HTTP requests to Envoys in front of the agents
//! ([`Traffic::start_envoy`], what they send and how an Envoy answer is
//! read: [`crate::envoy_traffic`]).

use crate::seen::Seen;
use serde::Serialize;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;
use tokio::task::JoinSet;

/// What clients saw in one window of one region.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq, Eq)]
pub struct Counts {
    /// 200 with `source: "lease"`.
    pub lease: u64,
    /// 200 with `source: "fallback"`.
    pub fallback: u64,
    /// 429 `quota_exhausted`.
    pub denied: u64,
    /// 503 (`allocator_unreachable` or `store_unavailable`).
    pub unavailable: u64,
    /// No answer, or an answer that was neither of the above: the agent
    /// may or may not have admitted these.
    pub ambiguous: u64,
    /// The connection was refused (agent down): certainly not admitted.
    pub refused: u64,
    /// Latest instant (Unix ms, this host's clock) a request was sent that
    /// was then admitted into this window; after the window's end it would
    /// be an admit on an expired lease (I2).
    pub last_admit_sent_ms: i64,
}

impl Counts {
    /// Every 200.
    pub fn admitted(&self) -> u64 {
        self.lease + self.fallback
    }

    /// Adds `o` into `self`.
    pub fn add(&mut self, o: &Counts) {
        self.lease += o.lease;
        self.fallback += o.fallback;
        self.denied += o.denied;
        self.unavailable += o.unavailable;
        self.ambiguous += o.ambiguous;
        self.refused += o.refused;
        self.last_admit_sent_ms = self.last_admit_sent_ms.max(o.last_admit_sent_ms);
    }
}

/// Counts by window start (Unix seconds), then by region.
pub type Tally = BTreeMap<i64, BTreeMap<String, Counts>>;

/// One answer as a client saw it, for scenarios that measure when service
/// came back (the tally keeps counts only).
#[derive(Debug, Clone)]
pub struct Answer {
    pub region: String,
    /// When the request was sent and when its answer (or failure) came,
    /// Unix ms of this host's clock.
    pub sent_ms: i64,
    pub done_ms: i64,
    /// HTTP status; 0 when no answer came.
    pub status: u16,
    /// The `error` code of a refusal (`store_unavailable`, ...), empty otherwise.
    pub error: String,
    /// Whether an admit came from a lease (not the fallback allowance).
    pub lease: bool,
}

/// Offered load of one region: requests per second spread over its agents.
#[derive(Debug, Clone)]
pub struct RegionLoad {
    pub region: String,
    /// The agents' base URLs (for Envoy traffic, the Envoys' in front of them).
    pub agents: Vec<String>,
    pub rate_per_sec: f64,
}

/// Running traffic; stops when dropped or by [`Traffic::stop`].
pub struct Traffic {
    tally: Arc<Mutex<Tallies>>,
    answers: Arc<Mutex<Vec<Answer>>>,
    rates: BTreeMap<String, Arc<AtomicU64>>,
    stop: watch::Sender<bool>,
    tasks: JoinSet<()>,
}

/// Clients per region; each sends at `rate / CLIENTS` so a slow answer does
/// not stop the others.
const CLIENTS: usize = 8;
/// A client gives up on an answer after this long.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(3);

/// What the clients saw: per request, and per quota a request spends
/// (only Envoy traffic, whose routes spend several quotas, fills `quotas`).
#[derive(Default)]
struct Tallies {
    requests: Tally,
    quotas: BTreeMap<String, Tally>,
}

/// What a client request is.
#[derive(Clone)]
enum Call {
    /// `POST /v1/acquire` with this body.
    Acquire(serde_json::Value),
    /// A request to an Envoy (a route and a user drawn per request); the
    /// window length places its admits ([`crate::envoy_traffic::admit_window`]).
    Envoy { window_secs: i64 },
}

impl Traffic {
    /// Starts clients for every region in `loads` on quota `tenant/resource`.
    pub fn start(tenant: &str, resource: &str, loads: &[RegionLoad]) -> Traffic {
        let body = serde_json::json!({"tenant": tenant, "resource": resource});
        Self::start_calls(Call::Acquire(body), loads, |a| format!("{a}/v1/acquire"))
    }

    /// Starts clients for every region in `loads` whose `agents` are Envoy
    /// URLs: each request a route of the Envoy example with a user, drawn
    /// by [`crate::envoy_traffic::pick`]. [`Traffic::tally`] counts
    /// requests, [`Traffic::tally_of`] each quota the routes spend.
    pub fn start_envoy(loads: &[RegionLoad], window_secs: i64) -> Traffic {
        Self::start_calls(Call::Envoy { window_secs }, loads, |e| e.to_string())
    }

    fn start_calls(call: Call, loads: &[RegionLoad], url: impl Fn(&str) -> String) -> Traffic {
        let tally = Arc::new(Mutex::new(Tallies::default()));
        let answers = Arc::new(Mutex::new(Vec::new()));
        let (stop, _) = watch::channel(false);
        let mut tasks = JoinSet::new();
        let mut rates = BTreeMap::new();
        let client = quota_tests::http::client_builder()
            .timeout(CLIENT_TIMEOUT)
            .pool_max_idle_per_host(CLIENTS)
            .build()
            .expect("http client");
        for load in loads {
            let rate = Arc::new(AtomicU64::new(load.rate_per_sec.to_bits()));
            rates.insert(load.region.clone(), rate.clone());
            for c in 0..CLIENTS {
                let ctx = ClientCtx {
                    client: client.clone(),
                    region: load.region.clone(),
                    urls: load.agents.iter().map(|a| url(a)).collect(),
                    call: call.clone(),
                    rate: rate.clone(),
                    tally: tally.clone(),
                    answers: answers.clone(),
                    offset: c,
                };
                tasks.spawn(ctx.run(stop.subscribe()));
            }
        }
        Traffic { tally, answers, rates, stop, tasks }
    }

    /// Every answer of `region`'s clients sent at or after `since_ms`
    /// (Unix ms), in the order they came.
    pub fn answers(&self, region: &str, since_ms: i64) -> Vec<Answer> {
        let Ok(a) = self.answers.lock() else { return Vec::new() };
        a.iter().filter(|x| x.region == region && x.sent_ms >= since_ms).cloned().collect()
    }

    /// Changes a region's offered rate.
    pub fn set_rate(&self, region: &str, per_sec: f64) {
        if let Some(r) = self.rates.get(region) {
            r.store(per_sec.to_bits(), Ordering::Relaxed);
        }
    }

    /// A copy of the counts so far, per request.
    pub fn tally(&self) -> Tally {
        self.tally.lock().map(|t| t.requests.clone()).unwrap_or_default()
    }

    /// A copy of the counts so far of quota `resource` (of the requests
    /// that spend it); for acquire traffic, of its one quota.
    pub fn tally_of(&self, resource: &str) -> Tally {
        let Ok(t) = self.tally.lock() else { return Tally::new() };
        t.quotas.get(resource).unwrap_or(&t.requests).clone()
    }

    /// Stops every client and waits for in-flight requests to end.
    pub async fn stop(mut self) -> Tally {
        self.halt().await;
        self.tally()
    }

    /// [`Traffic::stop`], keeping the counts readable ([`Traffic::tally_of`]).
    pub async fn halt(&mut self) {
        self.stop.send_replace(true);
        while self.tasks.join_next().await.is_some() {}
    }
}

struct ClientCtx {
    client: reqwest::Client,
    region: String,
    urls: Vec<String>,
    call: Call,
    rate: Arc<AtomicU64>,
    tally: Arc<Mutex<Tallies>>,
    answers: Arc<Mutex<Vec<Answer>>>,
    offset: usize,
}

impl ClientCtx {
    async fn run(self, mut stop: watch::Receiver<bool>) {
        let mut n = self.offset;
        let mut next = tokio::time::Instant::now();
        let mut first = true;
        loop {
            let rate = f64::from_bits(self.rate.load(Ordering::Relaxed));
            let period = if rate > 0.0 {
                Duration::from_secs_f64(CLIENTS as f64 / rate)
            } else {
                Duration::from_millis(100)
            };
            // The region's clients take turns, each a slot of the period
            // apart: in lockstep they would offer a steady rate as bursts
            // of CLIENTS requests (a slow region's 2/s as 8 every 4 s).
            next += if first {
                period.mul_f64((self.offset % CLIENTS) as f64 / CLIENTS as f64 + 1.0 / CLIENTS as f64)
            } else {
                period
            };
            first = false;
            let now = tokio::time::Instant::now();
            // A client that fell behind (slow answers) does not burst to catch up.
            if next + Duration::from_secs(1) < now {
                next = now;
            }
            tokio::select! {
                _ = tokio::time::sleep_until(next) => {},
                _ = stop.changed() => return,
            }
            if *stop.borrow() {
                return;
            }
            if rate <= 0.0 {
                continue;
            }
            n += 1;
            let url = &self.urls[n % self.urls.len()];
            let sent_ms = chrono::Utc::now().timestamp_millis();
            let (seen, quotas, status, error) = match &self.call {
                Call::Acquire(body) => {
                    let (seen, status, error) = self.acquire(url, body).await;
                    (seen, Vec::new(), status, error)
                }
                Call::Envoy { window_secs } => {
                    let seed = ((self.offset as u64) << 32) | n as u64;
                    let a = crate::envoy_traffic::call(&self.client, url, seed, *window_secs).await;
                    (a.request, a.quotas, a.status, a.error)
                }
            };
            if let Ok(mut a) = self.answers.lock() {
                let done_ms = chrono::Utc::now().timestamp_millis();
                let lease = matches!(seen, Seen::Lease(_));
                a.push(Answer { region: self.region.clone(), sent_ms, done_ms, status, error, lease });
            }
            let Ok(mut t) = self.tally.lock() else { continue };
            record(&mut t.requests, &self.region, seen, sent_ms);
            for (resource, seen) in quotas {
                record(t.quotas.entry(resource.to_string()).or_default(), &self.region, seen, sent_ms);
            }
        }
    }

    /// What the answer means for the tally, its status and error code.
    async fn acquire(&self, url: &str, body: &serde_json::Value) -> (Seen, u16, String) {
        let resp = match self.client.post(url).json(body).send().await {
            Ok(r) => r,
            Err(e) if e.is_connect() => return (Seen::Refused, 0, String::new()),
            Err(_) => return (Seen::Ambiguous, 0, String::new()),
        };
        let status = resp.status().as_u16();
        let Ok(body) = resp.json::<serde_json::Value>().await else {
            return (Seen::Ambiguous, status, String::new());
        };
        let error = body["error"].as_str().unwrap_or_default().to_string();
        let seen = match status {
            200 => {
                let Some(ws) = body["window_start"]
                    .as_str()
                    .and_then(|s| chrono::DateTime::parse_from_rfc3339(s).ok())
                    .map(|t| t.timestamp())
                else {
                    return (Seen::Ambiguous, status, error);
                };
                if body["source"] == "fallback" {
                    Seen::Fallback(ws)
                } else {
                    Seen::Lease(ws)
                }
            }
            429 => Seen::Denied,
            503 => Seen::Unavailable,
            _ => Seen::Ambiguous,
        };
        (seen, status, error)
    }
}

/// Counts `seen` of a request of `region` sent at `sent_ms` into `t`.
fn record(t: &mut Tally, region: &str, seen: Seen, sent_ms: i64) {
    // Refusals carry no window; the window length is not known here, so
    // they are filed under the second they were sent and regrouped by
    // the report once the window length is known.
    let wall = sent_ms.div_euclid(1000);
    let (ws, f): (i64, fn(&mut Counts)) = match seen {
        Seen::Lease(ws) => (ws, |c| c.lease += 1),
        Seen::Fallback(ws) => (ws, |c| c.fallback += 1),
        Seen::Denied => (wall, |c| c.denied += 1),
        Seen::Unavailable => (wall, |c| c.unavailable += 1),
        Seen::Ambiguous => (wall, |c| c.ambiguous += 1),
        Seen::Refused => (wall, |c| c.refused += 1),
    };
    let c = t.entry(ws).or_default().entry(region.to_string()).or_default();
    f(c);
    if matches!(seen, Seen::Lease(_) | Seen::Fallback(_)) {
        c.last_admit_sent_ms = c.last_admit_sent_ms.max(sent_ms);
    }
}

/// Regroups `tally` (keys: window starts or seconds) by windows of `secs`.
pub fn by_window(tally: &Tally, secs: i64) -> Tally {
    let mut out = Tally::new();
    for (t, regions) in tally {
        let ws = t.div_euclid(secs) * secs;
        let slot = out.entry(ws).or_default();
        for (r, c) in regions {
            slot.entry(r.clone()).or_default().add(c);
        }
    }
    out
}

/// Totals over regions of one window.
pub fn total(regions: &BTreeMap<String, Counts>) -> Counts {
    let mut c = Counts::default();
    for r in regions.values() {
        c.add(r);
    }
    c
}

/// One region's counts summed over every window.
pub fn region_total(tally: &Tally, region: &str) -> Counts {
    let mut c = Counts::default();
    for regions in tally.values() {
        if let Some(r) = regions.get(region) {
            c.add(r);
        }
    }
    c
}

impl Counts {
    /// What was counted since `before` (an earlier total).
    pub fn since(&self, before: &Counts) -> Counts {
        Counts {
            lease: self.lease - before.lease,
            fallback: self.fallback - before.fallback,
            denied: self.denied - before.denied,
            unavailable: self.unavailable - before.unavailable,
            ambiguous: self.ambiguous - before.ambiguous,
            refused: self.refused - before.refused,
            last_admit_sent_ms: self.last_admit_sent_ms,
        }
    }
}
