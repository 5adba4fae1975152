//! `key-namespace-shadow` (seed 002 F34, game day 7): a rolling deploy that
//! changes the Redis key namespace of a region, with a per-key policy in
//! shadow mode, and the decisions of the two layouts diffed.
//!
//! eu runs three agents of the legacy key layout (`AGENT_KEY_LAYOUT=legacy`,
//! one hash tag per quota). Beside the main quota's traffic (the window
//! bound and ledger checks of every scenario), keyed clients send a fixed
//! set of keys round robin over the three agents on a second quota whose
//! policy has a per-key bucket in shadow mode (`enforce: false`). The agents
//! are restarted one by one with `AGENT_KEY_LAYOUT=tenant`: for a while both
//! layouts serve the same keys from two sets of buckets (docs/deploying.md,
//! "Upgrading from the per-quota key layout": per-key buckets start full in
//! the new layout). Then enforcement is switched on through the control
//! plane (a policy `PUT`), not a deploy.
//!
//! Measured and checked: per layout, the share of decisions the shadow
//! policy would have refused; per key, what it would have allowed with one
//! layout (at most one bucket) and in the mixed period (more than one
//! bucket, at most two: F34's 2x); no 5xx and no `WRONGTYPE` at any point;
//! the allocator counts every keyed decision of both layouts (the legacy
//! counters cut and reported); every agent enforces within the policy's
//! propagation and never decides in shadow mode again; the legacy layout's
//! counters, outboxes and leases swept, every other legacy key expiring
//! within its kind's stated life.

use super::harness::{Profile, Run, RESOURCE, TENANT};
use crate::bins::Bins;
use crate::report::ScenarioReport;
use crate::stack::StackSpec;
use serde_json::json;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;
use tokio::task::JoinSet;

/// The main quota's offered share of G (eu only): below G, so its
/// refusals would come from the roll, not from the pool.
const EU: f64 = 0.4;
/// eu's agents, rolled one by one.
const AGENTS: usize = 3;
/// The quota with the per-key policy in shadow mode.
const KEYED: &str = "keyed";
/// The fixed set of keys the keyed clients send.
const KEYS: usize = 4;
/// Requests per second of each key, spread round robin over the agents:
/// 4/s per agent and key, twice the bucket's refill, so each layout's
/// bucket of a key stays drained even while only a third of the key's
/// requests reach that layout.
const KEY_RATE: f64 = 12.0;
/// The per-key bucket: refill per second and size.
const PK_RATE: f64 = 2.0;
const PK_BURST: i64 = 4;
/// A keyed client gives up on an answer after this long.
const KEY_TIMEOUT: Duration = Duration::from_secs(2);
/// Most keyed answers kept (the run sends about 3,000).
const MAX_KEYED_ANSWERS: usize = 50_000;
/// How long the allocator may take to count every keyed decision once the
/// keyed clients stopped: the agents' outbox rounds (200 ms), the new
/// agents' sweep of the legacy layout's counters, and the open window's
/// counts, which are cut while it is open too.
const SETTLE: Duration = Duration::from_secs(15);

/// One keyed request as its client saw it.
#[derive(Debug, Clone)]
struct KeyedAnswer {
    key: usize,
    /// The agent it was sent to (index in eu's agents).
    agent: usize,
    /// Whether the agent it was sent to ran the tenant layout.
    tenant: bool,
    sent_ms: i64,
    /// HTTP status; 0 when no answer came.
    status: u16,
    /// 200 with `shadow_refused: true`: an enforced policy would have refused.
    shadow: bool,
    /// 429 naming the key's bucket (`limit: "per_key"`).
    per_key: bool,
    /// No answer because the agent was down (connection refused).
    down: bool,
    error: String,
}

impl KeyedAnswer {
    /// A 200 the policy would have given also when enforced.
    fn allowed(&self) -> bool {
        self.status == 200 && !self.shadow
    }
}

