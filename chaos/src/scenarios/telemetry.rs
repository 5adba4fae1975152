//! `corrupted-telemetry` (seed 002 F30, game day 8): the telemetry
//! pipeline corrupted on purpose under traffic above G. For two windows the
//! allocator's status endpoint (`PUT /v1/agents/{region}/{agent}/status`,
//! the agents' fleet telemetry) gets, round after round, malformed bodies,
//! bodies that break each documented bound, statuses of agents that do not
//! exist, calls without or with a wrong agent token, a replay from an
//! agent's previous epoch, and well-formed lies under a real agent's name
//! (an old window replayed, absurd counts, a quota with no policy, the same
//! body many times at once); meanwhile the allocator's and the agents'
//! `/metrics` are scraped hard and many scrapes are cut off half way.
//!
//! F30: a telemetry failure is not an allowance failure. So the clients'
//! admissions and refusals in the corrupted windows must look like those
//! of the windows before, the allocator's accounting must equal the
//! clients' count (I7, and over the whole run), the malformed bodies must
//! be refused with a 4xx that names the problem and nothing with a 5xx; the
//! fleet view may show the lies, and the scenario records for how long.

use super::harness::{Profile, Run, RESOURCE, TENANT};
use crate::bins::Bins;
use crate::report::{ScenarioReport, Verdict, WindowRow};
use crate::stack::StackSpec;
use reqwest::Method;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Offered load (eu + us = 1.3 G): every window's pool runs dry, so the
/// windows have refusals as well as admits to compare.
const EU: f64 = 0.8;
const US: f64 = 0.5;
/// The agents' bearer token (the allocator is restarted to require it).
const TOKEN: &str = "chaos-telemetry-agent-token";
/// How often the agents send their status (the agents' default, set here
/// so the repair bound below rests on a known value).
const STATUS_INTERVAL_MS: u64 = 2000;
/// The fleet view must show the agent's own status again within two of
/// its intervals (one may be under way when the lie lands) and a second.
const REPAIR_BOUND: Duration = Duration::from_millis(2 * STATUS_INTERVAL_MS + 1000);
/// A count far beyond any real window, yet within the allocator's bound
/// on counts (`MAX_COUNT`, 10^12), so it is stored.
const ABSURD: i64 = 1_000_000_000_000;
/// Copies of one status sent at once per round.
const DUPLICATES: usize = 16;
/// Most rounds of corrupt statuses (each about 50 calls); the phase's
/// deadline ends them sooner.
const MAX_ROUNDS: usize = 400;
/// Scrapers of each kind (complete, cut off) running at once.
const SCRAPERS: usize = 2;
/// Pause of each scraper between two scrapes, so the hammer leaves the
/// two cores to the agents it is supposed to leave alone.
const SCRAPE_PAUSE: Duration = Duration::from_millis(10);

/// What the allocator answered a call.
#[derive(Debug, Clone)]
struct Answered {
    status: u16,
    body: Value,
    /// Sent again after its connection failed before any answer: why.
    resent: Option<String>,
}

impl Answered {
    /// `error` / `field` / `message` of a refusal, for the notes.
    fn named(&self) -> String {
        let s = |k: &str| self.body[k].as_str().unwrap_or("").to_string();
        match self.body["field"].as_str() {
            Some(f) => format!("{} {} (field {f})", self.status, s("error")),
            None => format!("{} {}: {}", self.status, s("error"), s("message")),
        }
    }

    /// Whether a refusal names its problem: an error code and a message,
    /// and a field when it is `invalid_field`.
    fn names_problem(&self) -> bool {
        let has = |k: &str| self.body[k].as_str().is_some_and(|v| !v.is_empty());
        has("error") && has("message") && (self.body["error"] != "invalid_field" || has("field"))
    }
}

