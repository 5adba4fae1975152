//! Staged policy rollouts (seed 002 F24/F25): a policy `PUT` with
//! `rollout` publishes the new version to canary regions first. The
//! candidate is a row of `policy_version` only and a `policy_rollout` row
//! says who is on it; `policy` keeps the version every other region is on.
//!
//! * **Grants follow each region's version** (`quota_grant`, migration
//!   20261224000001): a canary region's grant reads the candidate's fields
//!   and answers its version; every other region's reads the version in
//!   force. The window's bound while two versions are in flight: each grant
//!   checks the pool against its own version's limit, so the pool's granted
//!   total never passes `max(G_old, G_new)`, and the pool's limit and
//!   allowance are set to the larger of the two (I1 as the table shows it);
//!   an immediate change has the same bound, since lowering a limit never
//!   revokes what was granted under the higher one (I9).
//! * **The watcher** ([`watch`], every [`WATCH_EVERY`] on every replica,
//!   serialised by the policy row's lock) sums the agents' latest statuses
//!   (each counts its open window's admits and 429s under the version it
//!   holds) and applies [`verdict`]: the rollout halts when the canary's
//!   refusal rate under the new version is above [`REFUSAL_FLOOR`] and
//!   above `halt_factor` times the old version's in the other regions, and
//!   is promoted once the soak time is over, each only after
//!   `min_decisions` decisions under the new version.
//! * **Versions only move forward.** A halt publishes the version in force
//!   again under a number above the candidate's, so the canary's agents
//!   (which never go back to a lower version) return to it; a promotion
//!   puts the candidate in force as it is numbered. A write during a live
//!   rollout supersedes it (roll forward by hand); promote and halt by hand
//!   may name the candidate's version, so a late or replayed call about an
//!   older rollout changes nothing.

use crate::error::{Error, Result};
use crate::http::auth::Principal;
use crate::http::extract::{check_count, check_id, parse_optional_json, ApiPath};
use crate::ledger::{self, Kind, NewEvent};
use crate::policies::{PolicyRow, Resolved};
use crate::state::AppState;
use axum::extract::State;
use axum::{Extension, Json};
use chrono::{DateTime, Utc};
use quota_shared::wire::{
    ErrorBody, Policy, Rollout, RolloutAction, RolloutMeasured, RolloutSpec, RolloutState, VersionCounts,
};
use sqlx::PgConnection;
use std::time::Duration;

/// `soak_secs` when the PUT gives none.
pub const DEFAULT_SOAK_SECS: i64 = 300;
/// `halt_factor` when the PUT gives none.
pub const DEFAULT_HALT_FACTOR: f64 = 2.0;
/// `min_decisions` when the PUT gives none.
pub const DEFAULT_MIN_DECISIONS: i64 = 100;
/// A canary refusal rate at or below this never halts a rollout (a new
/// version refusing 0.5 % where the old refused 0.1 % is not a fleet
/// outage; F25's unit mix-up refused 99 %).
pub const REFUSAL_FLOOR: f64 = 0.01;
/// How often the watcher looks at the live rollouts.
pub const WATCH_EVERY: Duration = Duration::from_secs(1);
/// Agent statuses older than this are left out of the counts (an agent
/// sends one every 2 s by default).
pub const STATUS_FRESH_SECS: i64 = 30;
/// Most live rollouts the watcher looks at per round (oldest first).
pub const MAX_WATCHED: i64 = 100;
/// Most canary regions of one rollout.
pub const MAX_CANARY_REGIONS: usize = 16;
/// Who the watcher's promotions and halts are written as.
pub const WATCHER: &str = "rollout-watcher";

/// A rollout as the PUT asked for it, defaults filled and checked.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    pub canary_regions: Vec<String>,
    pub soak_secs: i64,
    pub halt_factor: f64,
    pub min_decisions: i64,
}

