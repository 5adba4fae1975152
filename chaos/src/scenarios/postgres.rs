//! PostgreSQL failover (issue 15 item 6, DESIGN §6 and I6): the allocator's
//! database is a primary with a streaming standby, the primary dies and the
//! standby is promoted, as PostgreSQL's own HA does it.
//!
//! ```text
//!  allocator ─ pg link (the LB) ─▶ primary ─ repl link ─▶ standby
//!                       └─ repointed after the promotion ──────▲
//! ```
//!
//! The replication link goes through a fault proxy of its own. On loopback
//! a standby is microseconds behind, so a failover would hardly ever lose a
//! commit; cutting the link for a second before the primary dies gives the
//! standby the lag a congested WAN link or a slow disk gives, and shows
//! what each mode does with it: a synchronous primary does not acknowledge
//! a commit the standby lacks (the allocator's requests stall, the agents
//! serve from their leases and the fallback), an asynchronous one does and
//! those commits die with it.

use super::harness::{Profile, Run, RESOURCE, TENANT};
use crate::bins::Bins;
use crate::redis_conn;
use crate::report::ScenarioReport;
use quota_tests::proxy::{Fault, FaultProxy};
use serde_json::json;
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

/// Offered load above G (1.3 G): pools run dry in every window, so tokens
/// a lost grant gives out again show against the bound.
const EU: f64 = 0.9;
const US: f64 = 0.4;
/// How long the standby misses the primary's commits before it dies.
const CUT: Duration = Duration::from_millis(1000);
/// Bound on every step that waits for the allocator on the new primary.
const RECOVER: Duration = Duration::from_secs(20);

/// A lease the old primary held just before its death.
struct KnownLease {
    id: String,
    window_start: i64,
    tokens: i64,
}

/// Registers the probe identity `eu/eu-probe` (never an agent's) and
/// returns its epoch, retrying until the allocator answers or `RECOVER`.
async fn register_probe(run: &Run) -> Result<i64, String> {
    let admin = &run.stack.admin;
    let registered = quota_tests::wait::poll(RECOVER, Duration::from_millis(200), || async move {
        let r = admin.post("/v1/agents/register", &json!({"region": "eu", "agent": "eu-probe"})).await;
        match (r.status, r.body["epoch"].as_i64()) {
            (200, Some(e)) => Ok(e),
            _ => Err(r),
        }
    })
    .await;
    registered.map_err(|r| format!("register answered {} {} for {RECOVER:?}", r.status, r.body))
}

/// Lease ids in the lease books (`l:<id>`) of every region's Redis: the
/// leases some agent credited and has not yet forgotten.
async fn credited_leases(run: &Run) -> Result<BTreeSet<String>, String> {
    let mut ids = BTreeSet::new();
    for r in &run.stack.regions {
        let mut c = redis_conn::connect(&r.redis.url, Duration::from_secs(10)).await?;
        let keys = redis_conn::scan(&mut c, &format!("{}q:*:l:*", r.redis.prefix)).await?;
        ids.extend(keys.iter().filter_map(|k| k.rsplit_once(":l:").map(|(_, id)| id.to_string())));
    }
    Ok(ids)
}

/// Per report id, per window start (Unix s), what the report counted
/// (consumed + fallback) for the scenario's quota.
async fn reports(db: &sqlx::PgPool) -> Result<BTreeMap<String, BTreeMap<i64, i64>>, String> {
    let rows = sqlx::query_file!("src/sql/report_items.sql", TENANT, RESOURCE)
        .fetch_all(db)
        .await
        .map_err(|e| format!("report query: {e}"))?;
    let mut out: BTreeMap<String, BTreeMap<i64, i64>> = BTreeMap::new();
    for r in rows {
        let (id, ws, n) = (r.report_id, r.window_start, r.counted);
        *out.entry(id).or_default().entry(ws).or_default() += n;
    }
    Ok(out)
}

/// How long the old primary may take to finish the statements it was
/// running when the allocator's link was cut.
const QUIESCE: Duration = Duration::from_secs(3);