/// Sends one call; status 0 when no answer came. A call whose kept-alive
/// connection failed before any answer (the server may close an idle
/// pooled connection just as it is reused: HTTP/1.1's keep-alive race) is
/// sent once more on a fresh one, as any client of an idempotent PUT
/// would, and says so (`resent`); a timeout is not resent.
async fn call(
    http: &reqwest::Client,
    method: Method,
    url: &str,
    token: Option<&str>,
    content_type: Option<&str>,
    body: Vec<u8>,
) -> Answered {
    let mut resent = None;
    loop {
        let mut rb = http.request(method.clone(), url).body(body.clone());
        if let Some(t) = token {
            rb = rb.bearer_auth(t);
        }
        if let Some(ct) = content_type {
            rb = rb.header("content-type", ct);
        }
        match rb.send().await {
            Ok(r) => {
                let status = r.status().as_u16();
                let bytes = r.bytes().await.unwrap_or_default();
                let body = serde_json::from_slice(&bytes)
                    .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into()));
                return Answered { status, body, resent };
            }
            Err(e) if resent.is_none() && e.is_request() && !e.is_timeout() => {
                resent = Some(format!("{e:?}"))
            }
            Err(e) => return Answered { status: 0, body: Value::String(e.to_string()), resent },
        }
    }
}

/// What a corrupt call must get.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Expect {
    /// Refused with this status, naming the problem.
    Refused(u16),
    /// Refused with this status by the router itself, whose answer has no
    /// JSON body (a 405 names the allowed methods in `Allow`).
    RefusedBare(u16),
    /// Well-formed: stored (204) as the agent's latest status, lie or not.
    Stored,
}

/// One corrupt call.
struct Case {
    what: &'static str,
    method: Method,
    /// Path on the allocator.
    path: String,
    token: Option<&'static str>,
    content_type: Option<&'static str>,
    body: Vec<u8>,
    expect: Expect,
}

fn rfc3339(t: i64) -> String {
    chrono::DateTime::from_timestamp(t, 0)
        .unwrap_or_default()
        .to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
}

/// One quota entry of a status.
fn quota(tenant: &str, window_start: i64, mode: &str, n: i64) -> Value {
    json!({"tenant": tenant, "resource": RESOURCE, "mode": mode, "window_start": rfc3339(window_start),
           "quota_exhausted": n, "unavailable": n, "per_key_limited": n, "admitted": n})
}

/// A status body listing `quotas`.
fn status(epoch: i64, quotas: Vec<Value>) -> Value {
    json!({"epoch": epoch, "allocator_reachable": true, "outbox_depth": 0, "dead_letters": 0,
           "quotas_total": quotas.len(), "quotas": quotas})
}

/// What the corrupt calls are about: eu's first agent and its epoch, a
/// decoy agent registered twice (its first epoch is stale), the open
/// window.
struct Target {
    path: String,
    epoch: i64,
    decoy_path: String,
    decoy_old_epoch: i64,
    window_start: i64,
    window_secs: i64,
}

/// The well-formed lies under the real agent's name (stored, then
/// overwritten by its next status): a replay of an old window in fallback
/// mode, absurd counts, and a quota that has no policy.
fn lies(t: &Target) -> Vec<Case> {
    let stored = |what, body: Value| Case {
        what,
        method: Method::PUT,
        path: t.path.clone(),
        token: Some(TOKEN),
        content_type: Some("application/json"),
        body: body.to_string().into_bytes(),
        expect: Expect::Stored,
    };
    let old = t.window_start - 10 * t.window_secs;
    let mut absurd = status(t.epoch, vec![quota(TENANT, t.window_start, "leased", ABSURD)]);
    for k in ["outbox_depth", "dead_letters", "quotas_total"] {
        absurd[k] = json!(ABSURD);
    }
    vec![
        stored(
            "replay of an old status (ten windows back, mode fallback)",
            status(t.epoch, vec![quota(TENANT, old, "fallback", 7)]),
        ),
        stored(
            "counts for a quota without a policy",
            status(t.epoch, vec![quota("ghost", t.window_start, "exhausted", 5)]),
        ),
        stored("absurd counts (10^12) for the open window", absurd),
    ]
}

