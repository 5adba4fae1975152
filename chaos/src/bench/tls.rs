//! What TLS costs, each figure beside its plain twin in the same run and
//! repetitions interleaved (the machine's background load drifts; two
//! figures taken minutes apart would compare the drift):
//!
//! * agent decisions (`POST /v1/acquire`) at [`CLIENTS`] clients from an
//!   agent whose Redis is reached over `rediss://` (client certificate
//!   required, as in `cargo lab demo --tls`) beside an agent on plain
//!   `redis://`, each with a Redis of its own on the same machine;
//! * allocator grants (`POST /v1/grants`) at [`CLIENTS`] agents over HTTPS
//!   with client certificates (mTLS) beside plain HTTP, two allocators on
//!   one database, one quota per agent (no row lock shared, so the figure
//!   is the link and not lock waits).
//!
//! Which side runs first alternates per repetition. Clients keep their
//! connections alive, as the agent does, so a handshake
//! is paid once per connection; the figures are the steady state's cost of
//! encryption.

use super::hist::{closed_loop, median, Medians, Op, Sample};
use super::rig::Rig;
use super::{Plan, Results};
use crate::tls::LabTls;
use futures::FutureExt;
use quota_tests::allocator_proc::AllocatorProc;
use quota_tests::http::Http;
use quota_tests::redis::TestRedis;
use serde_json::json;
use std::sync::Arc;
use std::time::Duration;

/// Concurrent clients (agents for grants) of every TLS measurement.
pub const CLIENTS: usize = 16;
const TENANT: &str = "bench";
const RESOURCE: &str = "tls";
/// Every measured call gives up after this long.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);

fn acquire_op(client: reqwest::Client, base: &str) -> Op {
    let url = format!("{base}/v1/acquire");
    let body = Arc::new(json!({"tenant": TENANT, "resource": RESOURCE}).to_string().into_bytes());
    Arc::new(move |_, _| {
        let (client, url, body) = (client.clone(), url.clone(), body.clone());
        async move {
            let r = client
                .post(&url)
                .header("content-type", "application/json")
                .body(body.as_ref().clone())
                .send()
                .await
                .map_err(|e| format!("acquire: {e}"))?;
            let status = r.status().as_u16();
            let _ = r.bytes().await;
            if status == 200 {
                Ok(())
            } else {
                Err(format!("acquire answered {status}"))
            }
        }
        .boxed()
    })
}

/// Grants of `want` 1 by agent `c` on its own quota `tls-g{c}`.
fn grant_op(http: Http, agents: Arc<Vec<(String, i64)>>) -> Op {
    Arc::new(move |c, n| {
        let http = http.clone();
        let (agent, epoch) = agents[c].clone();
        let body = json!({
            "tenant": TENANT, "resource": format!("tls-g{c}"), "region": "bench", "agent": agent,
            "epoch": epoch, "seq": n, "want": 1, "demand_per_sec": 10.0,
        });
        async move {
            let r = tokio::time::timeout(CALL_TIMEOUT, http.post("/v1/grants", &body))
                .await
                .map_err(|_| "grant timed out".to_string())?;
            if r.status == 200 && r.body["tokens"].as_i64().unwrap_or(0) > 0 {
                Ok(())
            } else {
                Err(format!("grant answered {} {}", r.status, r.body))
            }
        }
        .boxed()
    })
}

/// An allocator on the rig's database serving HTTPS with mTLS; killed
/// when dropped.
struct TlsAllocator {
    http: Http,
    _proc: AllocatorProc,
}

async fn tls_allocator(rig: &Rig, tls: &LabTls) -> Result<TlsAllocator, String> {
    let log = tls.dir().join("allocator-tls");
    let mut a = AllocatorProc::new(&rig.bins.allocator, &rig.db.url, log)
        .quiet()
        .envs(tls.allocator_env())
        .probe(|addr| tls.operator(&format!("https://{addr}")));
    a.start_ready(Duration::from_secs(60)).await?;
    Ok(TlsAllocator { http: a.http(), _proc: a })
}

/// Runs `plain` and `tls` one after the other, `tls` first when
/// `tls_first`; answers `(plain, tls)`.
async fn pair<P, T, FP, FT>(tls_first: bool, plain: P, tls: T) -> Result<(Sample, Sample), String>
where
    P: Fn() -> FP,
    T: Fn() -> FT,
    FP: std::future::Future<Output = Result<Sample, String>>,
    FT: std::future::Future<Output = Result<Sample, String>>,
{
    if tls_first {
        let t = tls().await?;
        Ok((plain().await?, t))
    } else {
        let p = plain().await?;
        Ok((p, tls().await?))
    }
}

