//! The hot-tenant flood row (issue 28, seed 002 F13 and game day 2): one
//! tenant whose quota is spent for the window is flooded by 64 clients
//! while another tenant on the same agent is measured. The negative cache
//! (`regional_agent::negative`) should answer the flood from memory, so
//! the figures are the spend-script runs per refused attempt
//! (`flood.runs_per_attempt`, target ≤ 0.01) and the other tenant's p99
//! during the flood over its p99 just before (`flood.other_p99_ratio`,
//! target ≤ 2), both from the same run.

use super::hist::{closed_loop, Op, Sample};
use super::rig::Rig;
use super::{Plan, Results};
use futures::FutureExt;
use serde_json::json;
use std::sync::Arc;

/// The flooded tenant and its quota (G = 1 per day: spent by the first
/// admit).
const FLOODED: (&str, &str) = ("flooding", "spent");
/// Clients of the flood, and of the tenant measured beside it.
const FLOOD_CLIENTS: usize = 64;
const OTHER_CLIENTS: usize = 4;

/// `POST /v1/acquire` of `quota` (tenant, resource): done when answered
/// `want` (its body read, so the connection goes back to the pool).
fn acquire_answering(
    client: reqwest::Client,
    base: &str,
    quota: (&str, &str),
    want: u16,
    what: &'static str,
) -> Op {
    let url = format!("{base}/v1/acquire");
    let body = json!({"tenant": quota.0, "resource": quota.1}).to_string().into_bytes();
    Arc::new(move |_, _| {
        let (client, url, body) = (client.clone(), url.clone(), body.clone());
        async move {
            let r = client
                .post(&url)
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await
                .map_err(|e| format!("{what}: {e}"))?;
            let status = r.status().as_u16();
            let _ = r.bytes().await;
            if status == want {
                Ok(())
            } else {
                Err(format!("{what} answered {status}, not {want}"))
            }
        }
        .boxed()
    })
}

/// `POST /v1/acquire` on the spent quota: done when refused with `429
/// quota_exhausted`, as every attempt after the first must be.
fn flood_op(client: reqwest::Client, base: &str) -> Op {
    acquire_answering(client, base, FLOODED, 429, "flood acquire")
}

/// The agent's spend-script runs so far.
pub(crate) async fn spend_runs(http: &reqwest::Client, base: &str) -> Result<f64, String> {
    let text = async { http.get(format!("{base}/metrics")).send().await?.text().await }
        .await
        .map_err(|e| format!("agent /metrics: {e}"))?;
    quota_tests::http::metric(&text, "agent_spend_runs_total")
        .ok_or_else(|| "agent /metrics has no agent_spend_runs_total".to_string())
}

fn errors_note(out: &mut Results, what: &str, s: &Sample) {
    if s.errors > 0 {
        out.note(format!("flood: {} {what} errors, first: {:?}", s.errors, s.first_error));
    }
}

/// The tenant measured beside the flood: its decision and its name.
pub struct Other {
    pub op: Op,
    pub name: String,
}