/// The calls that must be refused, each with the status it must get.
fn refusals(t: &Target) -> Vec<Case> {
    let ok = || status(t.epoch, vec![quota(TENANT, t.window_start, "leased", 1)]);
    let with = |f: &dyn Fn(&mut Value)| {
        let mut v = ok();
        f(&mut v);
        v.to_string().into_bytes()
    };
    let refused = |what, code, body: Vec<u8>| Case {
        what,
        method: Method::PUT,
        path: t.path.clone(),
        token: Some(TOKEN),
        content_type: Some("application/json"),
        body,
        expect: Expect::Refused(code),
    };
    let many: Vec<Value> = (0..201).map(|i| quota(&format!("t{i}"), t.window_start, "leased", 0)).collect();
    let epoch = t.epoch;
    let mut cases = vec![
        refused("truncated JSON", 400, b"{\"epoch\": 3, \"quotas\": [".to_vec()),
        refused("not JSON at all", 400, b"status: all fine".to_vec()),
        refused("an empty body", 400, Vec::new()),
        refused("invalid UTF-8", 400, vec![b'{', 0xff, 0xfe, b'}']),
        // Refused at its first element (a status is no sequence) before
        // any depth limit matters.
        refused("an array nested 10,000 deep", 422, "[".repeat(10_000).into_bytes()),
        refused("null", 422, b"null".to_vec()),
        refused("an array", 422, b"[]".to_vec()),
        refused(
            "epoch missing",
            422,
            with(&|v| {
                if let Some(o) = v.as_object_mut() {
                    o.remove("epoch");
                }
            }),
        ),
        refused("epoch as a string", 422, with(&|v| v["epoch"] = json!("one"))),
        refused("epoch 0", 422, with(&|v| v["epoch"] = json!(0))),
        refused("an epoch never issued", 422, with(&|v| v["epoch"] = json!(epoch + 1000))),
        refused("a negative outbox_depth", 422, with(&|v| v["outbox_depth"] = json!(-1))),
        refused("quotas_total below the quotas listed", 422, with(&|v| v["quotas_total"] = json!(0))),
        refused(
            "a quota listed twice",
            422,
            with(&|v| {
                let q = v["quotas"][0].clone();
                if let Some(a) = v["quotas"].as_array_mut() {
                    a.push(q);
                }
                v["quotas_total"] = json!(2);
            }),
        ),
        refused("201 quotas", 422, status(epoch, many).to_string().into_bytes()),
        refused("a count of i64::MAX", 422, with(&|v| v["quotas"][0]["quota_exhausted"] = json!(i64::MAX))),
        refused("a count of 1e30", 422, with(&|v| v["quotas"][0]["admitted"] = json!(1e30))),
        refused(
            "a window_start that is no time",
            422,
            with(&|v| v["quotas"][0]["window_start"] = json!("soon")),
        ),
        refused(
            "a window_start with milliseconds",
            422,
            with(&|v| v["quotas"][0]["window_start"] = json!("2026-01-01T00:00:00.250Z")),
        ),
        refused("an unknown mode", 422, with(&|v| v["quotas"][0]["mode"] = json!("banana"))),
        refused(
            "a tenant that is no identifier",
            422,
            with(&|v| v["quotas"][0]["tenant"] = json!("../../etc")),
        ),
        refused("an unknown field", 422, with(&|v| v["is_admin"] = json!(true))),
        refused("a 100 KiB body", 413, with(&|v| v["quotas"][0]["tenant"] = json!("x".repeat(100 * 1024)))),
    ];
    let elsewhere = |what, path: String, token, code| Case {
        what,
        method: Method::PUT,
        path,
        token,
        content_type: Some("application/json"),
        body: ok().to_string().into_bytes(),
        expect: Expect::Refused(code),
    };
    cases.extend([
        elsewhere("a region that is no identifier", "/v1/agents/e%20u/eu-1/status".into(), Some(TOKEN), 422),
        elsewhere("an agent that never registered", "/v1/agents/eu/ghost-1/status".into(), Some(TOKEN), 404),
        elsewhere("eu's agent under region us", "/v1/agents/us/eu-1/status".into(), Some(TOKEN), 404),
        elsewhere(
            "an agent that never registered, no token",
            "/v1/agents/eu/ghost-1/status".into(),
            None,
            401,
        ),
        elsewhere("a real agent, no token", t.path.clone(), None, 401),
        elsewhere("a real agent, a wrong token", t.path.clone(), Some("not-the-token"), 401),
    ]);
    cases.push(Case {
        content_type: Some("text/plain"),
        ..refused("a text/plain content type", 415, ok().to_string().into_bytes())
    });
    cases.push(Case {
        method: Method::POST,
        expect: Expect::RefusedBare(405),
        ..refused("POST instead of PUT", 405, ok().to_string().into_bytes())
    });
    cases.push(Case {
        path: t.decoy_path.clone(),
        ..refused(
            "a replay from an agent's previous epoch",
            409,
            status(t.decoy_old_epoch, vec![quota(TENANT, t.window_start, "leased", 1)])
                .to_string()
                .into_bytes(),
        )
    });
    cases
}

