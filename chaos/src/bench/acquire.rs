//! Agent decisions (`POST /v1/acquire`) at 1, 16 and 64 keep-alive clients,
//! each repetition measured next to three references on the same Redis at
//! the same concurrency:
//!
//! * the ceiling: the agent's own spend script, called through the agent's
//!   script layer (`regional_agent::scripts::spend`: the same prelude +
//!   `spend.lua`, the same arguments) on the agent's own quota keys, over
//!   the agent's own kind of store (one multiplexed connection);
//! * the HTTP floor: `GET /healthz` of the same agent, which touches no
//!   Redis, so `decision ≈ floor + script` says where the time goes;
//! * the peer: `limitador` with its async Redis storage and one counter
//!   limit of the same size (`check_rate_limited_and_update`), in the
//!   `limitador-peer` process ([`super::peer`]).
//!
//! Beside them, Envoy's rate limit service on the same agent
//! (`--grpc-listen`): `ShouldRateLimit` with one descriptor naming the same
//! quota, over one HTTP/2 connection with one stream per client, as Envoy
//! calls it (`rls.c{1,16,64}.*`; the client is [`super::h2_client`], for
//! the reason given there).
//!
//! Interleaving the four per repetition keeps the machine's background load
//! (two other engineers' builds) roughly equal across what a ratio compares.

use super::h2_client::{self, H2};
use super::hist::{closed_loop, Medians, Op, Sample};
use super::peer::Peer;
use super::rig::Rig;
use super::{Plan, Results};
use crate::redis_conn;
use futures::FutureExt;
use quota_tests::redis::TestRedis;
use redis::aio::MultiplexedConnection;
use regional_agent::client::TlsFiles;
use regional_agent::keys::Keys;
use regional_agent::scripts::{self, Ask, Caller, Common, On, Outcome, Part, Spend};
use regional_agent::store::Store;
use serde_json::json;
use std::sync::Arc;
use std::time::Duration;

const TENANT: &str = "bench";
const RESOURCE: &str = "read";
/// The same quota with a per-key bucket (issue 17): one bucket per client,
/// sized so that it never refuses, so the figure is the bucket's cost.
const RESOURCE_PER_KEY: &str = "read-per-key";
/// A second quota of the tenant with a per-key bucket: the two-quota
/// decision spends both and both buckets in one script run.
const RESOURCE2_PER_KEY: &str = "write-per-key";
/// Clients of the per-key comparison.
pub const PER_KEY_CLIENTS: usize = 16;
/// Large enough that no measurement can run the pool dry.
const LIMIT: i64 = 1_000_000_000;
const WINDOW_SECS: i64 = 86_400;
/// Every network call of a measured operation gives up after this long.
const CALL_TIMEOUT: Duration = Duration::from_secs(5);
/// Envoy's rate limit method, as its filter calls it.
const SHOULD_RATE_LIMIT: &str = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";
/// Concurrencies measured.
pub const CLIENTS: [usize; 3] = [1, 16, 64];

/// The bench's HTTP client: keep-alive connections (up to 128 idle per
/// agent, more than any concurrency measured), every call bounded.
pub(super) fn client(timeout: Duration) -> Result<reqwest::Client, String> {
    quota_tests::http::client_builder()
        .timeout(timeout)
        .pool_max_idle_per_host(128)
        .build()
        .map_err(|e| format!("http client: {e}"))
}

/// Runs `op` from 4 clients for half a second, so the agent learns the
/// policies and credits a first lease before anything is measured; `who`
/// (the agent) never admitting is an error.
pub(super) async fn warm_up(who: &str, op: Op) -> Result<(), String> {
    let warm = closed_loop(4, Duration::from_millis(500), op).await?;
    if warm.ok == 0 {
        return Err(format!("{who} never admitted during warm-up: {:?}", warm.first_error));
    }
    Ok(())
}