/// Checks a PUT's `rollout`; the error names the field.
pub fn resolve(spec: &RolloutSpec) -> Result<Plan> {
    let n = spec.canary_regions.len();
    if n == 0 || n > MAX_CANARY_REGIONS {
        return Err(Error::invalid(
            "rollout.canary_regions",
            format!("must name 1 to {MAX_CANARY_REGIONS} regions, got {n}"),
        ));
    }
    let mut canary_regions = Vec::with_capacity(n);
    for (i, r) in spec.canary_regions.iter().enumerate() {
        check_id(&format!("rollout.canary_regions[{i}]"), r)?;
        if canary_regions.contains(r) {
            return Err(Error::invalid(
                format!("rollout.canary_regions[{i}]"),
                format!("{r} is named twice"),
            ));
        }
        canary_regions.push(r.clone());
    }
    let soak_secs = spec.soak_secs.unwrap_or(DEFAULT_SOAK_SECS);
    if !(1..=86_400).contains(&soak_secs) {
        return Err(Error::invalid("rollout.soak_secs", format!("must be 1 to 86400, got {soak_secs}")));
    }
    let halt_factor = spec.halt_factor.unwrap_or(DEFAULT_HALT_FACTOR);
    if !(1.0..=1000.0).contains(&halt_factor) {
        return Err(Error::invalid("rollout.halt_factor", format!("must be 1 to 1000, got {halt_factor}")));
    }
    let min_decisions = spec.min_decisions.unwrap_or(DEFAULT_MIN_DECISIONS);
    if !(1..=1_000_000_000).contains(&min_decisions) {
        return Err(Error::invalid(
            "rollout.min_decisions",
            format!("must be 1 to 1000000000, got {min_decisions}"),
        ));
    }
    Ok(Plan { canary_regions, soak_secs, halt_factor, min_decisions })
}

/// Checks that the change can be rolled out from the version in force
/// (`current`: its kind and window): rate policies only, same window.
pub fn check_rollable(r: &Resolved, current: Option<(&str, i64)>) -> Result<()> {
    let Some((kind, window_secs)) = current else {
        return Err(Error::invalid(
            "rollout",
            "a new quota has no version in force to roll out from: publish its first version without rollout",
        ));
    };
    if kind != "rate" || r.kind != quota_shared::wire::PolicyKind::Rate {
        return Err(Error::invalid("rollout", "only rate policies are rolled out in stages"));
    }
    if r.window_secs != window_secs {
        return Err(Error::invalid(
            "rollout.window_secs",
            format!(
                "a rollout keeps the window ({window_secs} s, asked {} s): two window lengths have no common pool; publish it without rollout",
                r.window_secs
            ),
        ));
    }
    Ok(())
}

/// What the watcher does with a live rollout.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    /// Not enough decisions yet, or soaking.
    Wait,
    /// The canary's refusals say the new version is bad (the reason in words).
    Halt(String),
    /// Soaked without a halt.
    Promote(String),
}

/// How a rollout stands in time: soaking, soaked, or past twice its soak.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Age {
    Soaking,
    Soaked,
    /// Twice the soak time is over: a canary that has still not made
    /// `min_decisions` decisions under the new version is halted.
    Expired,
}

/// The rule: `new` are the canary's decisions under the new version, `old`
/// the other regions' under the old one.
pub fn verdict(
    new: VersionCounts,
    old: VersionCounts,
    halt_factor: f64,
    min_decisions: i64,
    age: Age,
) -> Verdict {
    if new.decisions() < min_decisions {
        if age == Age::Expired {
            return Verdict::Halt(format!(
                "the canary made {} of the {min_decisions} decisions needed under version {} in twice the soak time: not enough to promote it (halted, the safe side)",
                new.decisions(),
                new.version
            ));
        }
        return Verdict::Wait;
    }
    let (rn, ro) = (new.refusal_rate(), old.refusal_rate());
    if rn > REFUSAL_FLOOR && rn > ro * halt_factor {
        return Verdict::Halt(format!(
            "the canary refused {:.1} % of {} decisions under version {}; the other regions {:.1} % of {} under version {} (halt factor {halt_factor})",
            rn * 100.0,
            new.decisions(),
            new.version,
            ro * 100.0,
            old.decisions(),
            old.version
        ));
    }
    if age != Age::Soaking {
        return Verdict::Promote(format!(
            "soaked: the canary refused {:.1} % of {} decisions under version {}; the other regions {:.1} % under version {}",
            rn * 100.0,
            new.decisions(),
            new.version,
            ro * 100.0,
            old.version
        ));
    }
    Verdict::Wait
}