/// The keyed clients: one loop per key.
struct Keyed {
    answers: Arc<Mutex<Vec<KeyedAnswer>>>,
    /// Per agent: whether it runs the tenant layout (flipped while it is
    /// down, so every answer is labelled with the layout that gave it).
    tenant: Arc<Vec<AtomicBool>>,
    stop: watch::Sender<bool>,
    tasks: JoinSet<()>,
}

impl Keyed {
    fn start(urls: Vec<String>) -> Keyed {
        let answers = Arc::new(Mutex::new(Vec::new()));
        let tenant: Arc<Vec<AtomicBool>> = Arc::new(urls.iter().map(|_| AtomicBool::new(false)).collect());
        let (stop, _) = watch::channel(false);
        let client = quota_tests::http::client_builder().timeout(KEY_TIMEOUT).build().expect("http client");
        let urls: Arc<Vec<String>> = Arc::new(urls.iter().map(|u| format!("{u}/v1/acquire")).collect());
        let mut tasks = JoinSet::new();
        for key in 0..KEYS {
            let ctx = KeyLoop {
                key,
                client: client.clone(),
                urls: urls.clone(),
                tenant: tenant.clone(),
                answers: answers.clone(),
            };
            tasks.spawn(ctx.run(stop.subscribe()));
        }
        Keyed { answers, tenant, stop, tasks }
    }

    fn answers(&self) -> Vec<KeyedAnswer> {
        self.answers.lock().map(|a| a.clone()).unwrap_or_default()
    }

    async fn stop(mut self) -> Vec<KeyedAnswer> {
        self.stop.send_replace(true);
        while self.tasks.join_next().await.is_some() {}
        self.answers()
    }
}

struct KeyLoop {
    key: usize,
    client: reqwest::Client,
    urls: Arc<Vec<String>>,
    tenant: Arc<Vec<AtomicBool>>,
    answers: Arc<Mutex<Vec<KeyedAnswer>>>,
}

impl KeyLoop {
    async fn run(self, mut stop: watch::Receiver<bool>) {
        let period = Duration::from_secs_f64(1.0 / KEY_RATE);
        // The keys take turns within the period, and each starts on
        // another agent, so every agent sees every key.
        let mut next = tokio::time::Instant::now() + period.mul_f64(self.key as f64 / KEYS as f64);
        let mut n = self.key;
        loop {
            tokio::select! {
                _ = tokio::time::sleep_until(next) => {},
                _ = stop.changed() => return,
            }
            if *stop.borrow() {
                return;
            }
            next += period;
            // A loop that fell behind (a slow answer) does not burst to catch up.
            let now = tokio::time::Instant::now();
            if next + Duration::from_secs(1) < now {
                next = now;
            }
            let agent = n % self.urls.len();
            n += 1;
            let tenant = self.tenant[agent].load(Ordering::SeqCst);
            let sent_ms = chrono::Utc::now().timestamp_millis();
            let body = json!({"tenant": TENANT, "resource": KEYED, "key": format!("user-{}", self.key)});
            let mut a = KeyedAnswer {
                key: self.key,
                agent,
                tenant,
                sent_ms,
                status: 0,
                shadow: false,
                per_key: false,
                down: false,
                error: String::new(),
            };
            match self.client.post(&self.urls[agent]).json(&body).send().await {
                Err(e) => a.down = e.is_connect(),
                Ok(r) => {
                    a.status = r.status().as_u16();
                    let b: serde_json::Value = r.json().await.unwrap_or_default();
                    a.shadow = b["shadow_refused"] == true;
                    a.per_key = a.status == 429 && b["limit"] == "per_key";
                    a.error = b["error"].as_str().unwrap_or_default().to_string();
                }
            }
            let Ok(mut all) = self.answers.lock() else { return };
            if all.len() < MAX_KEYED_ANSWERS {
                all.push(a);
            }
        }
    }
}

