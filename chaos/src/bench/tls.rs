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

use super::acquire::{acquire_op_for, client, warm_up};
use super::grants::{self, Quotas};
use super::hist::{closed_loop, median, Medians, Sample};
use super::rig::Rig;
use super::{Plan, Results};
use crate::tls::LabTls;
use quota_tests::allocator_proc::AllocatorProc;
use quota_tests::http::Http;
use quota_tests::redis::TestRedis;
use serde_json::json;
use std::future::Future;
use std::time::Duration;

/// Concurrent clients (agents for grants) of every TLS measurement.
pub const CLIENTS: usize = 16;
const TENANT: &str = "bench";
const RESOURCE: &str = "tls";
/// The grant measurements' quotas: one per agent, `tls-g{c}`.
const GRANT_QUOTAS: Quotas = Quotas::Own("tls-g");
/// Every measured call gives up after this long.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);

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

/// One comparison's samples over the repetitions: the plain side, the
/// TLS side and the TLS / plain throughput ratio of each repetition.
#[derive(Default)]
struct Compared {
    plain: Vec<Sample>,
    tls: Vec<Sample>,
    ratios: Vec<f64>,
}

impl Compared {
    /// Measures both sides once, `tls` first when `tls_first`.
    async fn measure<FP, FT>(&mut self, tls_first: bool, plain: FP, tls: FT) -> Result<(), String>
    where
        FP: Future<Output = Result<Sample, String>>,
        FT: Future<Output = Result<Sample, String>>,
    {
        let (p, t) = if tls_first {
            let t = tls.await?;
            (plain.await?, t)
        } else {
            let p = plain.await?;
            (p, tls.await?)
        };
        self.ratios.push(t.per_s / p.per_s.max(f64::MIN_POSITIVE));
        self.plain.push(p);
        self.tls.push(t);
        Ok(())
    }

    /// Records the medians of each side under `{prefix}.{plain_name|tls_name}`
    /// and the TLS / plain throughput ratio.
    fn record(&self, out: &mut Results, prefix: &str, per_s: &str, plain_name: &str, tls_name: &str) {
        for (name, samples) in [(plain_name, &self.plain), (tls_name, &self.tls)] {
            let key = format!("{prefix}.{name}");
            Medians::of(samples).put(out, &key, per_s, &key);
        }
        out.set(&format!("{prefix}.{tls_name}.ratio_to_{plain_name}"), median(&self.ratios));
    }
}

/// Runs the TLS measurements on `rig`.
pub async fn run(rig: &Rig, plan: &Plan, out: &mut Results, progress: &dyn Fn(&str)) -> Result<(), String> {
    progress("tls: throwaway CA, a Redis over TLS and one plain, an agent on each");
    let tls = LabTls::generate()?;
    crate::pools::put_limit(&rig.admin, TENANT, RESOURCE, 1_000_000_000, 86_400).await?;
    let plain_redis = TestRedis::start();
    let tls_redis = TestRedis::start_tls(&tls.server, true, &[]);
    let plain_agent = rig.agent_as("plain", &plain_redis.url, Vec::new()).await;
    let mut redis_env = tls.agent_env("tls");
    redis_env.retain(|(k, _)| k.starts_with("AGENT_REDIS_"));
    let tls_agent = rig.agent_as("tls", &tls_redis.tls_url(), redis_env).await;
    let http = client(CALL_TIMEOUT)?;
    let acquire_op = |base: &str| acquire_op_for(http.clone(), base, &[RESOURCE], false);
    for a in [&plain_agent, &tls_agent] {
        warm_up(&format!("agent {}", a.opts.agent), acquire_op(&a.base)).await?;
    }

    progress("tls: an allocator serving HTTPS with mTLS beside the plain one");
    let https = tls_allocator(rig, &tls).await?;
    let plain_http = rig.allocators[0].http();
    let grant_quotas = (0..CLIENTS).map(|c| GRANT_QUOTAS.resource(c, 0));
    let body = json!({"limit": 1_000_000_000i64, "window_secs": 86_400});
    crate::pools::put_policies(&rig.admin, TENANT, grant_quotas, &body).await?;

    let (mut decisions, mut grant_runs) = (Compared::default(), Compared::default());
    for rep in 0..plan.reps {
        // Which side goes first alternates: the first run after a pause
        // meets colder caches and connection pools, and the machine's load
        // drifts; a fixed order would charge that to one side.
        let tls_first = rep % 2 == 1;
        progress(&format!("tls: decisions, redis:// and rediss://, repetition {}/{}", rep + 1, plan.reps));
        let plain = closed_loop(CLIENTS, plan.acquire, acquire_op(&plain_agent.base));
        let tls = closed_loop(CLIENTS, plan.acquire, acquire_op(&tls_agent.base));
        decisions.measure(tls_first, plain, tls).await?;

        progress(&format!("tls: grants, http and https, repetition {}/{}", rep + 1, plan.reps));
        let (plain_run, tls_run) = (format!("tlsh{rep}"), format!("tlss{rep}"));
        let plain = grants::measure(vec![plain_http.clone()], CLIENTS, GRANT_QUOTAS, plan.grants, &plain_run);
        let tls = grants::measure(vec![https.http.clone()], CLIENTS, GRANT_QUOTAS, plan.grants, &tls_run);
        grant_runs.measure(tls_first, plain, tls).await?;
    }
    decisions.record(out, &format!("acquire.c{CLIENTS}"), "decisions_per_s", "redis_plain", "redis_tls");
    grant_runs.record(out, &format!("grants.c{CLIENTS}"), "grants_per_s", "http", "https");
    Ok(())
}

/// One side of a link (`<part>.c<n>.<side>.*`), read back from a report.
#[derive(Debug, Clone, Default, serde::Deserialize)]
#[serde(default)]
pub struct Side {
    pub decisions_per_s: Option<f64>,
    pub grants_per_s: Option<f64>,
    pub p50_ms: Option<f64>,
    pub p99_ms: Option<f64>,
    pub ratio_to_redis_plain: Option<f64>,
    pub ratio_to_http: Option<f64>,
}

impl Side {
    /// Side `side` (`redis_tls`, `http`, ...) of part `part` (`acquire`, `grants`).
    pub fn of(r: &super::report::BenchReport, part: &str, side: &str) -> Side {
        super::view::part(r, &format!("{part}.c{CLIENTS}.{side}"))
    }

    /// Its rate, whichever part measured it.
    pub fn per_s(&self) -> Option<f64> {
        self.decisions_per_s.or(self.grants_per_s)
    }
}