/// The live rollout of a quota, as locked.
struct Live {
    to_version: i64,
    from_version: i64,
    soak_secs: i64,
    halt_factor: f64,
    min_decisions: i64,
    started_at: DateTime<Utc>,
}

async fn lock_live(conn: &mut PgConnection, tenant: &str, resource: &str) -> Result<Option<Live>> {
    let row =
        sqlx::query_file!("src/sql/rollout_live_lock.sql", tenant, resource).fetch_optional(conn).await?;
    Ok(row.map(|r| Live {
        to_version: r.to_version,
        from_version: r.from_version,
        soak_secs: i64::from(r.soak_secs),
        halt_factor: r.halt_factor,
        min_decisions: r.min_decisions,
        started_at: r.started_at,
    }))
}

/// Refuses a second rollout while one is live (under the policy row's
/// lock): a halt or promotion of the first moves its canary regions on,
/// a rollout over it could not (agents never take a lower version).
pub async fn refuse_if_live(conn: &mut PgConnection, tenant: &str, resource: &str) -> Result<()> {
    match lock_live(conn, tenant, resource).await? {
        Some(live) => {
            Err(Error::RolloutInProgress { quota: format!("{tenant}/{resource}"), version: live.to_version })
        }
        None => Ok(()),
    }
}

/// Refuses canary regions no agent ever registered in (a typo would make a
/// rollout that can never be promoted).
pub async fn check_regions_known(conn: &mut PgConnection, plan: &Plan) -> Result<()> {
    let unknown = sqlx::query_file_scalar!("src/sql/rollout_unknown_regions.sql", &plan.canary_regions)
        .fetch_all(conn)
        .await?;
    match unknown.first().and_then(|u| plan.canary_regions.iter().position(|r| r == u)) {
        Some(i) => Err(Error::invalid(
            format!("rollout.canary_regions[{i}]"),
            format!("no agent of region {} ever registered", plan.canary_regions[i]),
        )),
        None => Ok(()),
    }
}

/// The version the next write of the quota takes (under the policy row's lock).
pub async fn next_version(conn: &mut PgConnection, tenant: &str, resource: &str) -> Result<i64> {
    Ok(sqlx::query_file_scalar!("src/sql/policy_next_version.sql", tenant, resource).fetch_one(conn).await?)
}

/// Ends the quota's live rollout, if any, because `version` is written
/// over it (under the policy row's lock).
pub async fn supersede(
    conn: &mut PgConnection,
    m: &quota_shared::prom::Registry,
    (tenant, resource): (&str, &str),
    now: DateTime<Utc>,
    who: &str,
    version: i64,
) -> Result<()> {
    let Some(live) = lock_live(&mut *conn, tenant, resource).await? else { return Ok(()) };
    let reason = format!("superseded by version {version}");
    end(conn, (tenant, resource), live.to_version, RolloutState::Superseded, now, who, &reason, None, None)
        .await?;
    m.inc("allocator_rollouts_total", &[("outcome", "superseded")]);
    Ok(())
}