/// Waits until no client backend but this one runs a statement.
async fn quiesce(db: &sqlx::PgPool) -> Result<(), String> {
    let deadline = std::time::Instant::now() + QUIESCE;
    loop {
        let busy = sqlx::query_file_scalar!("src/sql/busy_backends.sql")
            .fetch_one(db)
            .await
            .map_err(|e| format!("activity query: {e}"))?;
        if busy == 0 {
            return Ok(());
        }
        if std::time::Instant::now() > deadline {
            return Err(format!("{busy} statements still running {QUIESCE:?} after the link was cut"));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// `postgres-failover` (`synchronous`) and `postgres-failover-async`.
pub async fn failover(p: &Profile, bins: Bins, synchronous: bool) -> Result<ScenarioReport, String> {
    if std::env::var_os("DATABASE_URL").is_some() {
        return Err("needs a local PostgreSQL to replicate and kill (DATABASE_URL is set)".into());
    }
    let name = if synchronous { "postgres-failover" } else { "postgres-failover-async" };
    let mut run = Run::start(name, p, bins, None, false).await?;
    let primary = run.stack.db.local_addr().ok_or("no local PostgreSQL")?;
    let repl_link = FaultProxy::start(vec![primary]).await.map_err(|e| e.to_string())?;
    // Dropped (stopped, removed) when this function returns, on every path.
    let standby = run.stack.db.start_standby(&repl_link.addr, synchronous).await?;
    let mode =
        if synchronous { "a synchronous (synchronous_standby_names = '*')" } else { "an asynchronous" };
    run.note(format!("{mode} streaming standby (pg_basebackup -R) follows the primary"));
    let policy = run.stack.admin.get(&format!("/v1/policies/{TENANT}/{RESOURCE}")).await;
    let chunk_max = policy.body["chunk_max"].as_i64().ok_or_else(|| format!("policy: {}", policy.body))?;

    run.traffic(&[("eu", EU), ("us", US)]);
    run.pass(1.5).await;
    let epochs_before: Vec<i64> = {
        let mut v = Vec::new();
        for r in &run.stack.regions {
            for a in &r.agents {
                v.push(a.epoch().await);
            }
        }
        v
    };
    let probe_before = register_probe(&run).await?;
    // Early in a window: the pool still has tokens, so grants (and in the
    // asynchronous case lost grants) happen during the cut.
    run.at_phase(0.1).await;
    repl_link.set(Fault::Blackhole);
    run.note(format!(
        "replication link cut for {:.1} s: the standby receives nothing more",
        CUT.as_secs_f64()
    ));
    tokio::time::sleep(CUT).await;

    // The allocator loses the old primary first (its connections closed,
    // new ones hang), then the commits it had already sent finish: from
    // here on, nothing more commits there, so what is read below is all
    // the old primary ever acknowledged (read later, a report committed
    // between the read and the kill would be lost uncounted).
    // Synchronous: nothing commits past the cut replication link (a commit
    // waits for the standby, holding its row locks, so the backends behind
    // it wait too), and the acknowledged set cannot grow.
    if !synchronous {
        run.stack.pg_link.set(Fault::Blackhole);
        quiesce(&run.db).await?;
    }
    // What the old primary holds just before its death: every lease it
    // committed (visible, so in the synchronous case also on the standby)
    // and every report it accepted.
    let leases = sqlx::query_file!("src/sql/leases_of_quota.sql", TENANT, RESOURCE)
        .fetch_all(&run.db)
        .await
        .map_err(|e| format!("lease query: {e}"))?;
    let mut known: BTreeMap<String, KnownLease> = leases
        .into_iter()
        .map(|l| {
            (
                l.lease_id.clone(),
                KnownLease { id: l.lease_id, window_start: l.window_start, tokens: l.tokens },
            )
        })
        .collect();
    let reports_before = reports(&run.db).await?;
    run.stack.db.kill();
    let killed = chrono::Utc::now();
    run.note(if synchronous {
        "the primary SIGKILLed with all its processes"
    } else {
        "the allocator's link to the primary cut, its last commits finished, then the primary SIGKILLed with all its processes"
    });
    // Leases the agents credited from the old primary (read before any
    // can be credited from the new one).
    let credited = credited_leases(&run).await?;
    standby.promote().await?;
    run.stack.pg_link.set_upstreams(vec![standby.addr.clone()]);
    run.stack.pg_link.set(Fault::Pass);
    let promoted = chrono::Utc::now();
    run.note(format!(
        "standby promoted (pg_ctl promote) and the allocator's link repointed {:.2} s after the kill",
        (promoted - killed).num_milliseconds() as f64 / 1000.0
    ));
    run.db.close().await;
    run.db = crate::pg_conn::connect(&standby.url, 2, "connect to the new primary").await?;

    let probe_after = register_probe(&run).await?;
    run.check(
        probe_after > probe_before,
        format!("a registration after the failover got epoch {probe_after} > {probe_before} before it (I4)"),
    );
    run.pass(2.0).await;
    let first_grant = sqlx::query_file_scalar!("src/sql/first_lease_after.sql", TENANT, RESOURCE, promoted)
        .fetch_one(&run.db)
        .await
        .map_err(|e| format!("query: {e}"))?;
    match first_grant {
        Some(t) => run.note(format!(
            "first lease from the new primary {:.2} s after the kill",
            (t - killed).num_milliseconds() as f64 / 1000.0
        )),
        None => run.check(false, "no lease was granted by the new primary"),
    }
    let mut epochs_after = Vec::new();
    for r in &run.stack.regions {
        for a in &r.agents {
            epochs_after.push(a.epoch().await);
        }
    }
    run.check(
        epochs_after.iter().zip(&epochs_before).all(|(a, b)| a >= b),
        format!("the agents' epochs never went back: {epochs_before:?} -> {epochs_after:?}"),
    );

    // Lost grants: leases known before the kill that the new primary lacks.
    for id in &credited {
        known.entry(id.clone()).or_insert(KnownLease { id: id.clone(), window_start: -1, tokens: -1 });
    }
    let ids: Vec<String> = known.keys().cloned().collect();
    let present = sqlx::query_file_scalar!("src/sql/leases_present.sql", &ids[..])
        .fetch_all(&run.db)
        .await
        .map_err(|e| format!("lease query: {e}"))?;
    let present: BTreeSet<String> = present.into_iter().collect();
    let lost: Vec<&KnownLease> = known.values().filter(|l| !present.contains(&l.id)).collect();
    let lost_credited = lost.iter().filter(|l| credited.contains(&l.id)).count();
    let lost_tokens: i64 = lost.iter().map(|l| l.tokens.max(0)).sum();
    // Reports the old primary accepted that the new one lacks: the ledger
    // counts their admits nowhere (the agents were told they were taken).
    let reports_after = reports(&run.db).await?;
    let mut lost_reports = 0;
    for (id, items) in &reports_before {
        if !reports_after.contains_key(id) {
            lost_reports += 1;
            for (ws, n) in items {
                *run.lost_by_window.entry(run.window_key(*ws)).or_default() += n;
            }
        }
    }
    run.note(format!("admits in the lost reports, by window: {:?}", run.lost_by_window));
    let summary = format!(
        "{} leases known before the kill ({} credited in Redis); {} lost ({lost_credited} of them credited, \
         {lost_tokens} tokens), {lost_reports} accepted reports lost",
        known.len(),
        credited.len(),
        lost.len()
    );
    if synchronous {
        run.check(
            lost.is_empty() && lost_reports == 0,
            format!("no committed grant or report lost: {summary}"),
        );
    } else {
        run.note(summary);
        // I6: every lost grant may be given out again, at most chunk_max.
        for l in &lost {
            let ws = if l.window_start >= 0 { l.window_start } else { killed.timestamp() };
            *run.bound_extra.entry(run.window_key(ws)).or_default() += chunk_max;
        }
        run.check(
            !lost.is_empty(),
            format!("the asynchronous failover lost {} grants (the scenario shows the loss)", lost.len()),
        );
        run.note(format!(
            "bound of the windows with lost grants raised by lost grants x chunk_max ({chunk_max}): {:?}",
            run.bound_extra
        ));
    }
    // The standby and the replication link stop when they go out of scope,
    // after the stack (its allocators) in `finish`.
    let rep = run.finish().await;
    drop(standby);
    drop(repl_link);
    rep
}