/// What the corrupt calls got, over every round.
#[derive(Default)]
struct Outcome {
    sent: u64,
    refused_4xx: u64,
    stored: u64,
    server_errors: u64,
    /// Calls sent again after their connection failed before any answer,
    /// and the first such failure.
    resent: u64,
    first_resend: Option<String>,
    /// Calls that got something other than expected (first answer each).
    unexpected: BTreeMap<&'static str, String>,
    /// Refusals whose body did not name the problem.
    unnamed: BTreeMap<&'static str, String>,
    /// What each kind of call got in the first round.
    first: Vec<(&'static str, String)>,
}

impl Outcome {
    fn record(&mut self, c: &Case, a: &Answered, first_round: bool) {
        self.sent += 1;
        if let Some(why) = &a.resent {
            self.resent += 1;
            self.first_resend.get_or_insert_with(|| format!("{}: {why}", c.what));
        }
        match a.status {
            400..=499 => self.refused_4xx += 1,
            204 => self.stored += 1,
            s if s >= 500 || s == 0 => self.server_errors += 1,
            _ => {}
        }
        let ok = match c.expect {
            Expect::Refused(code) => {
                if a.status == code && !a.names_problem() {
                    self.unnamed.entry(c.what).or_insert_with(|| a.body.to_string());
                }
                a.status == code
            }
            Expect::RefusedBare(code) => a.status == code,
            Expect::Stored => a.status == 204,
        };
        if !ok {
            self.unexpected.entry(c.what).or_insert_with(|| format!("{} {}", a.status, a.body));
        }
        if first_round {
            self.first.push((c.what, a.named()));
        }
    }
}

/// The text (tags left out) of the first `data-field="field"` cell after
/// `anchor` in `html`, within the anchor's table row.
fn cell(html: &str, anchor: &str, field: &str) -> Option<String> {
    let row = &html[html.find(anchor)?..];
    let row = &row[..row.find("</tr>").unwrap_or(row.len())];
    let at = row.find(&format!("data-field=\"{field}\""))?;
    let rest = &row[at..];
    let inner = &rest[rest.find('>')? + 1..];
    let inner = &inner[..inner.find("</td>")?];
    let mut text = String::new();
    let mut in_tag = false;
    for ch in inner.chars() {
        match ch {
            '<' => in_tag = true,
            '>' => in_tag = false,
            c if !in_tag => text.push(c),
            _ => {}
        }
    }
    Some(text)
}

/// The fleet view's cells the lies show up in: eu-1's quotas and outbox
/// depth (`/ui/regions`), the quota's open-window 429s and regions in
/// fallback (`/ui`).
async fn fleet_view(http: &reqwest::Client, api: &str) -> BTreeMap<&'static str, String> {
    let page = |path: &str| {
        let url = format!("{api}{path}");
        async move {
            match http.get(&url).send().await {
                Ok(r) => r.text().await.unwrap_or_default(),
                Err(_) => String::new(),
            }
        }
    };
    let (regions, index) = futures::join!(page("/ui/regions"), page("/ui"));
    let agent = "data-agent=\"eu/eu-1\"";
    let q = format!("data-quota=\"{TENANT}/{RESOURCE}\"");
    let mut out = BTreeMap::new();
    for (name, html, anchor, field) in [
        ("eu-1 quotas", &regions, agent, "quotas"),
        ("eu-1 outbox_depth", &regions, agent, "outbox_depth"),
        ("refused_429", &index, q.as_str(), "refused_429"),
        ("fallback_regions", &index, q.as_str(), "fallback_regions"),
    ] {
        out.insert(name, cell(html, anchor, field).unwrap_or_else(|| "?".into()));
    }
    out
}