#[allow(clippy::too_many_arguments)]
async fn end(
    conn: &mut PgConnection,
    (tenant, resource): (&str, &str),
    to_version: i64,
    state: RolloutState,
    now: DateTime<Utc>,
    who: &str,
    reason: &str,
    halted_to: Option<i64>,
    measured: Option<&RolloutMeasured>,
) -> Result<()> {
    let measured =
        measured.map(serde_json::to_value).transpose().map_err(|e| Error::Internal(Box::new(e)))?;
    sqlx::query_file!(
        "src/sql/rollout_end.sql",
        tenant,
        resource,
        to_version,
        state.as_str(),
        now,
        who,
        reason,
        halted_to,
        measured
    )
    .execute(conn)
    .await?;
    Ok(())
}

/// Starts a rollout of `r` as `version` (under the policy row's lock, the
/// quota's live rollout already superseded): the candidate's version row,
/// the rollout row, the open pools' limit and allowance (the larger of
/// the two versions'), and the ledger event.
#[allow(clippy::too_many_arguments)]
pub async fn start(
    conn: &mut PgConnection,
    (tenant, resource): (&str, &str),
    r: &Resolved,
    plan: &Plan,
    current: &PolicyRow,
    version: i64,
    now: DateTime<Utc>,
    who: &str,
) -> Result<()> {
    sqlx::query_file!(
        "src/sql/policy_version_candidate.sql",
        tenant,
        resource,
        version,
        r.limit,
        r.window_secs,
        r.chunk_min,
        r.chunk_max,
        r.lease_ttl_secs,
        r.fallback_per_region,
        r.fail_mode.as_str(),
        now,
        who,
        r.per_key.map(|p| p.0),
        r.per_key.map(|p| p.1),
        r.enforce,
        r.on_stale.as_str(),
        serde_json::to_value(&r.reserve).map_err(|e| Error::Internal(Box::new(e)))?
    )
    .execute(&mut *conn)
    .await?;
    sqlx::query_file!(
        "src/sql/rollout_insert.sql",
        tenant,
        resource,
        version,
        current.version,
        &plan.canary_regions,
        plan.soak_secs as i32,
        plan.halt_factor,
        plan.min_decisions,
        now,
        who
    )
    .execute(&mut *conn)
    .await?;
    let pool_limit = r.limit.max(current.limit_tokens);
    let pool_allowance =
        crate::policies::allowance(r.fail_mode, r.fallback_per_region).max(current.fallback_allowance());
    sqlx::query_file!(
        "src/sql/pool_apply_policy.sql",
        tenant,
        resource,
        pool_limit,
        pool_allowance,
        now.timestamp()
    )
    .execute(&mut *conn)
    .await?;
    ledger::append(
        conn,
        now,
        Kind::PolicyChanged,
        NewEvent {
            tenant: Some(tenant.into()),
            resource: Some(resource.into()),
            tokens: Some(r.limit),
            reason: Some(format!(
                "rollout of version {version} to {} by {who}",
                plan.canary_regions.join(", ")
            )),
            detail: Some(serde_json::json!({
                "changed_by": who, "changed_at": now,
                "rollout": {"state": "canary", "version": version, "from_version": current.version,
                            "canary_regions": plan.canary_regions, "soak_secs": plan.soak_secs,
                            "halt_factor": plan.halt_factor, "min_decisions": plan.min_decisions,
                            "limit": r.limit},
            })),
            ..Default::default()
        },
    )
    .await?;
    Ok(())
}