/// The keyed quota's policy: generous on the quota (only the key's bucket
/// refuses), the bucket in shadow mode unless `enforce`.
fn keyed_policy(p: &Profile, enforce: bool) -> serde_json::Value {
    json!({"limit": p.limit, "window_secs": p.window_secs, "fallback_per_region": p.fallback,
           "fail_mode": "bounded", "per_key": {"rate_per_sec": PK_RATE, "burst": PK_BURST},
           "enforce": enforce})
}

/// Share of `answers`' decisions (200s) that were shadow refusals, and
/// how many decisions that is.
fn shadow_share<'a>(answers: impl Iterator<Item = &'a KeyedAnswer>) -> (f64, usize) {
    let (mut n, mut shadow) = (0usize, 0usize);
    for a in answers.filter(|a| a.status == 200) {
        n += 1;
        shadow += usize::from(a.shadow);
    }
    (if n == 0 { 0.0 } else { shadow as f64 / n as f64 }, n)
}

/// Per key, the admits an enforced policy would also have given among
/// answers sent in `[from, to)` (Unix ms).
fn allowed_per_key(answers: &[KeyedAnswer], from: i64, to: i64) -> Vec<usize> {
    let mut per = vec![0; KEYS];
    for a in answers.iter().filter(|a| a.allowed() && a.sent_ms >= from && a.sent_ms < to) {
        per[a.key] += 1;
    }
    per
}

/// What one bucket allows over `ms`: a full burst plus the refill.
fn one_bucket(ms: i64) -> f64 {
    PK_BURST as f64 + PK_RATE * ms as f64 / 1000.0
}

/// The lab's look at eu's Redis: every key under `prefixes` with its PTTL
/// (ms; -1 without expiry).
async fn keys_with_ttl(url: &str, patterns: &[String]) -> Result<Vec<(String, i64)>, String> {
    let mut c = crate::redis_conn::connect(url, Duration::from_secs(5)).await?;
    let mut out = Vec::new();
    for pat in patterns {
        for k in crate::redis_conn::scan(&mut c, pat).await? {
            let ttl: i64 =
                redis::cmd("PTTL").arg(&k).query_async(&mut c).await.map_err(|e| format!("PTTL {k}: {e}"))?;
            // -2: gone between SCAN and PTTL.
            if ttl != -2 {
                out.push((k, ttl));
            }
        }
    }
    Ok(out)
}

/// The kind of a legacy key: the suffix after its quota prefix up to the
/// first `:` (`k`, `cons`, `inc`, ...), or `agents` for the legacy agent set.
fn kind(prefixes: &[String], key: &str) -> String {
    match prefixes.iter().find_map(|p| key.strip_prefix(p.as_str())) {
        Some(rest) => rest.split(':').next().unwrap_or(rest).to_string(),
        None => "agents".into(),
    }
}

/// Legacy key kinds the new agents sweep (counters cut and reported,
/// outboxes sent, expired leases retired; `regional-agent/src/legacy.rs`):
/// none may be left once the sweep ran.
const SWEPT: &[&str] = &["cons", "fbr", "shr", "dirty", "ob", "idx", "live", "nb"];
/// How long after the last legacy agent stopped the new agents may take
/// to sweep them: its leases live until their window ends (a lease of the
/// next window, two windows), then the next outbox round retires them;
/// counters are cut at every round (200 ms).
fn sweep_deadline(p: &Profile) -> Duration {
    p.windows(3.0)
}

const DAY_MS: i64 = 86_400_000;
/// How long a finished lease book is kept (`lua/prelude.lua`).
const BOOK_KEEP_MS: i64 = 600_000;

