//! PostgreSQL high availability the way operators run it (issue 34,
//! DESIGN §6 and I6): two PostgreSQL nodes under Patroni with leader
//! election in etcd, HAProxy in front checking Patroni's REST `/primary`,
//! and the allocator connecting through HAProxy and nothing else. Nobody
//! promotes by hand and no fault proxy stands in for the load balancer.
//!
//! ```text
//!  allocator ─▶ HAProxy ─┬─▶ node1 (primary) ─ streams to ─▶ node2 (replica)
//!             (/primary) └─▶ node2 ◀── promoted by Patroni after the leader key's ttl
//! ```
//!
//! * `postgres-failover` / `postgres-failover-async`: the primary's host
//!   dies (Patroni and PostgreSQL SIGKILLed), its leader key expires in
//!   etcd and Patroni promotes the replica; HAProxy follows its check.
//!   Replication stalls for a second first (the primary's WAL senders
//!   frozen, the connection up): on loopback a replica is microseconds
//!   behind, the stall gives it the lag a congested link or a slow disk
//!   gives, and shows what each mode does with it. With `synchronous_mode`
//!   the primary acknowledges no commit the replica lacks (the allocator's
//!   requests stall, the agents serve from leases and the fallback): 0
//!   grants and reports lost. Asynchronous, those commits die with it; the
//!   scenario counts them exactly and raises the bound by them (I6).
//! * `postgres-switchover`: planned maintenance, `patronictl switchover`:
//!   0 lost, the longest time without a grant measured.
//! * `etcd-loss`: etcd dies; without `failsafe_mode` Patroni demotes the
//!   primary once it cannot renew its leader key, the allocator answers
//!   503 and the agents serve from leases and the fallback; etcd returns,
//!   Patroni promotes again, grants resume.

use super::harness::{Profile, Run, RESOURCE, TENANT};
use crate::bins::Bins;
use crate::redis_conn;
use crate::report::ScenarioReport;
use crate::stack::StackSpec;
use quota_tests::patroni::PatroniCluster;
use serde_json::json;
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

/// Offered load above G (1.3 G): pools run dry in every window, so tokens
/// a lost grant gives out again show against the bound.
const EU: f64 = 0.9;
const US: f64 = 0.4;
/// How long the replica misses the primary's commits before it dies.
const CUT: Duration = Duration::from_millis(1000);
/// Bound on every step that waits for Patroni and the allocator after a
/// fault: the leader key's ttl (10 s in the lab) plus HAProxy's check and
/// the promotion.
const RECOVER: Duration = Duration::from_secs(30);

/// The stack of these scenarios: `eu` with two agents, `us` with one, one
/// allocator, the database a Patroni cluster.
fn spec(synchronous: bool) -> StackSpec {
    StackSpec {
        regions: vec![("eu".into(), 2), ("us".into(), 1)],
        allocators: 1,
        agent_env: Vec::new(),
        sentinel_regions: Vec::new(),
        patroni: Some(synchronous),
    }
}

fn cluster(run: &Run) -> Result<&PatroniCluster, String> {
    run.stack.patroni.as_ref().ok_or_else(|| "the stack has no Patroni cluster".to_string())
}

fn cluster_mut(run: &mut Run) -> Result<&mut PatroniCluster, String> {
    run.stack.patroni.as_mut().ok_or_else(|| "the stack has no Patroni cluster".to_string())
}

fn secs_between(from: chrono::DateTime<chrono::Utc>, to: chrono::DateTime<chrono::Utc>) -> f64 {
    (to - from).num_milliseconds() as f64 / 1000.0
}

/// A lease the old primary held just before the fault.
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

/// What one node held at an instant: its leases and accepted reports.
struct Held {
    leases: BTreeMap<String, KnownLease>,
    reports: BTreeMap<String, BTreeMap<i64, i64>>,
}

/// Reads what the node behind `db` holds.
async fn held(db: &sqlx::PgPool) -> Result<Held, String> {
    let leases = sqlx::query_file!("src/sql/leases_of_quota.sql", TENANT, RESOURCE)
        .fetch_all(db)
        .await
        .map_err(|e| format!("lease query: {e}"))?;
    let leases = leases
        .into_iter()
        .map(|l| {
            (
                l.lease_id.clone(),
                KnownLease { id: l.lease_id, window_start: l.window_start, tokens: l.tokens },
            )
        })
        .collect();
    Ok(Held { leases, reports: reports(db).await? })
}