/// The quota's latest rollout, if it ever had one.
pub async fn latest(conn: &mut PgConnection, tenant: &str, resource: &str) -> Result<Option<Rollout>> {
    let Some(r) =
        sqlx::query_file!("src/sql/rollout_latest.sql", tenant, resource).fetch_optional(conn).await?
    else {
        return Ok(None);
    };
    let soak_secs = i64::from(r.soak_secs);
    Ok(Some(Rollout {
        state: RolloutState::parse(&r.state).unwrap_or(RolloutState::Superseded),
        version: r.to_version,
        from_version: r.from_version,
        limit: r.limit_tokens.unwrap_or(0),
        canary_regions: r.canary_regions,
        soak_secs,
        halt_factor: r.halt_factor,
        min_decisions: r.min_decisions,
        started_at: r.started_at,
        started_by: r.started_by,
        soak_ends_at: r.started_at + chrono::Duration::seconds(soak_secs),
        ended_at: r.ended_at,
        ended_by: r.ended_by,
        reason: r.reason,
        halted_to_version: r.halted_to_version,
        measured: r.measured.and_then(|m| serde_json::from_value(m).ok()),
    }))
}

/// `policy` as an answer shows it: with the quota's latest rollout.
pub async fn with_rollout(conn: &mut PgConnection, row: &PolicyRow) -> Result<Policy> {
    let mut p = row.to_wire();
    p.rollout = latest(conn, &row.tenant, &row.resource).await?;
    Ok(p)
}

/// What ends a live rollout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Promote,
    Halt,
}

/// Promotes or halts the quota's live rollout (by hand, or the watcher's
/// verdict): `expect` names the candidate the caller means (a call about
/// another one changes nothing: `not_current_rollout`).
pub async fn act(
    state: &AppState,
    (tenant, resource): (&str, &str),
    action: Action,
    who: &str,
    expect: Option<i64>,
    reason: &str,
    measured: Option<&RolloutMeasured>,
) -> Result<Policy> {
    let mut tx = crate::tx::begin(&state.db).await?;
    let now = state.db_clock.now(&mut tx).await?;
    if sqlx::query_file!("src/sql/policy_lock_version.sql", tenant, resource)
        .fetch_optional(&mut *tx)
        .await?
        .is_none()
    {
        return Err(Error::UnknownQuota(format!("{tenant}/{resource}")));
    }
    let Some(live) = lock_live(&mut tx, tenant, resource).await? else {
        return Err(Error::NoLiveRollout(format!("{tenant}/{resource}")));
    };
    if let Some(asked) = expect.filter(|v| *v != live.to_version) {
        return Err(Error::NotCurrentRollout {
            quota: format!("{tenant}/{resource}"),
            asked,
            live: live.to_version,
        });
    }
    let (row, outcome, halted_to) = match action {
        Action::Promote => {
            let row = sqlx::query_file_as!(
                PolicyRow,
                "src/sql/policy_publish_version.sql",
                tenant,
                resource,
                live.to_version,
                live.to_version,
                now,
                who
            )
            .fetch_one(&mut *tx)
            .await?;
            sqlx::query_file!(
                "src/sql/policy_version_in_force.sql",
                tenant,
                resource,
                live.to_version,
                now,
                who
            )
            .execute(&mut *tx)
            .await?;
            (row, RolloutState::Promoted, None)
        }
        Action::Halt => {
            let version = next_version(&mut tx, tenant, resource).await?;
            let row = sqlx::query_file_as!(
                PolicyRow,
                "src/sql/policy_renumber.sql",
                tenant,
                resource,
                version,
                now,
                who
            )
            .fetch_one(&mut *tx)
            .await?;
            sqlx::query_file!("src/sql/policy_version_insert.sql", tenant, resource, version)
                .execute(&mut *tx)
                .await?;
            (row, RolloutState::Halted, Some(version))
        }
    };
    // I9: the open pools take the limit now in force everywhere.
    sqlx::query_file!(
        "src/sql/pool_apply_policy.sql",
        tenant,
        resource,
        row.limit_tokens,
        row.fallback_allowance(),
        now.timestamp()
    )
    .execute(&mut *tx)
    .await?;
    end(&mut tx, (tenant, resource), live.to_version, outcome, now, who, reason, halted_to, measured).await?;
    let wire = row.to_wire();
    ledger::append(
        &mut tx,
        now,
        Kind::PolicyChanged,
        NewEvent {
            tenant: Some(tenant.into()),
            resource: Some(resource.into()),
            tokens: Some(row.limit_tokens),
            reason: Some(format!("rollout of version {} {} by {who}", live.to_version, outcome.as_str())),
            detail: Some(serde_json::json!({
                "changed_by": who, "changed_at": now,
                "rollout": {"state": outcome.as_str(), "version": live.to_version,
                            "from_version": live.from_version, "reason": reason,
                            "halted_to_version": halted_to, "measured": measured},
                "policy": wire,
            })),
            ..Default::default()
        },
    )
    .await?;
    let policy = with_rollout(&mut tx, &row).await?;
    tx.commit().await?;
    state.metrics.inc("allocator_rollouts_total", &[("outcome", outcome.as_str())]);
    tracing::info!(%tenant, %resource, candidate = live.to_version, version = row.version,
        outcome = outcome.as_str(), %who, %reason, "rollout ended");
    Ok(policy)
}