/// Records `plain` and `tls` medians under `{prefix}.{plain_name|tls_name}`
/// and the TLS / plain throughput ratio.
fn record(
    out: &mut Results,
    prefix: &str,
    per_s: &str,
    (plain_name, plain): (&str, &[Sample]),
    (tls_name, tls): (&str, &[Sample]),
    ratios: &[f64],
) {
    for (name, samples) in [(plain_name, plain), (tls_name, tls)] {
        let m = Medians::of(samples);
        out.set(&format!("{prefix}.{name}.{per_s}"), m.per_s);
        out.set(&format!("{prefix}.{name}.p50_ms"), m.p50_ms);
        out.set(&format!("{prefix}.{name}.p99_ms"), m.p99_ms);
        if m.errors > 0 {
            out.note(format!("{prefix}.{name}: {} errors, first: {:?}", m.errors, m.first_error));
        }
    }
    out.set(&format!("{prefix}.{tls_name}.ratio_to_{plain_name}"), median(ratios));
}

/// Runs the TLS measurements on `rig`.
pub async fn run(rig: &Rig, plan: &Plan, out: &mut Results, progress: &dyn Fn(&str)) -> Result<(), String> {
    progress("tls: throwaway CA, a Redis over TLS and one plain, an agent on each");
    let tls = LabTls::generate()?;
    crate::pools::put_policy(
        &rig.admin,
        TENANT,
        RESOURCE,
        &json!({"limit": 1_000_000_000i64, "window_secs": 86_400}),
    )
    .await?;
    let plain_redis = TestRedis::start();
    let tls_redis = TestRedis::start_tls(&tls.server, true, &[]);
    let plain_agent = rig.agent_as("plain", &plain_redis.url, Vec::new()).await;
    let mut redis_env = tls.agent_env("tls");
    redis_env.retain(|(k, _)| k.starts_with("AGENT_REDIS_"));
    let tls_agent = rig.agent_as("tls", &tls_redis.tls_url(), redis_env).await;
    let http = quota_tests::http::client_builder()
        .timeout(CALL_TIMEOUT)
        .pool_max_idle_per_host(128)
        .build()
        .map_err(|e| format!("http client: {e}"))?;
    for a in [&plain_agent, &tls_agent] {
        // Warm: the agent learns the policy and credits a first lease.
        let warm = closed_loop(4, Duration::from_millis(500), acquire_op(http.clone(), &a.base)).await?;
        if warm.ok == 0 {
            return Err(format!(
                "agent {} never admitted during warm-up: {:?}",
                a.opts.agent, warm.first_error
            ));
        }
    }

    progress("tls: an allocator serving HTTPS with mTLS beside the plain one");
    let https = tls_allocator(rig, &tls).await?;
    let plain_http = rig.allocators[0].http();
    let grant_quotas = (0..CLIENTS).map(|c| format!("tls-g{c}"));
    let body = json!({"limit": 1_000_000_000i64, "window_secs": 86_400});
    crate::pools::put_policies(&rig.admin, TENANT, grant_quotas, &body).await?;

    let (mut a_plain, mut a_tls, mut a_ratio) = (Vec::new(), Vec::new(), Vec::new());
    let (mut g_plain, mut g_tls, mut g_ratio) = (Vec::new(), Vec::new(), Vec::new());
    for rep in 0..plan.reps {
        // Which side goes first alternates: the first run after a pause
        // meets colder caches and connection pools, and the machine's load
        // drifts; a fixed order would charge that to one side.
        let tls_first = rep % 2 == 1;
        progress(&format!("tls: decisions, redis:// and rediss://, repetition {}/{}", rep + 1, plan.reps));
        let plain_op = acquire_op(http.clone(), &plain_agent.base);
        let tls_op = acquire_op(http.clone(), &tls_agent.base);
        let (p, t) = pair(
            tls_first,
            || closed_loop(CLIENTS, plan.acquire, plain_op.clone()),
            || closed_loop(CLIENTS, plan.acquire, tls_op.clone()),
        )
        .await?;
        a_ratio.push(t.per_s / p.per_s.max(f64::MIN_POSITIVE));
        a_plain.push(p);
        a_tls.push(t);

        progress(&format!("tls: grants, http and https, repetition {}/{}", rep + 1, plan.reps));
        // Fresh agent names per run, so `seq` may restart at 1.
        let plain_op = grant_op(
            plain_http.clone(),
            crate::pools::register_agents(&plain_http, "bench", &format!("tlsh{rep}"), CLIENTS).await?,
        );
        let tls_op = grant_op(
            https.http.clone(),
            crate::pools::register_agents(&https.http, "bench", &format!("tlss{rep}"), CLIENTS).await?,
        );
        let (p, t) = pair(
            tls_first,
            || closed_loop(CLIENTS, plan.grants, plain_op.clone()),
            || closed_loop(CLIENTS, plan.grants, tls_op.clone()),
        )
        .await?;
        g_ratio.push(t.per_s / p.per_s.max(f64::MIN_POSITIVE));
        g_plain.push(p);
        g_tls.push(t);
    }
    let acquire = format!("acquire.c{CLIENTS}");
    record(out, &acquire, "decisions_per_s", ("redis_plain", &a_plain), ("redis_tls", &a_tls), &a_ratio);
    let grants = format!("grants.c{CLIENTS}");
    record(out, &grants, "grants_per_s", ("http", &g_plain), ("https", &g_tls), &g_ratio);
    Ok(())
}