/// The stated life (ms, from the last write) of the other legacy key kinds,
/// from the agent's key lifecycle (`regional-agent/src/lib.rs`, "Key
/// lifecycle", and the scripts that set them); `None`: no stated life.
fn stated_life_ms(kind: &str, p: &Profile) -> Option<i64> {
    let w = p.window_secs * 1000;
    match kind {
        // A per-key bucket: until it would be full again plus a minute
        // (lua/spend.lua).
        "k" => Some((PK_BURST as f64 / PK_RATE * 1000.0).ceil() as i64 + 60_000),
        // The fallback allowance counter: its window plus a minute.
        "fb" => Some(w + 60_000),
        // The renew lock and the "pool empty" mark: seconds.
        "lock" | "exh" => Some(w),
        // Lease books: "counters and books: a week" (lib.rs); a finished
        // book ten minutes (BOOK_KEEP_MS).
        "l" => Some(7 * DAY_MS + w),
        // Epoch fences: two days.
        "fence" => Some(2 * DAY_MS),
        // The quota's incarnation, cached policy, server stamp, clock
        // offset, demand and pool room, and the legacy agent set: the
        // counters' week (plus the room key's window).
        "inc" | "pol" | "srv" | "clk" | "dem" | "room" | "agents" => Some(7 * DAY_MS + w),
        _ => None,
    }
}

/// How often an agent that does not renew a quota re-reads its policy
/// cached in Redis (`regional-agent/src/quotas.rs`, `POLICY_REREAD`).
const POLICY_REREAD: Duration = Duration::from_secs(5);

/// Slack on a per-key allowance for the answer latency: a request sent
/// inside a phase is decided a little later on Redis' clock, where the
/// bucket has refilled that much more.
const LATENCY_SLACK_S: f64 = 1.0;