/// Done when the call answered 200; its body is read, so the connection
/// goes back to the pool for the next call.
async fn answered_200(what: &str, sent: reqwest::Result<reqwest::Response>) -> Result<(), String> {
    let r = sent.map_err(|e| format!("{what}: {e}"))?;
    let status = r.status().as_u16();
    let _ = r.bytes().await;
    if status == 200 {
        Ok(())
    } else {
        Err(format!("{what} answered {status}"))
    }
}

fn acquire_op(client: reqwest::Client, base: &str) -> Op {
    acquire_op_for(client, base, &[RESOURCE], false)
}

/// `POST /v1/acquire` on `resources` (one: the `resource` form; several:
/// one decision over all of them); with `per_key`, client `i` names the
/// key `user-<i>`.
pub(super) fn acquire_op_for(client: reqwest::Client, base: &str, resources: &[&str], per_key: bool) -> Op {
    let url = format!("{base}/v1/acquire");
    let bodies: Arc<Vec<Vec<u8>>> = Arc::new(
        (0..if per_key { 64 } else { 1 })
            .map(|i| {
                let mut b = match resources {
                    [one] => json!({"tenant": TENANT, "resource": one}),
                    many => json!({"tenant": TENANT, "resources":
                        many.iter().map(|r| json!({"resource": r})).collect::<Vec<_>>()}),
                };
                if per_key {
                    b["key"] = json!(format!("user-{i}"));
                }
                b.to_string().into_bytes()
            })
            .collect(),
    );
    Arc::new(move |i, _| {
        let body = bodies[i % bodies.len()].clone();
        let (client, url) = (client.clone(), url.clone());
        async move {
            let sent = client.post(&url).header("content-type", "application/json").body(body).send().await;
            answered_200("acquire", sent).await
        }
        .boxed()
    })
}

fn healthz_op(client: reqwest::Client, base: &str) -> Op {
    let url = format!("{base}/healthz");
    Arc::new(move |_, _| {
        let (client, url) = (client.clone(), url.clone());
        async move { answered_200("healthz", client.get(&url).send().await).await }.boxed()
    })
}

/// The arguments `spend.rs` passes, for the agent's own quota and incarnation.
#[derive(Clone)]
struct SpendArgs {
    prefix: String,
    token: String,
    fallback: i64,
    agent: String,
    epoch: i64,
}

fn spend_op(store: Store, a: SpendArgs) -> Op {
    let a = Arc::new(a);
    Arc::new(move |_, _| {
        let (store, a) = (store.clone(), a.clone());
        async move {
            let common = Common {
                legacy_until_ms: 0,
                fallback: false,
                window_secs: WINDOW_SECS,
                allowance: a.fallback,
                rid_ttl_ms: WINDOW_SECS * 1000,
                per_key: None,
                legacy_fallback: None,
            };
            // One request per run: the script as one client's decision costs.
            let ask = Ask {
                costs: vec![1],
                rid: String::new(),
                count_demand: true,
                key: String::new(),
                held: vec![0],
            };
            let on = On { prefix: &a.prefix, token: &a.token };
            let by = Caller { agent: &a.agent, epoch: a.epoch };
            // The store bounds the call by its timeout (CALL_TIMEOUT).
            let r = scripts::spend(&store, by, &[Part { on, common }], &[ask])
                .await
                .map_err(|e| format!("spend script: {e}"))?;
            match r {
                Outcome::Ran { value, .. }
                    if matches!(value.decisions.first(), Some(Spend::Admit(a))
                        if a.first().is_some_and(|a| a.source == "lease")) =>
                {
                    Ok(())
                }
                other => Err(format!("spend script answered {other:?}")),
            }
        }
        .boxed()
    })
}