/// `POST /v1/policies/{tenant}/{resource}/rollout/promote`: the live
/// rollout's candidate goes into force everywhere now.
#[utoipa::path(
    post,
    path = "/v1/policies/{tenant}/{resource}/rollout/promote",
    params(("tenant" = String, Path), ("resource" = String, Path)),
    request_body(content = Option<RolloutAction>, description = "Optional: `version` names the candidate meant"),
    responses(
        (status = 200, description = "The policy now in force (the candidate), with the rollout ended", body = Policy),
        (status = 401, description = "Missing or wrong admin token", body = ErrorBody),
        (status = 404, description = "Unknown quota", body = ErrorBody),
        (status = 409, description = "no_live_rollout: nothing to promote; not_current_rollout: `version` is not the live rollout's candidate", body = ErrorBody),
        (status = 422, description = "Invalid identifier or version", body = ErrorBody),
    ),
    security(("admin_token" = [])),
    tag = "policies"
)]
pub(crate) async fn promote(
    State(state): State<AppState>,
    Extension(who): Extension<Principal>,
    ApiPath((tenant, resource)): ApiPath<(String, String)>,
    body: axum::body::Bytes,
) -> Result<Json<Policy>> {
    by_hand(&state, (tenant, resource), Action::Promote, who.0, &body).await
}

/// `POST /v1/policies/{tenant}/{resource}/rollout/halt`: the canary goes
/// back to the version in force, published again under a newer number.
#[utoipa::path(
    post,
    path = "/v1/policies/{tenant}/{resource}/rollout/halt",
    params(("tenant" = String, Path), ("resource" = String, Path)),
    request_body(content = Option<RolloutAction>, description = "Optional: `version` names the candidate meant"),
    responses(
        (status = 200, description = "The policy now in force everywhere (the old one, renumbered), with the rollout ended", body = Policy),
        (status = 401, description = "Missing or wrong admin token", body = ErrorBody),
        (status = 404, description = "Unknown quota", body = ErrorBody),
        (status = 409, description = "no_live_rollout: nothing to halt; not_current_rollout: `version` is not the live rollout's candidate", body = ErrorBody),
        (status = 422, description = "Invalid identifier or version", body = ErrorBody),
    ),
    security(("admin_token" = [])),
    tag = "policies"
)]
pub(crate) async fn halt(
    State(state): State<AppState>,
    Extension(who): Extension<Principal>,
    ApiPath((tenant, resource)): ApiPath<(String, String)>,
    body: axum::body::Bytes,
) -> Result<Json<Policy>> {
    by_hand(&state, (tenant, resource), Action::Halt, who.0, &body).await
}

