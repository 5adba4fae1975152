//! Renewal cost: allocator grant calls per 1,000 admitted requests at a
//! steady demand below G with the default policy, counted from the ledger
//! (`granted`, `replayed` and `refused` events of the quota: every grant
//! request leaves exactly one) against the clients' 200s. The same interval
//! gives the ledger's growth (rows per second, extrapolated to an hour).

use super::rig::Rig;
use super::{Plan, Results};
use crate::traffic::{self, RegionLoad, Traffic};
use quota_tests::redis::TestRedis;
use std::time::Instant;

const TENANT: &str = "bench";
const RESOURCE: &str = "steady";
/// G = 1,000 per second of window; the offered rate stays well below it.
const WINDOW_SECS: i64 = 60;
const LIMIT: i64 = 60_000;

fn admitted(t: &traffic::Tally) -> u64 {
    t.values().map(|regions| traffic::total(regions).admitted()).sum()
}

async fn counts(db: &sqlx::PgPool) -> Result<(i64, i64), String> {
    sqlx::query_as(
        "select (select count(*) from ledger_event where tenant = $1 and resource = $2
                   and kind in ('granted', 'replayed', 'refused')),
                (select count(*) from ledger_event)",
    )
    .bind(TENANT)
    .bind(RESOURCE)
    .fetch_one(db)
    .await
    .map_err(|e| format!("reading the ledger: {e}"))
}

/// Runs the steady-demand measurement.
pub async fn run(rig: &Rig, plan: &Plan, out: &mut Results, progress: &dyn Fn(&str)) -> Result<(), String> {
    progress(&format!(
        "renewal: {} req/s steady for {:?} on the default policy (G = {LIMIT} per {WINDOW_SECS} s)",
        plan.steady_rate, plan.steady
    ));
    let db = crate::pg_conn::connect(&rig.db.url, 1, "bench connection to PostgreSQL").await?;
    crate::pools::put_limit(&rig.admin, TENANT, RESOURCE, LIMIT, WINDOW_SECS).await?;
    let redis = TestRedis::start();
    let agent = rig.agent(&redis).await;
    let load =
        RegionLoad { region: "eu".into(), agents: vec![agent.base.clone()], rate_per_sec: plan.steady_rate };
    // Counting starts before the first request, so the first grant (the
    // policy fetch and the first lease) is part of the cost it amortises.
    let (grants0, rows0) = counts(&db).await?;
    let started = Instant::now();
    let traffic = Traffic::start(TENANT, RESOURCE, &[load]);
    tokio::time::sleep(plan.steady).await;
    let (grants1, rows1) = counts(&db).await?;
    let admitted1 = admitted(&traffic.tally());
    let secs = started.elapsed().as_secs_f64();
    let tally = traffic.stop().await;
    let admits = admitted1;
    let calls = (grants1 - grants0).max(0);
    if admits == 0 {
        return Err("renewal: no request was admitted at steady demand".into());
    }
    let refused: u64 = tally.values().map(traffic::total).map(|c| c.denied + c.unavailable).sum();
    if refused > 0 {
        out.note(format!("renewal: {refused} requests refused (429/503) at steady demand below G"));
    }
    out.set("renewals_per_1000_admits", calls as f64 * 1000.0 / admits as f64);
    out.set("renewal.grant_calls", calls as f64);
    out.set("renewal.admits", admits as f64);
    out.set("renewal.admits_per_s", admits as f64 / secs);
    let rows_per_s = (rows1 - rows0).max(0) as f64 / secs;
    out.set("scaling.ledger_rows_per_s", rows_per_s);
    out.set("scaling.ledger_rows_per_hour", rows_per_s * 3600.0);
    db.close().await;
    Ok(())
}

/// What this part measured (`renewal.*`), read back from a report.
#[derive(Debug, Clone, Copy, Default, serde::Deserialize)]
#[serde(default)]
pub struct Measured {
    pub grant_calls: Option<f64>,
    pub admits: Option<f64>,
    pub admits_per_s: Option<f64>,
}

impl Measured {
    pub fn of(r: &super::report::BenchReport) -> Measured {
        super::view::part(r, "renewal")
    }
}