/// `grpc.health.v1.Health/Check` of the RLS service over the same
/// connection: the gRPC floor (transport and framing, no decision), as
/// `GET /healthz` is HTTP's.
fn grpc_floor_op(conn: H2) -> Op {
    use tonic_health::pb::HealthCheckRequest;
    let body = h2_client::frame(&HealthCheckRequest { service: regional_agent::rls::SERVICE_NAME.into() });
    Arc::new(move |_, _| {
        let (conn, body) = (conn.clone(), body.clone());
        async move {
            tokio::time::timeout(CALL_TIMEOUT, conn.unary("/grpc.health.v1.Health/Check", body))
                .await
                .map_err(|_| "Health/Check timed out".to_string())?
                .map(|_| ())
        }
        .boxed()
    })
}

/// `ShouldRateLimit` for one descriptor naming the bench quota; the
/// answer is decoded and must be `OK`.
fn rls_op(conn: H2) -> Op {
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::{
        rate_limit_descriptor::Entry, RateLimitDescriptor,
    };
    use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
    use prost::Message;
    let req = RateLimitRequest {
        domain: TENANT.into(),
        descriptors: vec![RateLimitDescriptor {
            entries: vec![Entry { key: "resource".into(), value: RESOURCE.into() }],
            ..Default::default()
        }],
        hits_addend: 1,
    };
    let body = h2_client::frame(&req);
    Arc::new(move |_, _| {
        let (conn, body) = (conn.clone(), body.clone());
        async move {
            let got = tokio::time::timeout(CALL_TIMEOUT, conn.unary(SHOULD_RATE_LIMIT, body))
                .await
                .map_err(|_| "ShouldRateLimit timed out".to_string())??;
            let r = RateLimitResponse::decode(got).map_err(|e| format!("ShouldRateLimit: {e}"))?;
            match r.overall_code {
                1 => Ok(()),
                code => Err(format!("ShouldRateLimit answered code {code}")),
            }
        }
        .boxed()
    })
}