/// What the database the allocator now uses lacks of `before` (plus the
/// leases the agents credited, `credited`): the lost leases, and the
/// number of lost reports, whose admits are added to the run's
/// `lost_by_window` (the ledger counts them nowhere, the agents were told
/// they were taken).
async fn lost<'a>(
    run: &mut Run,
    before: &'a mut Held,
    credited: &BTreeSet<String>,
) -> Result<(Vec<&'a KnownLease>, usize, String), String> {
    for id in credited {
        before.leases.entry(id.clone()).or_insert(KnownLease {
            id: id.clone(),
            window_start: -1,
            tokens: -1,
        });
    }
    let ids: Vec<String> = before.leases.keys().cloned().collect();
    let present = sqlx::query_file_scalar!("src/sql/leases_present.sql", &ids[..])
        .fetch_all(&run.db)
        .await
        .map_err(|e| format!("lease query: {e}"))?;
    let present: BTreeSet<String> = present.into_iter().collect();
    let lost: Vec<&KnownLease> = before.leases.values().filter(|l| !present.contains(&l.id)).collect();
    let lost_credited = lost.iter().filter(|l| credited.contains(&l.id)).count();
    let lost_tokens: i64 = lost.iter().map(|l| l.tokens.max(0)).sum();
    let reports_after = reports(&run.db).await?;
    let mut lost_reports = 0;
    for (id, items) in &before.reports {
        if !reports_after.contains_key(id) {
            lost_reports += 1;
            for (ws, n) in items {
                *run.lost_by_window.entry(run.window_key(*ws)).or_default() += n;
            }
        }
    }
    let summary = format!(
        "{} leases known before the fault ({} credited in Redis); {} lost ({lost_credited} of them credited, \
         {lost_tokens} tokens), {lost_reports} of {} accepted reports lost",
        before.leases.len(),
        credited.len(),
        lost.len(),
        before.reports.len(),
    );
    Ok((lost, lost_reports, summary))
}

/// How long the old primary may take to finish the statements it was
/// running when the allocator's sessions were cut.
const QUIESCE: Duration = Duration::from_secs(3);