/// Measures the flood row on `base`'s agent (the acquire bench's).
pub async fn run(
    rig: &Rig,
    plan: &Plan,
    http: &reqwest::Client,
    base: &str,
    other: Other,
    out: &mut Results,
    progress: &dyn Fn(&str),
) -> Result<(), String> {
    crate::pools::put_limit(&rig.admin, FLOODED.0, FLOODED.1, 1, 86_400).await?;
    let flood = flood_op(http.clone(), base);
    // The one token goes; from then on every attempt is refused.
    let first = http
        .post(format!("{base}/v1/acquire"))
        .json(&json!({"tenant": FLOODED.0, "resource": FLOODED.1}))
        .send()
        .await
        .map_err(|e| format!("flood: first acquire: {e}"))?;
    if first.status() != 200 {
        return Err(format!("flood: the first acquire of the spent quota answered {}", first.status()));
    }
    let Other { op: other, name } = other;

    progress(&format!("flood: {OTHER_CLIENTS} clients of {name} alone"));
    let before = closed_loop(OTHER_CLIENTS, plan.acquire, other.clone()).await?;
    progress(&format!("flood: {FLOOD_CLIENTS} clients on the spent quota alone"));
    let runs0 = spend_runs(http, base).await?;
    let alone = closed_loop(FLOOD_CLIENTS, plan.acquire, flood.clone()).await?;
    let runs = spend_runs(http, base).await? - runs0;
    progress(&format!("flood: {OTHER_CLIENTS} clients of {name} during the flood"));
    let (during_flood, during) = futures::join!(
        closed_loop(FLOOD_CLIENTS, plan.acquire, flood),
        closed_loop(OTHER_CLIENTS, plan.acquire, other)
    );
    let (during_flood, during) = (during_flood?, during?);

    let attempts = (alone.ok + alone.errors).max(1) as f64;
    out.set("flood.attempts_per_s", alone.per_s);
    out.set("flood.runs_per_attempt", runs / attempts);
    out.set("flood.refusal_p99_ms", alone.p99_ms);
    out.set("flood.other_p99_ms_before", before.p99_ms);
    out.set("flood.other_p99_ms_during", during.p99_ms);
    out.set("flood.other_p99_ratio", during.p99_ms / before.p99_ms.max(f64::MIN_POSITIVE));
    out.set("flood.other_per_s_ratio", during.per_s / before.per_s.max(f64::MIN_POSITIVE));
    out.note(format!(
        "flood: {FLOOD_CLIENTS} clients on a spent quota, {:.0} refusals/s (p99 {:.3} ms) for {runs:.0} spend-script runs \
         ({:.4} per attempt); {OTHER_CLIENTS} clients of another tenant: p99 {:.3} ms before, {:.3} ms during \
         (x{:.2}), {:.0} → {:.0} decisions/s",
        alone.per_s,
        alone.p99_ms,
        runs / attempts,
        before.p99_ms,
        during.p99_ms,
        during.p99_ms / before.p99_ms.max(f64::MIN_POSITIVE),
        before.per_s,
        during.per_s
    ));
    for (what, s) in [
        ("flood", &alone),
        ("flood (beside)", &during_flood),
        ("other before", &before),
        ("other during", &during),
    ] {
        errors_note(out, what, s);
    }
    Ok(())
}

/// The tenant measured beside the flood in a game day's drill.
const DRILL_OTHER: (&str, &str) = ("birch", "search");

/// Game day 2 (`cargo lab gameday --only 2`): the flood row on a rig of
/// its own (one allocator, one agent, one Redis), with the other tenant's
/// quota large enough never to refuse. The figures are the row's
/// `flood.*` keys.
pub async fn drill(bins: crate::bins::Bins, plan: &Plan, progress: &dyn Fn(&str)) -> Result<Results, String> {
    let rig = Rig::start(bins, 1).await?;
    let redis = quota_tests::redis::TestRedis::start();
    crate::pools::put_limit(&rig.admin, DRILL_OTHER.0, DRILL_OTHER.1, 1_000_000_000, 3600).await?;
    let agent = rig.agent(&redis).await;
    let http = super::acquire::client(std::time::Duration::from_secs(5))?;
    let other = Other {
        op: other_op(http.clone(), &agent.base),
        name: format!("{}/{}", DRILL_OTHER.0, DRILL_OTHER.1),
    };
    super::acquire::warm_up("agent", other.op.clone()).await?;
    let mut out = Results::default();
    run(&rig, plan, &http, &agent.base, other, &mut out, progress).await?;
    Ok(out)
}

/// `POST /v1/acquire` on the drill's other tenant (not the bench's, whose
/// ops name the bench's tenant): done when admitted.
fn other_op(client: reqwest::Client, base: &str) -> Op {
    acquire_answering(client, base, DRILL_OTHER, 200, "other tenant's acquire")
}