/// Runs the acquire measurements on `rig` with a Redis of their own.
pub async fn run(rig: &Rig, plan: &Plan, out: &mut Results, progress: &dyn Fn(&str)) -> Result<(), String> {
    let redis = TestRedis::start();
    crate::pools::put_limit(&rig.admin, TENANT, RESOURCE, LIMIT, WINDOW_SECS).await?;
    // The largest rate and burst a policy takes: a bucket that never refuses.
    let max = quota_shared::wire::PerKey::MAX;
    for r in [RESOURCE_PER_KEY, RESOURCE2_PER_KEY] {
        crate::pools::put_policy(
            &rig.admin,
            TENANT,
            r,
            &json!({"limit": LIMIT, "window_secs": WINDOW_SECS, "per_key": {"rate_per_sec": max, "burst": max}}),
        )
        .await?;
    }
    let grpc = format!("127.0.0.1:{}", quota_tests::free_port());
    let agent = rig.agent_as("eu", &redis.url, vec![("AGENT_GRPC_LISTEN".into(), grpc.clone())]).await;
    let agent_pid = agent.pid().ok_or("the bench agent has no process id")?;
    let rls = h2_client::connect(&grpc, CALL_TIMEOUT).await?;
    let http = client(CALL_TIMEOUT)?;
    // Warm: the agent learns the policies and credits a first lease.
    let per_key_op = acquire_op_for(http.clone(), &agent.base, &[RESOURCE_PER_KEY], true);
    let two_op = acquire_op_for(http.clone(), &agent.base, &[RESOURCE_PER_KEY, RESOURCE2_PER_KEY], true);
    for op in [acquire_op(http.clone(), &agent.base), per_key_op.clone(), two_op.clone(), rls_op(rls.clone())]
    {
        warm_up("agent", op).await?;
    }

    let prefix = Keys::new("").quota(TENANT, RESOURCE);
    let conn = redis_conn::connect(&redis.url, CALL_TIMEOUT).await?;
    let token: Option<String> = redis::cmd("GET")
        .arg(Keys::incarnation(&prefix))
        .query_async(&mut conn.clone())
        .await
        .map_err(|e| format!("reading the incarnation key: {e}"))?;
    let token = token.ok_or("the agent's incarnation key is missing after warm-up")?;
    let store =
        Store::connect(std::slice::from_ref(&redis.url), false, None, &TlsFiles::default(), CALL_TIMEOUT)
            .await?;
    let args = SpendArgs {
        prefix: prefix.clone(),
        token,
        fallback: LIMIT / 100,
        agent: "eu-1".into(),
        epoch: agent.epoch().await,
    };
    let peer = match plan.peer_skipped() {
        Some(why) => Err(why),
        None => Peer::ensure(progress),
    };
    if let Err(e) = &peer {
        out.note(format!("limitador peer not measured: {e}"));
    }

    for &c in &CLIENTS {
        let mut agent_s: Vec<Sample> = Vec::new();
        let (mut lua_s, mut floor_s, mut r_ceiling) = (Vec::new(), Vec::new(), Vec::new());
        let (mut lim_s, mut r_peer): (Vec<Sample>, Vec<f64>) = (Vec::new(), Vec::new());
        let mut stages: Vec<Stages> = Vec::new();
        let (mut per_key_s, mut two_s): (Vec<Sample>, Vec<Sample>) = (Vec::new(), Vec::new());
        let (mut rls_s, mut grpc_floor_s): (Vec<Sample>, Vec<Sample>) = (Vec::new(), Vec::new());
        let (mut cpu_http, mut cpu_rls): (Vec<f64>, Vec<f64>) = (Vec::new(), Vec::new());
        let mut rls_per_run: Vec<f64> = Vec::new();
        for rep in 0..plan.reps {
            progress(&format!("acquire: {c} client(s), repetition {}/{}", rep + 1, plan.reps));
            let before = StageSums::read(&http, &agent.base).await?;
            let cpu0 = super::machine::cpu_us(agent_pid);
            let a = closed_loop(c, plan.acquire, acquire_op(http.clone(), &agent.base)).await?;
            if let (Some(b), Some(e)) = (cpu0, super::machine::cpu_us(agent_pid)) {
                cpu_http.push((e - b) / a.ok.max(1) as f64);
            }
            let stage = StageSums::read(&http, &agent.base).await?.since(&before, a.mean_ms);
            stages.push(stage);
            let l = closed_loop(c, plan.acquire, spend_op(store.clone(), args.clone())).await?;
            let f = closed_loop(c, plan.acquire, healthz_op(http.clone(), &agent.base)).await?;
            let runs0 = StageSums::read(&http, &agent.base).await?.runs;
            let cpu0 = super::machine::cpu_us(agent_pid);
            let g = closed_loop(c, plan.acquire, rls_op(rls.clone())).await?;
            if let (Some(b), Some(e)) = (cpu0, super::machine::cpu_us(agent_pid)) {
                cpu_rls.push((e - b) / g.ok.max(1) as f64);
            }
            let runs = StageSums::read(&http, &agent.base).await?.runs - runs0;
            rls_per_run.push(g.ok as f64 / runs.max(1.0));
            rls_s.push(g);
            grpc_floor_s.push(closed_loop(c, plan.acquire, grpc_floor_op(rls.clone())).await?);
            if c == PER_KEY_CLIENTS {
                per_key_s.push(closed_loop(c, plan.acquire, per_key_op.clone()).await?);
                two_s.push(closed_loop(c, plan.acquire, two_op.clone()).await?);
            }
            r_ceiling.push(a.per_s / l.per_s.max(f64::MIN_POSITIVE));
            if let Ok(p) = &peer {
                let m = p.measure(&redis.url, c, plan.acquire).await?;
                r_peer.push(a.per_s / m.per_s.max(f64::MIN_POSITIVE));
                lim_s.push(m);
            }
            agent_s.push(a);
            lua_s.push(l);
            floor_s.push(f);
        }
        let (a, l, f) = (Medians::of(&agent_s), Medians::of(&lua_s), Medians::of(&floor_s));
        let k = |s: &str| format!("acquire.c{c}.{s}");
        out.set(&k("decisions_per_s"), a.per_s);
        out.set(&k("p50_ms"), a.p50_ms);
        out.set(&k("p99_ms"), a.p99_ms);
        out.set(&k("p999_ms"), a.p999_ms);
        out.set(&k("ceiling_per_s"), l.per_s);
        out.set(&k("ceiling_p50_ms"), l.p50_ms);
        out.set(&k("ceiling_p99_ms"), l.p99_ms);
        out.set(&k("ratio_to_ceiling"), super::hist::median(&r_ceiling));
        out.set(&k("http_floor_per_s"), f.per_s);
        out.set(&k("http_floor_p50_ms"), f.p50_ms);
        out.set(&k("http_floor_p99_ms"), f.p99_ms);
        let med = |g: fn(&Stages) -> f64| super::hist::median(&stages.iter().map(g).collect::<Vec<_>>());
        out.set(&k("stage.client_and_http_us"), med(|s| s.client_and_http_us));
        out.set(&k("stage.agent_us"), med(|s| s.agent_us));
        out.set(&k("stage.redis_us"), med(|s| s.redis_us));
        out.set(&k("decisions_per_script_run"), med(|s| s.decisions_per_run));
        for (what, m) in [("agent", &a), ("spend script", &l), ("healthz", &f)] {
            if m.errors > 0 {
                out.note(format!("acquire c{c}: {} {what} errors, first: {:?}", m.errors, m.first_error));
            }
        }
        for (what, samples) in [("per_key", &per_key_s), ("two_quotas_per_key", &two_s)] {
            if !samples.is_empty() {
                let label = format!("acquire c{c} {what}");
                Medians::of(samples).put(out, &k(what), "decisions_per_s", &label);
            }
        }
        Medians::of(&rls_s).put(out, &format!("rls.c{c}"), "decisions_per_s", &format!("rls c{c}"));
        out.set(&k("agent_cpu_us_per_decision"), super::hist::median(&cpu_http));
        out.set(&format!("rls.c{c}.agent_cpu_us_per_decision"), super::hist::median(&cpu_rls));
        out.set(&format!("rls.c{c}.decisions_per_script_run"), super::hist::median(&rls_per_run));
        let floor = Medians::of(&grpc_floor_s);
        floor.put(out, &format!("rls.c{c}.grpc_floor"), "per_s", &format!("grpc floor c{c}"));
        if !lim_s.is_empty() {
            let m = Medians::of(&lim_s);
            out.set(&k("limitador_per_s"), m.per_s);
            out.set(&k("limitador_p99_ms"), m.p99_ms);
            out.set(&k("ratio_to_limitador"), super::hist::median(&r_peer));
        }
    }

    let other = super::flood::Other {
        op: acquire_op(http.clone(), &agent.base),
        name: format!("{TENANT}/{RESOURCE}"),
    };
    super::flood::run(rig, plan, &http, &agent.base, other, out, progress).await?;
    agent_memory_per_quota(rig, plan, &agent, &http, out, progress).await?;

    progress("scaling: Redis memory of one quota");
    let keys = quota_memory(&mut conn.clone(), &prefix).await?;
    out.set("scaling.redis_bytes_per_quota", keys.iter().map(|(_, n)| *n as f64).sum());
    let parts: Vec<String> = keys.iter().map(|(k, n)| format!("{k} {n} B")).collect();
    out.note(format!("Redis keys of the bench quota after the acquire runs: {}", parts.join(", ")));
    Ok(())
}