/// Scrapes `/metrics` of `targets` (host:port) until `until`, whole
/// (`cut` false: the answer read to its end) or cut off half way (the
/// request written whole or in part, the answer's first bytes read or
/// none, then the connection dropped). Answers (done, failed).
async fn scrape(targets: &[String], cut: bool, until: Instant, seed: usize) -> (u64, u64) {
    let http =
        quota_tests::http::client_builder().timeout(Duration::from_secs(5)).build().unwrap_or_default();
    let (mut done, mut failed) = (0u64, 0u64);
    let mut i = seed;
    while Instant::now() < until {
        let target = &targets[i % targets.len()];
        i += 1;
        let ok = if cut {
            cut_scrape(target, i % 3).await
        } else {
            match http.get(format!("http://{target}/metrics")).send().await {
                Ok(r) => r.status() == 200 && r.bytes().await.is_ok(),
                Err(_) => false,
            }
        };
        if ok {
            done += 1;
        } else {
            failed += 1;
        }
        tokio::time::sleep(SCRAPE_PAUSE).await;
    }
    (done, failed)
}

/// One scrape cut off: `how` 0 drops the connection right after the
/// request, 1 after the answer's first bytes, 2 half way through the
/// request line. Whether the connection and the writes worked.
async fn cut_scrape(target: &str, how: usize) -> bool {
    let request = format!("GET /metrics HTTP/1.1\r\nHost: {target}\r\n\r\n");
    let attempt = async {
        let mut s = tokio::net::TcpStream::connect(target).await?;
        match how {
            0 => s.write_all(request.as_bytes()).await?,
            1 => {
                s.write_all(request.as_bytes()).await?;
                let mut buf = [0u8; 64];
                let _ = s.read(&mut buf).await?;
            }
            _ => s.write_all(&request.as_bytes()[..8]).await?,
        }
        Ok::<_, std::io::Error>(())
    };
    matches!(tokio::time::timeout(Duration::from_secs(2), attempt).await, Ok(Ok(())))
}

/// Admitted, 429s and 503s per window of the windows starting in `[from,
/// to)` (Unix s), and their count.
struct Phase {
    windows: usize,
    admitted: Vec<u64>,
    denied: Vec<u64>,
    unavailable: u64,
    ambiguous: u64,
}

fn phase(rows: &[WindowRow], from: i64, to: i64) -> Phase {
    let start = |r: &WindowRow| {
        chrono::DateTime::parse_from_rfc3339(&r.window_start).map(|t| t.timestamp()).unwrap_or(i64::MIN)
    };
    let rows: Vec<&WindowRow> = rows.iter().filter(|r| (from..to).contains(&start(r))).collect();
    Phase {
        windows: rows.len(),
        admitted: rows.iter().map(|r| r.admitted).collect(),
        denied: rows.iter().map(|r| r.denied).collect(),
        unavailable: rows.iter().map(|r| r.unavailable).sum(),
        ambiguous: rows.iter().map(|r| r.ambiguous).sum(),
    }
}

fn mean(v: &[u64]) -> f64 {
    v.iter().sum::<u64>() as f64 / v.len().max(1) as f64
}