pub async fn key_namespace_shadow(p: &Profile, bins: Bins) -> Result<ScenarioReport, String> {
    let spec = StackSpec {
        regions: vec![("eu".into(), AGENTS)],
        allocators: 1,
        agent_env: vec![("AGENT_KEY_LAYOUT".into(), "legacy".into())],
        sentinel_regions: Vec::new(),
        patroni: None,
    };
    let mut run = Run::start("key-namespace-shadow", p, bins, Some(spec), false).await?;
    crate::pools::put_policy(&run.stack.admin, TENANT, KEYED, &keyed_policy(p, false)).await?;
    let ns = run.stack.region("eu").redis.prefix.clone();
    let redis_url = run.stack.region("eu").redis.url.clone();
    // The two layouts' quota prefixes (regional-agent/src/keys.rs).
    let lp = |s: &str| format!("{}:{s}", s.len());
    let legacy_prefix = |r: &str| format!("{ns}q:{{{}/{}}}:", lp(TENANT), lp(r));
    let tenant_prefix = |r: &str| format!("{ns}q:{{{}}}:{}:", lp(TENANT), lp(r));
    let legacy_prefixes = [legacy_prefix(RESOURCE), legacy_prefix(KEYED)];
    let legacy_patterns: Vec<String> = legacy_prefixes
        .iter()
        .map(|p| crate::redis_conn::under(p))
        .chain([format!("{ns}r:{{{}}}:agents", lp("eu"))])
        .collect();

    let t0 = chrono::Utc::now().timestamp_millis();
    run.traffic(&[("eu", EU)]);
    let urls = run.stack.region("eu").agents.iter().map(|a| a.base.clone()).collect();
    let keyed = Keyed::start(urls);
    run.note(format!(
        "eu: {AGENTS} agents of the legacy key layout; {KEYS} keys at {KEY_RATE}/s each, round robin over them, on {TENANT}/{KEYED} with per_key {{rate_per_sec: {PK_RATE}, burst: {PK_BURST}}} in shadow mode; {TENANT}/{RESOURCE} at {EU} of G"
    ));
    run.pass(1.5).await;
    let legacy_until = chrono::Utc::now().timestamp_millis();
    let buckets = |prefix: String| crate::redis_conn::under(&format!("{prefix}k:"));
    let seen =
        keys_with_ttl(&redis_url, &[buckets(legacy_prefix(KEYED)), buckets(tenant_prefix(KEYED))]).await?;
    let in_legacy = seen.iter().filter(|(k, _)| k.starts_with(&legacy_prefix(KEYED))).count();
    run.check(
        in_legacy == KEYS && in_legacy == seen.len(),
        format!(
            "before the roll every key's bucket is in the legacy layout: {in_legacy} of {} buckets",
            seen.len()
        ),
    );

    // The roll: each agent stopped (SIGTERM) and started again with the
    // tenant layout under traffic, the next one most of a window later.
    let mut wrongtype = 0usize;
    let (mut mixed_from, mut mixed_to) = (0i64, 0i64);
    let mut rolled = 0usize;
    for i in 0..AGENTS {
        let agent = &mut run.stack.region_mut("eu").agents[i];
        // The log of its legacy run (a restart starts a new one).
        wrongtype += agent.log().matches("WRONGTYPE").count();
        let old = agent.epoch().await;
        agent.opts.env.retain(|(k, _)| k != "AGENT_KEY_LAYOUT");
        agent.opts.env.push(("AGENT_KEY_LAYOUT".into(), "tenant".into()));
        agent.stop(libc::SIGTERM);
        if i == AGENTS - 1 {
            mixed_to = chrono::Utc::now().timestamp_millis();
        }
        keyed.tenant[i].store(true, Ordering::SeqCst);
        let new = agent.start().await;
        if i == 0 {
            mixed_from = chrono::Utc::now().timestamp_millis();
        }
        rolled += usize::from(new > old);
        run.note(format!("eu-{} restarted with the tenant layout: epoch {old} -> {new}", i + 1));
        run.pass(0.75).await;
    }
    let tenant_from = chrono::Utc::now().timestamp_millis();
    run.figure("agents_rolled", rolled as f64);
    let mut c = crate::redis_conn::connect(&redis_url, Duration::from_secs(5)).await?;
    let tenant_set: Vec<String> = redis::cmd("SMEMBERS")
        .arg(format!("{ns}r:{{{}}}:agents:2", lp("eu")))
        .query_async(&mut c)
        .await
        .map_err(|e| format!("SMEMBERS: {e}"))?;
    run.check(
        rolled == AGENTS && (1..=AGENTS).all(|i| tenant_set.contains(&format!("eu-{i}"))),
        format!("{rolled} of {AGENTS} agents restarted with a new epoch; the tenant layout's agent set lists {tenant_set:?}"),
    );

    // One window on the tenant layout alone, then enforcement switched on
    // through the control plane.
    run.pass(1.0).await;
    let switch_ms = chrono::Utc::now().timestamp_millis();
    crate::pools::put_policy(&run.stack.admin, TENANT, KEYED, &keyed_policy(p, true)).await?;
    run.note("per-key enforcement switched on by a policy PUT (enforce: true), no deploy");
    // Every agent must enforce within the stated propagation: the agent
    // that renews learns the version from its next grant (within a window),
    // the others re-read the policy cached in Redis every 5 s
    // (`regional-agent/src/quotas.rs` POLICY_REREAD).
    let propagation = p.windows(1.0) + POLICY_REREAD;
    let enforcing = quota_tests::wait::poll(propagation, Duration::from_millis(100), || {
        let a = keyed.answers();
        async move {
            let mut at = vec![None; AGENTS];
            for x in a.iter().filter(|x| x.per_key && x.sent_ms >= switch_ms) {
                let t: &mut Option<i64> = &mut at[x.agent];
                *t = Some(t.map_or(x.sent_ms, |t: i64| t.min(x.sent_ms)));
            }
            let all: Option<Vec<i64>> = at.iter().copied().collect();
            all.ok_or(at)
        }
    })
    .await;
    // Most of a window more on the enforced policy alone.
    run.pass(0.75).await;
    let keyed_answers = keyed.stop().await;
    let end_ms = chrono::Utc::now().timestamp_millis();

    // Shadow decisions by layout: the share of the decisions (200s) that
    // an enforced policy would have refused, over the whole shadow period
    // and in the phases with one layout only.
    let shadow_period: Vec<&KeyedAnswer> = keyed_answers.iter().filter(|a| a.sent_ms < switch_ms).collect();
    let (legacy_share, legacy_n) = shadow_share(shadow_period.iter().copied().filter(|a| !a.tenant));
    let (tenant_share, tenant_n) = shadow_share(shadow_period.iter().copied().filter(|a| a.tenant));
    run.figure("shadow_refusal_share_legacy", legacy_share);
    run.figure("shadow_refusal_share_tenant", tenant_share);
    let mixed = |t: bool| {
        shadow_share(
            shadow_period
                .iter()
                .copied()
                .filter(|a| a.tenant == t && a.sent_ms >= mixed_from && a.sent_ms < mixed_to),
        )
    };
    let ((ml, _), (mt, _)) = (mixed(false), mixed(true));
    let (lo, _) = shadow_share(shadow_period.iter().copied().filter(|a| a.sent_ms < legacy_until));
    let (to, _) = shadow_share(shadow_period.iter().copied().filter(|a| a.sent_ms >= tenant_from));
    run.note(format!(
        "shadow refusal share: legacy agents {legacy_share:.3} of {legacy_n} decisions, tenant agents {tenant_share:.3} of {tenant_n}; legacy only {lo:.3}, mixed legacy {ml:.3} / tenant {mt:.3}, tenant only {to:.3}"
    ));
    run.check(
        legacy_share > 0.0 && tenant_share > 0.0,
        "both layouts decided the per-key policy in shadow mode (refusals counted, answered 200)",
    );

    // Per key, what the shadow policy would have allowed: in a phase with
    // one layout at most one bucket's burst and refill; in the mixed
    // period up to two buckets' (F34's 2x).
    let slack = PK_RATE * LATENCY_SLACK_S;
    for (what, from, to) in [("legacy only", t0, legacy_until), ("tenant only", tenant_from, end_ms)] {
        let per = allowed_per_key(&keyed_answers, from, to);
        let one = one_bucket(to - from);
        let most = per.iter().copied().max().unwrap_or(0);
        run.check(
            most as f64 <= one + slack,
            format!(
                "{what} ({:.1} s): allowed per key {per:?} <= one bucket's {one:.1} (+{slack} for latency)",
                (to - from) as f64 / 1000.0
            ),
        );
    }
    let per = allowed_per_key(&keyed_answers, mixed_from, mixed_to);
    let one = one_bucket(mixed_to - mixed_from);
    let most = per.iter().copied().max().unwrap_or(0);
    let ratio = most as f64 / one;
    run.figure("per_key_admits_max_ratio_mixed", ratio);
    // F34's bound, two buckets, with the latency slack the check allows.
    run.figure("per_key_admits_max_ratio_bound", (2.0 * one + slack) / one);
    run.check(
        most as f64 > one + slack && most as f64 <= 2.0 * one + slack,
        format!(
            "mixed period ({:.1} s): allowed per key {per:?}, {ratio:.2}x one bucket's {one:.1}: more than one layout allows (separate buckets), within two (+{slack} for latency)",
            (mixed_to - mixed_from) as f64 / 1000.0
        ),
    );
    run.note(format!(
        "docs/deploying.md says a user may get up to one more burst ({PK_BURST}) in the region; during the mixed period a key got {:.1} beyond one bucket",
        most as f64 - one
    ));

    // Enforcement through the control plane.
    let enforced: Vec<&KeyedAnswer> =
        keyed_answers.iter().filter(|a| a.per_key && a.sent_ms >= switch_ms).collect();
    run.figure("enforced_refusals_after_switch", enforced.len() as f64);
    match enforcing {
        Ok(at) => {
            let last = at.iter().copied().max().unwrap_or(switch_ms);
            run.figure("enforce_switch_s", (last - switch_ms) as f64 / 1000.0);
            let secs: Vec<String> = at.iter().map(|t| format!("{:.2}", (t - switch_ms) as f64 / 1000.0)).collect();
            // Once an agent enforced, it never decides in shadow mode again
            // (it never goes back to an older policy version).
            let back: usize = at
                .iter()
                .enumerate()
                .map(|(i, t)| keyed_answers.iter().filter(|a| a.agent == i && a.shadow && a.sent_ms > *t).count())
                .sum();
            run.check(
                back == 0,
                format!(
                    "{} enforced per-key refusals (429 per_key) after the PUT; each agent's first {secs:?} s after it (bound {:.0} s); shadow refusals after an agent's first enforced one: {back}",
                    enforced.len(),
                    propagation.as_secs_f64()
                ),
            );
        }
        Err(at) => run.check(
            false,
            format!(
                "not every agent enforced within {:.0} s of the PUT: first enforced refusal per agent (Unix ms) {at:?}; {} in all",
                propagation.as_secs_f64(),
                enforced.len()
            ),
        ),
    }

    // No 5xx, no wrong-type error at any point.
    let main_5xx = run.answers("eu", t0).iter().filter(|a| a.status >= 500).count();
    let keyed_5xx = keyed_answers.iter().filter(|a| a.status >= 500).count();
    let unanswered = keyed_answers.iter().filter(|a| a.status == 0 && !a.down).count();
    let down = keyed_answers.iter().filter(|a| a.down).count();
    run.figure("errors_5xx", (main_5xx + keyed_5xx) as f64);
    for a in &run.stack.region("eu").agents {
        wrongtype += a.log().matches("WRONGTYPE").count();
    }
    run.check(
        main_5xx + keyed_5xx == 0,
        format!(
            "no 5xx during the roll: main quota {main_5xx}, keyed {keyed_5xx} (keyed: {down} sent to an agent that was down, {unanswered} unanswered)"
        ),
    );
    run.check(wrongtype == 0, format!("WRONGTYPE in the agents' logs (both layouts): {wrongtype}"));

    // The allocator counts every keyed decision of both layouts: the
    // legacy layout's counters were cut and reported.
    let shadow_n = keyed_answers.iter().filter(|a| a.shadow).count() as i64;
    let allowed_n = keyed_answers.iter().filter(|a| a.allowed()).count() as i64;
    let ws = |ms: i64| ms.div_euclid(p.window_secs * 1000) * p.window_secs;
    let (from, to) = (ws(t0), ws(end_ms) + p.window_secs);
    let admin = run.stack.admin.clone();
    let counted = quota_tests::wait::poll(SETTLE, Duration::from_millis(250), || {
        let admin = admin.clone();
        async move {
            let acc =
                crate::accounts::windows(&admin, TENANT, KEYED, from, to).await.map_err(|e| (e, 0, 0))?;
            let sh: i64 = acc.values().map(|w| w.shadow_refused).sum();
            let ad: i64 = acc.values().map(|w| w.admitted).sum();
            let slack = unanswered as i64;
            let fits = |n: i64, clients: i64| clients <= n && n <= clients + slack;
            if fits(sh, shadow_n) && fits(ad, allowed_n) {
                Ok((sh, ad))
            } else {
                Err((String::new(), sh, ad))
            }
        }
    })
    .await;
    match counted {
        Ok((sh, ad)) => run.check(
            true,
            format!("the allocator counts {sh} shadow refusals and {ad} admits of {TENANT}/{KEYED}, as the clients saw (+{unanswered} unanswered)"),
        ),
        Err((e, sh, ad)) => run.check(
            false,
            format!("the allocator counts {sh} shadow refusals and {ad} admits of {TENANT}/{KEYED}; the clients saw {shadow_n} and {allowed_n} (+{unanswered} unanswered) {e}"),
        ),
    }

    // The legacy layout's keys: the swept kinds gone, every other key
    // expiring within its stated life.
    let since_stop = |ms: i64| (ms - mixed_to) as f64 / 1000.0;
    let deadline = Duration::from_millis(
        (mixed_to + sweep_deadline(p).as_millis() as i64 - chrono::Utc::now().timestamp_millis()).max(0)
            as u64,
    );
    let left = quota_tests::wait::poll(deadline, Duration::from_millis(250), || {
        let (url, pats, prefixes) = (redis_url.clone(), legacy_patterns.clone(), legacy_prefixes.clone());
        async move {
            let keys = keys_with_ttl(&url, &pats).await.map_err(|e| (e, Vec::new()))?;
            if keys.iter().any(|(k, _)| SWEPT.contains(&kind(&prefixes, k).as_str())) {
                Err((String::new(), keys))
            } else {
                Ok(keys)
            }
        }
    })
    .await;
    let scanned_ms = chrono::Utc::now().timestamp_millis();
    let (keys, swept) = match left {
        Ok(k) => (k, true),
        Err((e, k)) if e.is_empty() => (k, false),
        Err((e, _)) => return Err(e),
    };
    let mut by_kind: BTreeMap<String, (usize, i64)> = BTreeMap::new();
    for (k, ttl) in &keys {
        let e = by_kind.entry(kind(&legacy_prefixes, k)).or_insert((0, i64::MIN));
        e.0 += 1;
        e.1 = e.1.max(*ttl);
    }
    let listed = by_kind
        .iter()
        .map(|(k, (n, ttl))| format!("{k} {n} (ttl {:.0} s)", *ttl as f64 / 1000.0))
        .collect::<Vec<_>>()
        .join(", ");
    run.note(format!(
        "legacy keys {:.1} s after the last legacy agent stopped: {listed}",
        since_stop(scanned_ms)
    ));
    let stray: Vec<&String> = by_kind.keys().filter(|k| SWEPT.contains(&k.as_str())).collect();
    run.check(
        swept,
        format!("the legacy layout's counters, outboxes and leases swept by the new agents: left {stray:?}"),
    );
    // Each key's TTL within its kind's stated life (-1: no expiry), and
    // when the last one goes, counted from the last legacy agent's stop.
    let mut late: BTreeMap<String, i64> = BTreeMap::new();
    let mut gone_at_ms = 0i64;
    let mut state_gone_at_ms = 0i64;
    for (k, ttl) in &keys {
        let kd = kind(&legacy_prefixes, k);
        let expires = if *ttl < 0 { i64::MAX } else { scanned_ms - mixed_to + ttl };
        gone_at_ms = gone_at_ms.max(expires);
        if kd == "k" || kd == "fb" {
            state_gone_at_ms = state_gone_at_ms.max(expires);
        }
        match stated_life_ms(&kd, p) {
            Some(life) if (0..=life).contains(ttl) => {}
            // The kind's longest TTL beyond its life, or without one.
            _ => {
                let e = late.entry(kd).or_insert(*ttl);
                *e = (*e).max(*ttl);
            }
        }
    }
    // Finished lease books are kept ten minutes (lua/prelude.lua
    // BOOK_KEEP_MS); one kept longer is named with its fields.
    let mut c = crate::redis_conn::connect(&redis_url, Duration::from_secs(5)).await?;
    for (k, ttl) in keys.iter().filter(|(k, t)| kind(&legacy_prefixes, k) == "l" && *t > BOOK_KEEP_MS) {
        let h: Vec<String> = redis::cmd("HGETALL").arg(k).query_async(&mut c).await.unwrap_or_default();
        run.note(format!(
            "legacy lease book kept longer than a finished one's ten minutes: {k} ttl {ttl} ms {h:?}"
        ));
    }
    run.figure("legacy_keys_left", keys.len() as f64);
    run.figure("legacy_keys_gone_s", gone_at_ms as f64 / 1000.0);
    run.figure("legacy_decision_state_gone_s", state_gone_at_ms as f64 / 1000.0);
    run.check(
        late.is_empty(),
        format!(
            "every legacy key expires within its kind's stated life: the last {:.0} s, buckets and fallback counters {:.0} s after the last legacy agent stopped; beyond their kind's life or without one (kind: ttl ms): {late:?}",
            gone_at_ms as f64 / 1000.0,
            state_gone_at_ms as f64 / 1000.0
        ),
    );
    run.finish().await
}