/// Quotas the agent is made to hold for the memory figure (fewer in a smoke run).
fn memory_quotas(plan: &Plan) -> usize {
    if plan.mode == "smoke" {
        50
    } else {
        1_000
    }
}

/// The agent's memory per known quota (issue 14: no fixed cap on known
/// quotas, so the cost of each is measured): RSS before and after the agent
/// learns `n` more quotas (one policy and one admit each), divided by `n`,
/// beside the `agent_quotas` gauge that says how many it holds.
async fn agent_memory_per_quota(
    rig: &Rig,
    plan: &Plan,
    agent: &quota_tests::agent::AgentProc,
    http: &reqwest::Client,
    out: &mut Results,
    progress: &dyn Fn(&str),
) -> Result<(), String> {
    let n = memory_quotas(plan);
    progress(&format!("scaling: agent memory with {n} more quotas"));
    let pid = agent.pid().ok_or("the bench agent is not running")?;
    let before = super::machine::rss_mb(pid)?;
    for i in 0..n {
        let resource = format!("mem-{i}");
        crate::pools::put_limit(&rig.admin, TENANT, &resource, 1000, 3600).await?;
        let r = http
            .post(format!("{}/v1/acquire", agent.base))
            .json(&json!({"tenant": TENANT, "resource": resource}))
            .send()
            .await
            .map_err(|e| format!("acquire {resource}: {e}"))?;
        if r.status().as_u16() != 200 {
            return Err(format!("acquire {resource} answered {}", r.status()));
        }
    }
    let after = super::machine::rss_mb(pid)?;
    let text = agent_metrics(http, &agent.base).await?;
    let held = quota_tests::http::metric(&text, "agent_quotas").unwrap_or(0.0);
    out.set("scaling.agent_quotas_held", held);
    out.set("scaling.agent_kib_per_quota", ((after - before) * 1024.0 / n as f64).max(0.0));
    out.note(format!(
        "agent RSS {before:.1} MiB → {after:.1} MiB after learning {n} more quotas (agent_quotas = {held})"
    ));
    Ok(())
}