pub async fn corrupted_telemetry(p: &Profile, bins: Bins) -> Result<ScenarioReport, String> {
    let spec = StackSpec {
        agent_env: vec![
            ("QUOTA_AGENT_TOKEN".into(), TOKEN.into()),
            ("AGENT_STATUS_INTERVAL_MS".into(), STATUS_INTERVAL_MS.to_string()),
        ],
        ..StackSpec::two_regions()
    };
    let mut run = Run::start("corrupted-telemetry", p, bins, Some(spec), false).await?;
    // The stack's allocator takes agent calls without a token (loopback);
    // restarted with the token the agents already send, a call without it
    // is refused, as in a deployment.
    let alloc = run.stack.allocators.remove(0);
    let mut alloc = alloc.envs([("QUOTA_AGENT_TOKEN".to_string(), TOKEN.to_string())]);
    alloc.kill(libc::SIGTERM);
    alloc.start_ready(Duration::from_secs(30)).await?;
    let alloc_addr = alloc.addr.clone();
    run.stack.allocators.insert(0, alloc);
    let epoch = run.stack.region("eu").agents[0].epoch().await;
    let api = run.stack.admin.base.clone();
    let http = quota_tests::http::client_builder()
        .pool_max_idle_per_host(DUPLICATES)
        .timeout(Duration::from_secs(10))
        .build()
        .map_err(|e| e.to_string())?;
    // A decoy agent of eu registered twice: a status of its first epoch is
    // a replay from before a restart (no real agent is disturbed for it).
    let mut decoy = Vec::new();
    for _ in 0..2 {
        let body = json!({"region": "eu", "agent": "decoy"}).to_string().into_bytes();
        let a = call(
            &http,
            Method::POST,
            &format!("{api}/v1/agents/register"),
            Some(TOKEN),
            Some("application/json"),
            body,
        )
        .await;
        decoy.push(
            a.body["epoch"].as_i64().ok_or_else(|| format!("register the decoy: {} {}", a.status, a.body))?,
        );
    }
    run.note(format!(
        "allocator restarted to require the agents' token; eu-1 at epoch {epoch}; decoy eu/decoy registered at epochs {decoy:?}"
    ));
    let mut scraped: Vec<String> = vec![alloc_addr];
    for (_, urls) in run.stack.agent_urls() {
        scraped.extend(urls.iter().map(|u| u.trim_start_matches("http://").to_string()));
    }

    run.traffic(&[("eu", EU), ("us", US)]);
    run.pass(0.5).await;
    run.at_phase(0.0).await;
    let w = p.window_secs;
    let baseline_from = chrono::Utc::now().timestamp().div_euclid(w) * w;
    run.pass(2.0).await;
    let corrupt_from = baseline_from + 2 * w;
    wait_until_unix(corrupt_from).await;

    // Two windows of corruption: rounds of corrupt statuses beside the
    // scrapers.
    let corrupt_to = corrupt_from + 2 * w;
    let until = Instant::now()
        + Duration::from_millis((corrupt_to * 1000 - chrono::Utc::now().timestamp_millis()).max(0) as u64);
    let mut out = Outcome::default();
    let mut target = Target {
        path: "/v1/agents/eu/eu-1/status".into(),
        epoch,
        decoy_path: "/v1/agents/eu/decoy/status".into(),
        decoy_old_epoch: decoy[0],
        window_start: 0,
        window_secs: w,
    };
    let rounds = async {
        let mut n = 0;
        while n < MAX_ROUNDS && Instant::now() < until {
            let now = chrono::Utc::now().timestamp();
            target.window_start = now.div_euclid(w) * w;
            let mut cases = refusals(&target);
            cases.extend(lies(&target));
            for c in &cases {
                let a = call(
                    &http,
                    c.method.clone(),
                    &format!("{api}{}", c.path),
                    c.token,
                    c.content_type,
                    c.body.clone(),
                )
                .await;
                out.record(c, &a, n == 0);
            }
            // The same replayed status many times at once.
            let dup = lies(&target).swap_remove(0);
            let url = format!("{api}{}", dup.path);
            let copies = (0..DUPLICATES)
                .map(|_| call(&http, Method::PUT, &url, dup.token, dup.content_type, dup.body.clone()));
            for a in futures::future::join_all(copies).await {
                out.record(&dup, &a, false);
            }
            n += 1;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        n
    };
    let scrapers =
        futures::future::join_all((0..2 * SCRAPERS).map(|i| scrape(&scraped, i % 2 == 1, until, i)));
    let (n_rounds, scrapes) = futures::join!(rounds, scrapers);
    let (mut whole, mut aborted, mut failed) = (0u64, 0u64, 0u64);
    for (i, (done, bad)) in scrapes.into_iter().enumerate() {
        if i % 2 == 1 {
            aborted += done;
        } else {
            whole += done;
        }
        failed += bad;
    }

    // The fleet view right after the last lies, then until the agent's own
    // status replaces them; the lies name the window open now.
    target.window_start = chrono::Utc::now().timestamp().div_euclid(w) * w;
    let replay = lies(&target).swap_remove(0);
    let a = call(
        &http,
        Method::PUT,
        &format!("{api}{}", replay.path),
        replay.token,
        replay.content_type,
        replay.body.clone(),
    )
    .await;
    out.record(&replay, &a, false);
    let after_replay = fleet_view(&http, &api).await;
    let absurd = lies(&target).swap_remove(2);
    let a = call(
        &http,
        Method::PUT,
        &format!("{api}{}", absurd.path),
        absurd.token,
        absurd.content_type,
        absurd.body.clone(),
    )
    .await;
    out.record(&absurd, &a, false);
    let lied_at = Instant::now();
    let after_absurd = fleet_view(&http, &api).await;
    let absurd_text = ABSURD.to_string();
    let shows_lie = |v: &BTreeMap<&str, String>| v.values().any(|c| c.contains(&absurd_text));
    let repaired = quota_tests::wait::poll(
        REPAIR_BOUND + Duration::from_secs(5),
        Duration::from_millis(100),
        || async {
            let v = fleet_view(&http, &api).await;
            if shows_lie(&v) {
                Err(v)
            } else {
                Ok(v)
            }
        },
    )
    .await;
    let repair_s = lied_at.elapsed().as_secs_f64();

    run.figure("corrupt_status_sent", out.sent as f64);
    run.figure("corrupt_status_refused_4xx", out.refused_4xx as f64);
    run.figure("corrupt_status_stored", out.stored as f64);
    run.figure("status_5xx", out.server_errors as f64);
    run.figure("status_resent_after_connection_error", out.resent as f64);
    if let Some(first) = &out.first_resend {
        run.note(format!(
            "{} status calls sent again after their connection failed; the first: {first}",
            out.resent
        ));
    }
    run.figure("metrics_scrapes_aborted", aborted as f64);
    run.figure("metrics_scrapes_completed", whole as f64);
    run.note(format!(
        "{n_rounds} rounds over two windows: {} corrupt statuses sent, {} refused 4xx, {} stored (204), {} 5xx or unanswered",
        out.sent, out.refused_4xx, out.stored, out.server_errors
    ));
    let first: Vec<String> = out.first.iter().map(|(w, a)| format!("{w} → {a}")).collect();
    run.note(format!("what each corrupt status got: {}", first.join("; ")));
    run.check(
        out.server_errors == 0,
        format!("status calls answered 5xx or not at all: {}", out.server_errors),
    );
    run.check(
        out.unexpected.is_empty(),
        format!("every corrupt status got the answer expected of it (unexpected: {:?})", out.unexpected),
    );
    run.check(
        out.unnamed.is_empty(),
        format!("every refusal names its problem (error, message, field) (unnamed: {:?})", out.unnamed),
    );
    run.note(format!(
        "/metrics: {whole} whole scrapes, {aborted} cut off half way, {failed} failed (allocator and agents)"
    ));
    let mut healthy = 0;
    for t in &scraped {
        let ok = call(&http, Method::GET, &format!("http://{t}/metrics"), None, None, Vec::new()).await;
        healthy += usize::from(ok.status == 200);
    }
    run.check(
        healthy == scraped.len(),
        format!("after the hammer, /metrics answers 200 on {healthy} of {} processes", scraped.len()),
    );
    run.note(format!("fleet view after a replayed status: {after_replay:?}"));
    run.note(format!("fleet view after absurd counts: {after_absurd:?}"));
    match repaired {
        Ok(v) if shows_lie(&after_absurd) => {
            run.figure("fleet_view_repaired_s", repair_s);
            run.check(
                repair_s <= REPAIR_BOUND.as_secs_f64(),
                format!(
                    "the fleet view showed the absurd counts until eu-1's own status replaced them {repair_s:.1} s later \
                     (at most {:.1} s): {v:?}",
                    REPAIR_BOUND.as_secs_f64()
                ),
            );
        }
        Ok(_) => run.note(
            "eu-1's own status landed before the fleet view was read: the absurd counts were never seen",
        ),
        Err(v) => run.check(
            false,
            format!("the fleet view still shows the absurd counts after {repair_s:.1} s: {v:?}"),
        ),
    }
    run.pass(0.5).await;
    // How late an admit into an ended window came (I2 fails on any), so
    // such a failure says by how much and where.
    for (ws, regions) in run.tally() {
        for (region, c) in regions {
            let late_ms = c.last_admit_sent_ms - (ws + w) * 1000;
            if c.admitted() > 0 && late_ms >= 0 {
                run.note(format!(
                    "window {}: {region}'s last admit into it was sent {late_ms} ms after it ended",
                    rfc3339(ws)
                ));
            }
        }
    }

    let g = p.limit;
    let mut rep = run
        .finish_with(move |rows, _| {
            let before = phase(rows, baseline_from, corrupt_from);
            let during = phase(rows, corrupt_from, corrupt_to);
            let floor = before.admitted.iter().min().copied().unwrap_or(0) as i64 - g / 20;
            let ledger: i64 = rows.iter().map(|r| r.ledger_admitted).sum();
            let clients: i64 = rows.iter().map(|r| r.admitted as i64).sum();
            let ambiguous: i64 = rows.iter().map(|r| r.ambiguous as i64).sum();
            vec![
                (
                    before.windows == 2 && during.windows == 2,
                    format!("two whole windows before the corruption and two during it: {} and {}", before.windows, during.windows),
                ),
                (
                    during.admitted.iter().all(|a| *a as i64 >= floor) && during.unavailable == 0 && during.ambiguous == 0,
                    format!(
                        "enforcement unchanged: admitted per window {:?} before, {:?} during (at least {floor}); \
                         429s {:?} before, {:?} during; 503s {} / {}, unanswered {} / {}",
                        before.admitted, during.admitted, before.denied, during.denied,
                        before.unavailable, during.unavailable, before.ambiguous, during.ambiguous
                    ),
                ),
                (
                    ledger == clients || (ledger > clients && ledger - clients <= ambiguous),
                    format!("the allocator's accounting over the run: {ledger} admitted, the clients' {clients}"),
                ),
            ]
        })
        .await?;
    // The figures of the windows compared, from the report's rows (the
    // closure above cannot record figures).
    let before = phase(&rep.windows, baseline_from, corrupt_from);
    let during = phase(&rep.windows, corrupt_from, corrupt_to);
    let ledger: i64 = rep.windows.iter().map(|r| r.ledger_admitted - r.admitted as i64).sum();
    let unanswered: u64 = rep.windows.iter().map(|r| r.ambiguous).sum();
    for (k, v) in [
        ("ledger_minus_clients", ledger as f64),
        ("unanswered", unanswered as f64),
        ("admitted_per_window_before", mean(&before.admitted)),
        ("admitted_per_window_during", mean(&during.admitted)),
        ("refused_429_per_window_before", mean(&before.denied)),
        ("refused_429_per_window_during", mean(&during.denied)),
    ] {
        rep.figures.insert(k.to_string(), v);
    }
    if rep.verdict == Verdict::Pass && ledger != 0 {
        rep.notes.push(format!(
            "the allocator counts {ledger} admits more than the clients saw (unanswered requests)"
        ));
    }
    Ok(rep)
}

/// Sleeps until Unix second `t` (this host's clock).
async fn wait_until_unix(t: i64) {
    let at = chrono::DateTime::from_timestamp(t, 0).unwrap_or_default();
    quota_tests::wait::until_utc(at).await;
}