async fn by_hand(
    state: &AppState,
    (tenant, resource): (String, String),
    action: Action,
    who: &str,
    body: &[u8],
) -> Result<Json<Policy>> {
    check_id("tenant", &tenant)?;
    check_id("resource", &resource)?;
    let expect = parse_optional_json::<RolloutAction>(body)?.and_then(|b| b.version);
    if let Some(v) = expect {
        check_count("version", v, 1)?;
    }
    let reason = match action {
        Action::Promote => format!("promoted by hand by {who}"),
        Action::Halt => format!("halted by hand by {who}"),
    };
    Ok(Json(act(state, (&tenant, &resource), action, who, expect, &reason, None).await?))
}

/// One quota's counts for the watcher: the candidate's in the canary, the
/// old version's elsewhere, from statuses seen since `since`.
async fn measure(
    state: &AppState,
    (tenant, resource): (&str, &str),
    live: &Live,
    now: DateTime<Utc>,
) -> Result<RolloutMeasured> {
    let since = now - chrono::Duration::seconds(STATUS_FRESH_SECS);
    let m = sqlx::query_file!(
        "src/sql/rollout_measure.sql",
        tenant,
        resource,
        live.to_version,
        live.from_version,
        since
    )
    .fetch_one(&state.db)
    .await?;
    Ok(RolloutMeasured {
        at: now,
        new: VersionCounts { version: live.to_version, admitted: m.new_admitted, refused: m.new_refused },
        old: VersionCounts { version: live.from_version, admitted: m.old_admitted, refused: m.old_refused },
    })
}

/// One look at one live rollout, as the round's list read it (ending it
/// locks and checks it again, see [`act`]).
async fn watch_one(state: &AppState, tenant: &str, resource: &str, live: Live) -> Result<()> {
    let now = state.db_clock.now_on(&state.db).await?;
    let measured = measure(state, (tenant, resource), &live, now).await?;
    let age = match now.signed_duration_since(live.started_at).num_seconds() {
        s if s >= 2 * live.soak_secs => Age::Expired,
        s if s >= live.soak_secs => Age::Soaked,
        _ => Age::Soaking,
    };
    let decided = verdict(measured.new, measured.old, live.halt_factor, live.min_decisions, age);
    let (action, reason) = match decided {
        Verdict::Wait => {
            let v = serde_json::to_value(&measured).map_err(|e| Error::Internal(Box::new(e)))?;
            sqlx::query_file!("src/sql/rollout_set_measured.sql", tenant, resource, live.to_version, v)
                .execute(&state.db)
                .await?;
            return Ok(());
        }
        Verdict::Halt(why) => (Action::Halt, why),
        Verdict::Promote(why) => (Action::Promote, why),
    };
    match act(state, (tenant, resource), action, WATCHER, Some(live.to_version), &reason, Some(&measured))
        .await
    {
        // Another replica's watcher (or an operator) ended it first.
        Err(Error::NoLiveRollout(_) | Error::NotCurrentRollout { .. }) => Ok(()),
        r => r.map(|_| ()),
    }
}