/// Sums of the agent's own latency histograms (`/metrics`): the time inside
/// the handler and, within it, the spend script's Redis round trips.
struct StageSums {
    handler_s: f64,
    handler_n: f64,
    store_s: f64,
    /// Runs of the spend script (one run decides a batch of requests).
    runs: f64,
}

/// Where one decision's time went, as means per decision over one run: the
/// client's mean latency split into what the agent measured itself.
#[derive(Debug, Clone, Copy)]
struct Stages {
    /// Client, loopback, HTTP parsing and writing outside the handler.
    client_and_http_us: f64,
    /// The agent's own work in the handler: JSON, quota lookup, headers.
    agent_us: f64,
    /// Waiting on the spend script: the quota's runs in flight, then its own.
    redis_us: f64,
    /// Decisions per run of the spend script (the batch size).
    decisions_per_run: f64,
}

/// The agent's `/metrics` text.
async fn agent_metrics(http: &reqwest::Client, base: &str) -> Result<String, String> {
    http.get(format!("{base}/metrics"))
        .send()
        .await
        .map_err(|e| format!("agent /metrics: {e}"))?
        .text()
        .await
        .map_err(|e| format!("agent /metrics: {e}"))
}

impl StageSums {
    async fn read(http: &reqwest::Client, base: &str) -> Result<StageSums, String> {
        let text = agent_metrics(http, base).await?;
        let value = |name: &str| {
            quota_tests::http::metric(&text, name).ok_or_else(|| format!("agent /metrics has no {name}"))
        };
        Ok(StageSums {
            handler_s: value("agent_acquire_seconds_sum")?,
            handler_n: value("agent_acquire_seconds_count")?,
            store_s: value("agent_acquire_store_seconds_sum")?,
            runs: value("agent_spend_runs_total")?,
        })
    }