/// Waits until no client backend but this one runs a statement.
async fn quiesce(db: &sqlx::PgPool) -> Result<(), String> {
    let deadline = Instant::now() + QUIESCE;
    loop {
        let busy = sqlx::query_file_scalar!("src/sql/busy_backends.sql")
            .fetch_one(db)
            .await
            .map_err(|e| format!("activity query: {e}"))?;
        if busy == 0 {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!("{busy} statements still running {QUIESCE:?} after the sessions were cut"));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Every agent's epoch, in stack order.
async fn epochs(run: &Run) -> Vec<i64> {
    let mut v = Vec::new();
    for r in &run.stack.regions {
        for a in &r.agents {
            v.push(a.epoch().await);
        }
    }
    v
}

/// Waits until Patroni reports a primary and a write commits through
/// HAProxy, then points the run's own pool at it again (the old one's
/// connections led to the old primary). The index of the primary.
async fn follow_primary(run: &mut Run) -> Result<usize, String> {
    let c = cluster(run)?;
    let primary = c.wait_primary(RECOVER).await?;
    c.wait_writable(RECOVER).await?;
    let url = c.url.clone();
    run.db.close().await;
    run.db = crate::pg_conn::connect(&url, 2, "connect to the new primary through HAProxy").await?;
    Ok(primary)
}

/// The first lease with tokens issued after `after`, noted as `what`.
async fn note_first_lease(
    run: &mut Run,
    after: chrono::DateTime<chrono::Utc>,
    what: &str,
) -> Result<Option<f64>, String> {
    let first = sqlx::query_file_scalar!("src/sql/first_lease_after.sql", TENANT, RESOURCE, after)
        .fetch_one(&run.db)
        .await
        .map_err(|e| format!("query: {e}"))?;
    match first {
        Some(t) => {
            let s = secs_between(after, t);
            run.note(format!("first grant {s:.2} s after {what}"));
            Ok(Some(s))
        }
        None => {
            run.check(false, format!("no lease was granted after {what}"));
            Ok(None)
        }
    }
}

/// `postgres-failover` (`synchronous`) and `postgres-failover-async`.
pub async fn failover(p: &Profile, bins: Bins, synchronous: bool) -> Result<ScenarioReport, String> {
    let name = if synchronous { "postgres-failover" } else { "postgres-failover-async" };
    let mut run = Run::start(name, p, bins, Some(spec(synchronous)), false).await?;
    let old = cluster(&run)?.wait_primary(RECOVER).await?;
    let (old_name, old_url) = {
        let n = &cluster(&run)?.nodes[old];
        (n.name.clone(), n.url())
    };
    run.note(format!(
        "Patroni cluster: {old_name} primary, its replica {} (synchronous_mode: {synchronous}), HAProxy checks /primary",
        if synchronous { "the synchronous standby" } else { "asynchronous" }
    ));
    // The old primary itself, bypassing HAProxy: what it holds is read
    // here after the allocator's sessions to it are cut.
    let old_db = crate::pg_conn::connect(&old_url, 2, "connect to the primary directly").await?;
    let policy = run.stack.admin.get(&format!("/v1/policies/{TENANT}/{RESOURCE}")).await;
    let chunk_max = policy.body["chunk_max"].as_i64().ok_or_else(|| format!("policy: {}", policy.body))?;

    run.traffic(&[("eu", EU), ("us", US)]);
    run.pass(1.5).await;
    let epochs_before = epochs(&run).await;
    let probe_before = register_probe(&run).await?;
    // Early in a window: the pool still has tokens, so grants (and in the
    // asynchronous case lost grants) happen during the cut.
    run.at_phase(0.1).await;
    let frozen = cluster(&run)?.freeze_replication(old)?;
    run.note(format!(
        "replication stalled for {:.1} s before the crash ({frozen} WAL sender of {old_name} frozen, \
         the connection up): the replica receives nothing more",
        CUT.as_secs_f64()
    ));
    tokio::time::sleep(CUT).await;

    // Asynchronous: HAProxy drops the old primary and closes the
    // allocator's sessions to it, then the commits it had already sent
    // finish: from here on nothing more commits there, so what is read
    // below is all the old primary ever acknowledged (read later, a report
    // committed between the read and the kill would be lost uncounted).
    // Synchronous: nothing commits past the stalled replication (a commit
    // waits for the replica, holding its row locks, so the backends behind
    // it wait too; such a commit is not visible), and the acknowledged set
    // cannot grow.
    if !synchronous {
        cluster(&run)?.cut_clients_from(old)?;
        quiesce(&old_db).await?;
    }
    let mut before = held(&old_db).await?;
    old_db.close().await;
    cluster_mut(&mut run)?.kill_node(old);
    let killed = chrono::Utc::now();
    run.note(if synchronous {
        format!("{old_name}'s host crashed: Patroni and PostgreSQL SIGKILLed")
    } else {
        format!(
            "HAProxy's sessions to {old_name} closed, its last commits finished, then its host crashed: \
             Patroni and PostgreSQL SIGKILLed"
        )
    });
    // Leases the agents credited from the old primary (read before any
    // can be credited from the new one).
    let credited = credited_leases(&run).await?;
    let new = follow_primary(&mut run).await?;
    let promoted = chrono::Utc::now();
    let new_name = cluster(&run)?.nodes[new].name.clone();
    run.check(new != old, format!("Patroni promoted {new_name} (the old primary was {old_name})"));
    run.note(format!(
        "{new_name} promoted by Patroni and writable through HAProxy {:.2} s after the kill (ttl {} s)",
        secs_between(killed, promoted),
        quota_tests::patroni::TTL
    ));

    let probe_after = register_probe(&run).await?;
    run.check(
        probe_after > probe_before,
        format!("a registration after the failover got epoch {probe_after} > {probe_before} before it (I4)"),
    );
    run.pass(2.0).await;
    note_first_lease(&mut run, killed, "the kill").await?;
    let epochs_after = epochs(&run).await;
    run.check(
        epochs_after.iter().zip(&epochs_before).all(|(a, b)| a >= b),
        format!("the agents' epochs never went back: {epochs_before:?} -> {epochs_after:?}"),
    );

    let (lost, lost_reports, summary) = lost(&mut run, &mut before, &credited).await?;
    run.note(format!("admits in the lost reports, by window: {:?}", run.lost_by_window));
    if synchronous {
        run.check(
            lost.is_empty() && lost_reports == 0,
            format!("no committed grant or report lost: {summary}"),
        );
    } else {
        run.note(summary);
        // I6: every lost grant may be given out again, at most chunk_max.
        let mut extra: BTreeMap<String, i64> = BTreeMap::new();
        for l in &lost {
            let ws = if l.window_start >= 0 { l.window_start } else { killed.timestamp() };
            *extra.entry(run.window_key(ws)).or_default() += chunk_max;
        }
        let n = lost.len();
        run.bound_extra.extend(extra);
        run.check(n > 0, format!("the asynchronous failover lost {n} grants (the scenario shows the loss)"));
        run.note(format!(
            "bound of the windows with lost grants raised by lost grants x chunk_max ({chunk_max}): {:?}",
            run.bound_extra
        ));
    }
    run.finish().await
}

/// Sends a grant of one token for the probe identity every `EVERY` until
/// stopped; answers the send instants of the grants that succeeded.
struct GrantProbe {
    stop: tokio::sync::watch::Sender<bool>,
    task: tokio::task::JoinHandle<Vec<Instant>>,
}

impl GrantProbe {
    const EVERY: Duration = Duration::from_millis(100);
    /// Bound on one probe request (the allocator's own retry budget is
    /// 900 ms).
    const TIMEOUT: Duration = Duration::from_secs(3);

    fn start(admin: quota_tests::http::Http, epoch: i64) -> GrantProbe {
        let (stop, mut stopped) = tokio::sync::watch::channel(false);
        let task = tokio::spawn(async move {
            let mut ok = Vec::new();
            let mut seq = 0i64;
            while !*stopped.borrow() {
                seq += 1;
                let sent = Instant::now();
                let body = json!({
                    "tenant": TENANT, "resource": RESOURCE, "region": "eu", "agent": "eu-probe",
                    "epoch": epoch, "seq": seq, "want": 1, "demand_per_sec": 0.0,
                });
                if let Ok(r) = tokio::time::timeout(Self::TIMEOUT, admin.post("/v1/grants", &body)).await {
                    if r.status == 200 {
                        ok.push(sent);
                    }
                }
                let next = sent + Self::EVERY;
                tokio::select! {
                    _ = tokio::time::sleep_until(next.into()) => {}
                    _ = stopped.changed() => {}
                }
            }
            ok
        });
        GrantProbe { stop, task }
    }

    /// Stops the probe: the longest time between two successful grants
    /// (and how many there were).
    async fn finish(self) -> Result<(Duration, usize), String> {
        let _ = self.stop.send(true);
        let ok = self.task.await.map_err(|e| format!("grant probe: {e}"))?;
        let gap = ok.windows(2).map(|w| w[1] - w[0]).max().unwrap_or_default();
        Ok((gap, ok.len()))
    }
}

/// `postgres-switchover`: planned maintenance with `patronictl
/// switchover` (synchronous_mode): nothing lost, the gap measured.
pub async fn switchover(p: &Profile, bins: Bins) -> Result<ScenarioReport, String> {
    let mut run = Run::start("postgres-switchover", p, bins, Some(spec(true)), false).await?;
    let old = cluster(&run)?.wait_primary(RECOVER).await?;
    let candidate = 1 - old;
    let (old_name, new_name) = {
        let c = cluster(&run)?;
        (c.nodes[old].name.clone(), c.nodes[candidate].name.clone())
    };
    let old_url = cluster(&run)?.nodes[old].url();
    let old_db = crate::pg_conn::connect(&old_url, 2, "connect to the primary directly").await?;
    run.traffic(&[("eu", EU), ("us", US)]);
    run.pass(1.5).await;
    let epoch = register_probe(&run).await?;
    let probe = GrantProbe::start(run.stack.admin.clone(), epoch);
    run.at_phase(0.1).await;
    // What the old primary acknowledged until the switchover began; what
    // it acknowledges during the switchover is in the agents' lease books
    // (read after it) and in the accounts the run closes with.
    let mut before = held(&old_db).await?;
    old_db.close().await;
    let asked = chrono::Utc::now();
    let out = cluster(&run)?.switchover(old, candidate).await?;
    let done = chrono::Utc::now();
    run.note(format!(
        "patronictl switchover --leader {old_name} --candidate {new_name} took {:.2} s{}",
        secs_between(asked, done),
        out.lines()
            .rev()
            .find(|l| l.contains("witchover"))
            .map(|l| format!(" ({})", l.trim()))
            .unwrap_or_default()
    ));
    let credited = credited_leases(&run).await?;
    let new = follow_primary(&mut run).await?;
    run.check(new == candidate, format!("{new_name} is the primary after the switchover"));
    run.pass(1.0).await;
    let (gap, grants) = probe.finish().await?;
    run.note(format!(
        "longest time without a grant around the switchover: {:.2} s ({grants} probe grants, one every {} ms)",
        gap.as_secs_f64(),
        GrantProbe::EVERY.as_millis()
    ));
    run.check(gap < RECOVER, format!("grants resumed after the switchover (gap {:.2} s)", gap.as_secs_f64()));
    note_first_lease(&mut run, done, "the switchover").await?;
    let (lost, lost_reports, summary) = lost(&mut run, &mut before, &credited).await?;
    run.check(lost.is_empty() && lost_reports == 0, format!("no grant or report lost: {summary}"));
    run.finish().await
}

/// `etcd-loss`: etcd dies for longer than the leader key's ttl
/// (synchronous_mode, failsafe_mode off, as in deploy/patroni/).
pub async fn etcd_loss(p: &Profile, bins: Bins) -> Result<ScenarioReport, String> {
    let mut run = Run::start("etcd-loss", p, bins, Some(spec(true)), false).await?;
    let primary = cluster(&run)?.wait_primary(RECOVER).await?;
    let primary_url = cluster(&run)?.nodes[primary].url();
    run.traffic(&[("eu", EU), ("us", US)]);
    run.pass(1.5).await;
    run.at_phase(0.1).await;
    cluster_mut(&mut run)?.stop_etcd();
    let stopped = chrono::Utc::now();
    run.note("etcd SIGKILLed: Patroni can neither renew nor read the leader key");
    // Patroni demotes the primary once it cannot update the leader key
    // (failsafe_mode off): /primary stops answering 200 on every node.
    let c = cluster(&run)?;
    let demoted = quota_tests::wait::poll(RECOVER, Duration::from_millis(100), || async move {
        match c.primary().await {
            None => Ok(()),
            Some(i) => Err(i),
        }
    })
    .await;
    let demoted_at = chrono::Utc::now();
    match demoted {
        Ok(()) => run.note(format!(
            "no node is primary {:.2} s after etcd died (ttl {} s, retry_timeout {} s)",
            secs_between(stopped, demoted_at),
            quota_tests::patroni::TTL,
            quota_tests::patroni::RETRY_TIMEOUT
        )),
        Err(i) => run.check(false, format!("node {i} still primary {RECOVER:?} after etcd died")),
    }
    // The demoted node, read-only: it holds every lease and report ever
    // acknowledged (a demotion is a clean shutdown, nothing in flight).
    let node = crate::pg_conn::connect(&primary_url, 2, "connect to the demoted primary").await?;
    let recovering: bool = sqlx::query_scalar("select pg_is_in_recovery()")
        .fetch_one(&node)
        .await
        .map_err(|e| format!("demoted node: {e}"))?;
    run.check(recovering, "the demoted primary runs read-only (in recovery) while etcd is gone");
    let mut before = held(&node).await?;
    node.close().await;
    // Meanwhile the allocator answers 503 (HAProxy has no server up): the
    // agents serve from their leases, then the fallback allowance.
    let admin = &run.stack.admin;
    let r = admin.post("/v1/agents/register", &json!({"region": "eu", "agent": "eu-probe"})).await;
    run.check(
        r.status == 503,
        format!(
            "the allocator answers 503 while there is no primary (register: {} {})",
            r.status, r.body["error"]
        ),
    );
    run.pass(1.0).await;
    cluster_mut(&mut run)?.start_etcd().await?;
    let back = chrono::Utc::now();
    run.note(format!("etcd restarted {:.2} s after it died", secs_between(stopped, back)));
    let credited = credited_leases(&run).await?;
    let now_primary = follow_primary(&mut run).await?;
    let writable = chrono::Utc::now();
    let name = cluster(&run)?.nodes[now_primary].name.clone();
    run.note(format!(
        "{name} primary and writable through HAProxy {:.2} s after etcd came back",
        secs_between(back, writable)
    ));
    run.pass(2.0).await;
    note_first_lease(&mut run, back, "etcd came back").await?;
    let (lost, lost_reports, summary) = lost(&mut run, &mut before, &credited).await?;
    run.check(lost.is_empty() && lost_reports == 0, format!("no grant or report lost: {summary}"));
    run.finish().await
}
