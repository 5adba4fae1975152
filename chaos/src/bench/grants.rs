//! Allocator grants (`POST /v1/grants`) at 64 concurrent agents, for one
//! hot quota (every grant serialises on one pool row lock) and for 10,000
//! quotas, with 1 and 2 allocator replicas on one PostgreSQL; and the
//! ceiling of the same run: `pgbench` with a transaction of the grant's
//! shape (one row lock, one insert, one update) at 64 clients on the same
//! server; grants in batches of 1, 16 and 64 items per request. Also the
//! scaling figures that depend on the number of quotas:
//! allocator RSS and grant p99 at 100 and 100,000 quotas, and ledger rows
//! written per grant.

use super::hist::{closed_loop, median, Medians, Op, Sample};
use super::rig::Rig;
use super::{Plan, Results};
use futures::FutureExt;
use quota_tests::http::Http;
use serde_json::json;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// Concurrent agents of every grant measurement.
pub const AGENTS: usize = 64;
const TENANT: &str = "bench";
/// A grant's HTTP call gives up after this long (the allocator's own
/// request limit is 10 s).
const CALL_TIMEOUT: Duration = Duration::from_secs(12);

/// Which quotas a case spreads its grants over.
#[derive(Clone, Copy)]
pub(super) enum Quotas {
    /// One quota, `hot`, for every client.
    Hot,
    /// `m{count}-{i}`, each client moving over all of them.
    Many(usize),
    /// One quota per client, `{prefix}{client}` (no row lock shared).
    Own(&'static str),
}

impl Quotas {
    /// The quota client `client` asks for in its `n`th grant.
    pub(super) fn resource(self, client: usize, n: u64) -> String {
        match self {
            Quotas::Hot => "hot".into(),
            // A stride coprime with any count spreads clients over different quotas.
            Quotas::Many(q) => format!("m{q}-{}", (client as u64 * 7_919 + n) % q as u64),
            Quotas::Own(prefix) => format!("{prefix}{client}"),
        }
    }
}

/// Policies for `count` quotas `m{count}-{i}`, written in one statement: a
/// PUT per quota would take minutes at 100,000, and a new quota has no
/// pool yet, so rows written like this are what a PUT leaves behind.
async fn create_quotas(db: &sqlx::PgPool, count: usize) -> Result<(), String> {
    let sql = "with q as (select 'm' || $1::bigint || '-' || i as resource from generate_series(0, $1::bigint - 1) i)
        , p as (
          insert into policy (tenant, resource, limit_tokens, window_secs, chunk_min, chunk_max, lease_ttl_secs,
                              fallback_per_region, fail_mode, version, updated_at, updated_by)
          select $2, resource, 1000000000, 86400, 10000000, 100000000, 30, 10000000, 'bounded', 1, now(), 'bench'
          from q on conflict do nothing)
        insert into policy_version (tenant, resource, version, limit_tokens, window_secs, chunk_min, chunk_max,
                                    lease_ttl_secs, fallback_per_region, fail_mode, updated_at, updated_by)
        select $2, resource, 1, 1000000000, 86400, 10000000, 100000000, 30, 10000000, 'bounded', now(), 'bench'
        from q on conflict do nothing";
    sqlx::query(sql)
        .bind(count as i64)
        .bind(TENANT)
        .execute(db)
        .await
        .map_err(|e| format!("creating {count} quotas: {e}"))?;
    Ok(())
}

fn grant_op(targets: Vec<Http>, quotas: Quotas, agents: Arc<Vec<(String, i64)>>) -> Op {
    let targets = Arc::new(targets);
    Arc::new(move |c, n| {
        let http = targets[c % targets.len()].clone();
        let (agent, epoch) = agents[c].clone();
        let body = json!({
            "tenant": TENANT, "resource": quotas.resource(c, n), "region": "bench", "agent": agent,
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

/// Items per request of the batch cases (`grants.batch.b{n}`).
pub const BATCH_SIZES: [usize; 3] = [1, 16, 64];
/// Concurrent agents of the batch cases: a quarter of [`AGENTS`], each
/// renewing many quotas per request, as agents renewing together do.
pub const BATCH_AGENTS: usize = AGENTS / 4;

/// Like [`grant_op`], but each call carries `size` grants in one
/// `POST /v1/grants` with `items`, for `size` different quotas; it counts
/// as one operation (grants/s is operations/s × `size`).
fn batch_op(http: Http, quotas: Quotas, size: usize, agents: Arc<Vec<(String, i64)>>) -> Op {
    Arc::new(move |c, n| {
        let http = http.clone();
        let (agent, epoch) = agents[c].clone();
        let items: Vec<_> = (0..size as u64)
            .map(|i| {
                // Sequence numbers of one client never repeat: n counts calls.
                let seq = (n - 1) * size as u64 + i;
                json!({
                    "tenant": TENANT, "resource": quotas.resource(c, seq), "region": "bench", "agent": agent,
                    "epoch": epoch, "seq": seq, "want": 1, "demand_per_sec": 10.0,
                })
            })
            .collect();
        let body = json!({ "items": items });
        async move {
            let r = tokio::time::timeout(CALL_TIMEOUT, http.post("/v1/grants", &body))
                .await
                .map_err(|_| "grant batch timed out".to_string())?;
            let granted = r.body["items"].as_array().is_some_and(|a| {
                a.len() == size
                    && a.iter().all(|i| i["status"] == 200 && i["grant"]["tokens"].as_i64() > Some(0))
            });
            if r.status == 200 && granted {
                Ok(())
            } else {
                Err(format!("grant batch answered {} {}", r.status, r.body))
            }
        }
        .boxed()
    })
}

/// Batches of `size` grants from [`BATCH_AGENTS`] fresh agents on the
/// first replica, spread over `quotas`, in a closed loop for `dur`; the
/// sample's `per_s` is grants (not requests) per second.
async fn batches(rig: &Rig, quotas: Quotas, size: usize, dur: Duration, run: &str) -> Result<Sample, String> {
    let http = rig.allocators[0].http();
    let registered = crate::pools::register_agents(&http, "bench", run, BATCH_AGENTS).await?;
    let mut s = closed_loop(BATCH_AGENTS, dur, batch_op(http, quotas, size, registered)).await?;
    s.per_s *= size as f64;
    Ok(s)
}

/// Grants of `want` 1 from `agents` fresh agents (named after `run`, so
/// `seq` may restart at 1; registered through the first of `targets`)
/// spread over `targets`, in a closed loop for `dur`.
pub(super) async fn measure(
    targets: Vec<Http>,
    agents: usize,
    quotas: Quotas,
    dur: Duration,
    run: &str,
) -> Result<Sample, String> {
    let registered = crate::pools::register_agents(&targets[0], "bench", run, agents).await?;
    closed_loop(agents, dur, grant_op(targets, quotas, registered)).await
}

async fn grants(
    rig: &Rig,
    replicas: usize,
    quotas: Quotas,
    dur: Duration,
    run: &str,
) -> Result<Sample, String> {
    let targets = rig.allocators.iter().take(replicas).map(|a| a.http()).collect();
    measure(targets, AGENTS, quotas, dur, run).await
}

/// The pgbench side: its tables live in the same database, apart from the
/// allocator's.
struct PgBench {
    bin: PathBuf,
    script: PathBuf,
    url: String,
    _dir: tempfile::TempDir,
}

/// The transaction of a grant, reduced to its shape: lock the pool row,
/// insert the lease, debit the pool.
const PGBENCH_SCRIPT: &str = "\\set q random(1, :nq)
begin;
select granted from bench_pool where id = :q for update;
insert into bench_lease (pool_id, tokens, at) values (:q, 1, now());
update bench_pool set granted = granted + 1 where id = :q;
end;
";

impl PgBench {
    async fn prepare(db: &sqlx::PgPool, url: &str, rows: usize) -> Result<PgBench, String> {
        let bin = ["/usr/bin/pgbench", "/usr/lib/postgresql/15/bin/pgbench"]
            .iter()
            .map(PathBuf::from)
            .chain(
                std::fs::read_dir("/usr/lib/postgresql")
                    .into_iter()
                    .flatten()
                    .flatten()
                    .map(|e| e.path().join("bin/pgbench")),
            )
            .find(|p| p.is_file())
            .ok_or("pgbench not found (apt-get install postgresql-client)")?;
        for sql in [
            "create table if not exists bench_pool (id int primary key, granted bigint not null default 0)",
            "create table if not exists bench_lease (id bigserial primary key, pool_id int not null, tokens bigint not null, at timestamptz not null)",
        ] {
            sqlx::query(sql).execute(db).await.map_err(|e| format!("pgbench tables: {e}"))?;
        }
        sqlx::query("insert into bench_pool (id) select generate_series(1, $1) on conflict do nothing")
            .bind(rows as i32)
            .execute(db)
            .await
            .map_err(|e| format!("pgbench rows: {e}"))?;
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let script = dir.path().join("grant.sql");
        std::fs::write(&script, PGBENCH_SCRIPT).map_err(|e| format!("{}: {e}", script.display()))?;
        Ok(PgBench { bin, script, url: url.to_string(), _dir: dir })
    }

    /// Transactions per second at `AGENTS` clients over `rows` pool rows.
    async fn run(&self, rows: usize, dur: Duration) -> Result<(f64, f64), String> {
        let secs = dur.as_secs().max(1);
        let mut cmd = tokio::process::Command::new(&self.bin);
        cmd.args(["-n", "-c", &AGENTS.to_string(), "-j", "2", "-T", &secs.to_string(), "-D"])
            .arg(format!("nq={rows}"))
            .arg("-f")
            .arg(&self.script)
            .arg(&self.url)
            .kill_on_drop(true);
        let out = tokio::time::timeout(Duration::from_secs(secs + 60), cmd.output())
            .await
            .map_err(|_| "pgbench did not finish".to_string())?
            .map_err(|e| format!("pgbench: {e}"))?;
        let text = String::from_utf8_lossy(&out.stdout);
        if !out.status.success() {
            return Err(format!(
                "pgbench failed ({}): {text}{}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        let field = |prefix: &str| {
            text.lines()
                .find(|l| l.trim_start().starts_with(prefix))
                .and_then(|l| l.split('=').nth(1))
                .and_then(|v| v.split_whitespace().next())
                .and_then(|v| v.parse::<f64>().ok())
        };
        let tps = field("tps").ok_or_else(|| format!("no tps in pgbench output: {text}"))?;
        Ok((tps, field("latency average").unwrap_or(0.0)))
    }
}

/// Runs the grant and scaling measurements.
pub async fn run(rig: &Rig, plan: &Plan, out: &mut Results, progress: &dyn Fn(&str)) -> Result<(), String> {
    let db = crate::pg_conn::connect(&rig.db.url, 2, "bench connection to PostgreSQL").await?;
    crate::pools::put_limit(&rig.admin, TENANT, "hot", 1_000_000_000, 86_400).await?;
    let many = plan.many_quotas;
    create_quotas(&db, many).await?;
    let pgbench = PgBench::prepare(&db, &rig.db.url, many).await?;

    let cases: [(&str, Quotas, usize); 4] = [
        ("hot.r1", Quotas::Hot, 1),
        ("hot.r2", Quotas::Hot, 2),
        ("q10k.r1", Quotas::Many(many), 1),
        ("q10k.r2", Quotas::Many(many), 2),
    ];
    let mut samples: Vec<Vec<Sample>> = vec![Vec::new(); cases.len()];
    let (mut pg_hot, mut pg_many) = (Vec::new(), Vec::new());
    let (mut lat_hot, mut lat_many) = (Vec::new(), Vec::new());
    let mut ratios: Vec<Vec<f64>> = vec![Vec::new(); cases.len()];
    for rep in 0..plan.reps {
        progress(&format!("grants: pgbench ceiling, repetition {}/{}", rep + 1, plan.reps));
        let (h, hl) = pgbench.run(1, plan.pgbench).await?;
        let (m, ml) = pgbench.run(many, plan.pgbench).await?;
        pg_hot.push(h);
        pg_many.push(m);
        lat_hot.push(hl);
        lat_many.push(ml);
        for (i, (name, quotas, replicas)) in cases.iter().enumerate() {
            progress(&format!("grants: {name}, repetition {}/{}", rep + 1, plan.reps));
            let s = grants(rig, *replicas, *quotas, plan.grants, &format!("g{rep}{}", name.replace('.', "")))
                .await?;
            let ceiling = if matches!(quotas, Quotas::Hot) { h } else { m };
            ratios[i].push(s.per_s / ceiling.max(f64::MIN_POSITIVE));
            samples[i].push(s);
        }
    }
    for (i, (name, _, _)) in cases.iter().enumerate() {
        Medians::of(&samples[i]).put(
            out,
            &format!("grants.c64.{name}"),
            "grants_per_s",
            &format!("grants {name}"),
        );
        out.set(&format!("grants.c64.{name}.ratio_to_ceiling"), median(&ratios[i]));
    }
    out.set("grants.c64.pgbench.hot.tps", median(&pg_hot));
    out.set("grants.c64.pgbench.hot.latency_avg_ms", median(&lat_hot));
    out.set("grants.c64.pgbench.q10k.tps", median(&pg_many));
    out.set("grants.c64.pgbench.q10k.latency_avg_ms", median(&lat_many));
    // The headline: many quotas on one replica, the production shape.
    for s in ["grants_per_s", "p50_ms", "p99_ms", "ratio_to_ceiling"] {
        if let Some(v) = out.get(&format!("grants.c64.q10k.r1.{s}")) {
            out.set(&format!("grants.c64.{s}"), v);
        }
    }
    // Batched renewals: 1, 16 and 64 grants per request, beside the single
    // form above (`grants.c64.q10k.r1`).
    for size in BATCH_SIZES {
        let mut s = Vec::new();
        for rep in 0..plan.reps {
            progress(&format!("grants: batches of {size}, repetition {}/{}", rep + 1, plan.reps));
            s.push(batches(rig, Quotas::Many(many), size, plan.grants, &format!("b{size}-{rep}")).await?);
        }
        Medians::of(&s).put(
            out,
            &format!("grants.batch.b{size}"),
            "grants_per_s",
            &format!("grants batch {size}"),
        );
    }
    if many != 10_000 {
        out.note(format!("grants \"q10k\" cases used {many} quotas in this mode, not 10,000"));
    }

    // Scaling: one replica, grants spread over 100 and then N quotas.
    for &n in &plan.scaling_quotas {
        progress(&format!("scaling: {n} quotas"));
        create_quotas(&db, n).await?;
        let mut s = Vec::new();
        for rep in 0..plan.reps {
            s.push(grants(rig, 1, Quotas::Many(n), plan.grants, &format!("s{n}-{rep}")).await?);
        }
        let m = Medians::of(&s);
        out.set(&format!("scaling.q{n}.grant_p99_ms"), m.p99_ms);
        out.set(&format!("scaling.q{n}.grants_per_s"), m.per_s);
        out.set(
            &format!("scaling.q{n}.allocator_rss_mb"),
            super::machine::rss_mb(rig.allocators[0].pid().ok_or("the bench allocator is not running")?)?,
        );
    }
    let (events, leases): (i64, i64) =
        sqlx::query_as("select (select count(*) from ledger_event), (select count(*) from lease)")
            .fetch_one(&db)
            .await
            .map_err(|e| format!("counting ledger rows: {e}"))?;
    out.set("scaling.ledger_rows_per_grant", events as f64 / leases.max(1) as f64);
    db.close().await;
    Ok(())
}

/// One case of this part (`grants.c64.<case>.*`), read back from a report.
#[derive(Debug, Clone, Copy, Default, serde::Deserialize)]
#[serde(default)]
pub struct Measured {
    pub grants_per_s: Option<f64>,
    pub p50_ms: Option<f64>,
    pub p99_ms: Option<f64>,
    pub ratio_to_ceiling: Option<f64>,
}

/// pgbench's run of the grant's shape (`grants.c64.pgbench.<shape>.*`).
#[derive(Debug, Clone, Copy, Default, serde::Deserialize)]
#[serde(default)]
pub struct Pgbench {
    pub tps: Option<f64>,
    pub latency_avg_ms: Option<f64>,
}

/// The scaling rows of one quota count (`scaling.q<n>.*`).
#[derive(Debug, Clone, Copy, Default, serde::Deserialize)]
#[serde(default)]
pub struct AtQuotas {
    pub allocator_rss_mb: Option<f64>,
    pub grant_p99_ms: Option<f64>,
    pub grants_per_s: Option<f64>,
}

impl Measured {
    /// Case `case` (`hot.r1`, `q10k.r2`, ...) of `r`.
    pub fn of(r: &super::report::BenchReport, case: &str) -> Measured {
        super::view::part(r, &format!("grants.c64.{case}"))
    }

    /// Batches of `size` items (`grants.batch.b<size>.*`) of `r`.
    pub fn batch(r: &super::report::BenchReport, size: usize) -> Measured {
        super::view::part(r, &format!("grants.batch.b{size}"))
    }
}

impl Pgbench {
    /// Shape `shape` (`hot`, `q10k`) of `r`.
    pub fn of(r: &super::report::BenchReport, shape: &str) -> Pgbench {
        super::view::part(r, &format!("grants.c64.pgbench.{shape}"))
    }
}

impl AtQuotas {
    /// `n` quotas of `r`.
    pub fn of(r: &super::report::BenchReport, n: usize) -> AtQuotas {
        super::view::part(r, &format!("scaling.q{n}"))
    }
}