    /// The stages of the decisions made since `before`, whose mean latency
    /// at the client was `client_mean_ms`.
    fn since(&self, before: &StageSums, client_mean_ms: f64) -> Stages {
        let n = (self.handler_n - before.handler_n).max(1.0);
        let handler_us = 1e6 * (self.handler_s - before.handler_s) / n;
        let redis_us = 1e6 * (self.store_s - before.store_s) / n;
        Stages {
            client_and_http_us: client_mean_ms * 1000.0 - handler_us,
            agent_us: handler_us - redis_us,
            redis_us,
            decisions_per_run: n / (self.runs - before.runs).max(1.0),
        }
    }
}

/// `MEMORY USAGE` of every key under `prefix`, by the key's suffix.
async fn quota_memory(conn: &mut MultiplexedConnection, prefix: &str) -> Result<Vec<(String, i64)>, String> {
    let mut sizes = Vec::new();
    for k in redis_conn::scan(conn, &redis_conn::under(prefix)).await? {
        let n: Option<i64> = redis::cmd("MEMORY")
            .arg("USAGE")
            .arg(&k)
            .arg("SAMPLES")
            .arg(0)
            .query_async(conn)
            .await
            .map_err(|e| format!("MEMORY USAGE {k}: {e}"))?;
        sizes.push((k.strip_prefix(prefix).unwrap_or(&k).to_string(), n.unwrap_or(0)));
    }
    sizes.sort();
    Ok(sizes)
}

/// What this part measured at one client count (`acquire.c<n>.*`), read
/// back from a report (see [`super::view`]).
#[derive(Debug, Clone, Copy, Default, serde::Deserialize)]
#[serde(default)]
pub struct Measured {
    pub decisions_per_s: Option<f64>,
    pub p50_ms: Option<f64>,
    pub p99_ms: Option<f64>,
    pub p999_ms: Option<f64>,
    pub ceiling_per_s: Option<f64>,
    pub ceiling_p50_ms: Option<f64>,
    pub ceiling_p99_ms: Option<f64>,
    pub ratio_to_ceiling: Option<f64>,
    pub http_floor_per_s: Option<f64>,
    pub http_floor_p50_ms: Option<f64>,
    pub http_floor_p99_ms: Option<f64>,
    pub limitador_per_s: Option<f64>,
    pub limitador_p99_ms: Option<f64>,
    pub ratio_to_limitador: Option<f64>,
    pub agent_cpu_us_per_decision: Option<f64>,
    pub decisions_per_script_run: Option<f64>,
    pub stage: Stage,
    pub per_key: super::view::Rate,
    pub two_quotas_per_key: super::view::Rate,
}

/// A decision's mean time split by the agent's histograms (`stage.*`).
#[derive(Debug, Clone, Copy, Default, serde::Deserialize)]
#[serde(default)]
pub struct Stage {
    pub client_and_http_us: Option<f64>,
    pub agent_us: Option<f64>,
    pub redis_us: Option<f64>,
}

/// The RLS side of the same run at one stream count (`rls.c<n>.*`).
#[derive(Debug, Clone, Copy, Default, serde::Deserialize)]
#[serde(default)]
pub struct RlsMeasured {
    pub decisions_per_s: Option<f64>,
    pub p50_ms: Option<f64>,
    pub p99_ms: Option<f64>,
    pub grpc_floor: Floor,
    pub agent_cpu_us_per_decision: Option<f64>,
}

/// gRPC `Health/Check` on the agent's port: the floor of an RLS call.
#[derive(Debug, Clone, Copy, Default, serde::Deserialize)]
#[serde(default)]
pub struct Floor {
    pub per_s: Option<f64>,
    pub p99_ms: Option<f64>,
}

impl Measured {
    /// What `r` holds for `c` clients.
    pub fn at(r: &super::report::BenchReport, c: usize) -> Measured {
        super::view::part(r, &format!("acquire.c{c}"))
    }
}

impl RlsMeasured {
    /// What `r` holds for `c` streams.
    pub fn at(r: &super::report::BenchReport, c: usize) -> RlsMeasured {
        super::view::part(r, &format!("rls.c{c}"))
    }
}