/// The watcher: every [`WATCH_EVERY`], each live rollout (at most
/// [`MAX_WATCHED`], oldest first) is looked at once. Errors are logged and
/// the next round tries again.
pub async fn watch(state: AppState) {
    let mut tick = tokio::time::interval(WATCH_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let live = match sqlx::query_file!("src/sql/rollout_live_list.sql", MAX_WATCHED)
            .fetch_all(&state.db)
            .await
        {
            Ok(rows) => rows,
            Err(e) => {
                tracing::debug!(error = %e, "rollout watcher: cannot list live rollouts");
                continue;
            }
        };
        for r in live {
            let l = Live {
                to_version: r.to_version,
                from_version: r.from_version,
                soak_secs: i64::from(r.soak_secs),
                halt_factor: r.halt_factor,
                min_decisions: r.min_decisions,
                started_at: r.started_at,
            };
            if let Err(e) = watch_one(&state, &r.tenant, &r.resource, l).await {
                tracing::warn!(tenant = %r.tenant, resource = %r.resource, error = %e, "rollout watcher round failed");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(version: i64, admitted: i64, refused: i64) -> VersionCounts {
        VersionCounts { version, admitted, refused }
    }

    #[test]
    fn a_canary_refusing_far_more_than_the_old_version_halts() {
        // F25: 1,000/min published as 10/min refuses 99 % in the canary.
        let v = verdict(c(8, 10, 990), c(7, 1000, 0), 2.0, 100, Age::Soaking);
        assert!(matches!(v, Verdict::Halt(ref why) if why.contains("99.0 %")), "{v:?}");
        // Twice the old rate is not above it; a hair more is.
        assert_eq!(verdict(c(8, 80, 20), c(7, 90, 10), 2.0, 100, Age::Soaking), Verdict::Wait);
        assert!(matches!(verdict(c(8, 79, 21), c(7, 90, 10), 2.0, 100, Age::Soaking), Verdict::Halt(_)));
    }

    #[test]
    fn small_rates_and_few_decisions_never_halt() {
        // At or below the floor, whatever the old version refused.
        assert_eq!(verdict(c(8, 990, 10), c(7, 1000, 0), 2.0, 100, Age::Soaking), Verdict::Wait);
        // Not enough decisions under the new version yet: neither halt nor promote.
        assert_eq!(verdict(c(8, 0, 99), c(7, 1000, 0), 2.0, 100, Age::Soaked), Verdict::Wait);
        // Still not enough in twice the soak time: halted, the safe side.
        let v = verdict(c(8, 60, 0), c(7, 1000, 0), 2.0, 100, Age::Expired);
        assert!(matches!(v, Verdict::Halt(ref why) if why.contains("60 of the 100")), "{v:?}");
        assert!(matches!(verdict(c(8, 100, 0), c(7, 1000, 0), 2.0, 100, Age::Expired), Verdict::Promote(_)));
    }

    #[test]
    fn a_soaked_rollout_is_promoted_unless_it_must_halt() {
        assert!(matches!(verdict(c(8, 200, 0), c(7, 1000, 0), 2.0, 100, Age::Soaked), Verdict::Promote(_)));
        // Both versions refuse alike (the quota is simply spent): promoted.
        assert!(matches!(verdict(c(8, 50, 50), c(7, 500, 500), 2.0, 100, Age::Soaked), Verdict::Promote(_)));
        assert!(matches!(verdict(c(8, 50, 50), c(7, 1000, 0), 2.0, 100, Age::Soaked), Verdict::Halt(_)));
    }

    #[test]
    fn the_rollout_fields_are_checked_and_named() {
        let spec = |regions: &[&str]| RolloutSpec {
            canary_regions: regions.iter().map(|r| r.to_string()).collect(),
            ..Default::default()
        };
        let p = resolve(&spec(&["eu"])).unwrap();
        assert_eq!((p.soak_secs, p.halt_factor, p.min_decisions), (300, 2.0, 100));
        let field = |s: RolloutSpec| match resolve(&s) {
            Err(Error::InvalidField { field, .. }) => field,
            other => panic!("{other:?}"),
        };
        assert_eq!(field(spec(&[])), "rollout.canary_regions");
        assert_eq!(field(spec(&["eu", "eu"])), "rollout.canary_regions[1]");
        assert_eq!(field(spec(&["bad region"])), "rollout.canary_regions[0]");
        assert_eq!(field(RolloutSpec { soak_secs: Some(0), ..spec(&["eu"]) }), "rollout.soak_secs");
        assert_eq!(field(RolloutSpec { halt_factor: Some(0.5), ..spec(&["eu"]) }), "rollout.halt_factor");
        assert_eq!(
            field(RolloutSpec { halt_factor: Some(f64::NAN), ..spec(&["eu"]) }),
            "rollout.halt_factor"
        );
        assert_eq!(field(RolloutSpec { min_decisions: Some(0), ..spec(&["eu"]) }), "rollout.min_decisions");
    }
}
