//! Versioned policies (DESIGN §2) and I9: a new limit governs new grants in
//! the open window at once and every later window opens with it, without
//! deleting any state.
//!
//! Defaults for omitted fields:
//! `chunk_min = max(1, limit / 100)`, `chunk_max = max(chunk_min, limit / 10)`,
//! `lease_ttl_secs = min(window_secs, 30)`, `fail_mode = bounded`,
//! `fallback_per_region = limit / 100` in bounded mode and 0 in strict mode,
//! no `per_key` bucket, `enforce = true`, `on_stale = keep`, no `reserve`.
//!
//! A concurrency policy (`kind: "concurrency"`, a global semaphore) takes
//! `max_in_flight` (required), `permit_ttl_secs` (default 60) and
//! `fail_mode`, and no field of a rate policy. It is stored in the same
//! row: `limit_tokens` is `max_in_flight` and the rate columns hold fixed
//! placeholders ([`concurrency_placeholders`]). A quota's kind never
//! changes once written.

use crate::error::{Error, Result};
use crate::http::auth::Principal;
use crate::http::extract::{check_count, check_id, ApiJson, ApiPath, MAX_COUNT};
use crate::ledger::{self, Kind, NewEvent};
use crate::state::AppState;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::{Extension, Json};
use chrono::{DateTime, Utc};
use quota_shared::wire::{
    ErrorBody, FailMode, OnStale, PerKey, Policy, PolicyKind, PolicySpec, Reserve, ReserveSpec,
};
use serde::{Deserialize, Serialize};
use sqlx::{PgConnection, PgPool};
use utoipa::ToSchema;

/// Most versions one call lists: far more than any quota is edited, and a
/// bound on the answer all the same.
pub const MAX_VERSIONS: i64 = 10_000;

/// Largest `max_in_flight` of a concurrency policy.
pub const MAX_IN_FLIGHT: i64 = 1_000_000;

/// Longest `permit_ttl_secs` of a concurrency policy (a day).
pub const MAX_PERMIT_TTL_SECS: i64 = 86_400;

/// `permit_ttl_secs` when a concurrency policy omits it.
pub const DEFAULT_PERMIT_TTL_SECS: i64 = 60;

/// One version of a policy, with who wrote it and when.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct PolicyVersion {
    pub version: i64,
    pub limit: i64,
    pub window_secs: i64,
    pub chunk_min: i64,
    pub chunk_max: i64,
    pub lease_ttl_secs: i64,
    pub fallback_per_region: i64,
    /// `bounded` or `strict`.
    pub fail_mode: String,
    /// The per-key bucket's rate (milli-tokens per second, as stored: the
    /// policy's `per_key.rate_per_sec` × 1000) and size, when this version
    /// had one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub per_key_rate_milli: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub per_key_burst: Option<i64>,
    /// `false`: this version was in shadow mode.
    pub enforce: bool,
    /// `keep` or `fail_mode`: what a partitioned agent does once this
    /// version is older than its maximum policy age.
    pub on_stale: String,
    /// This version's reserves (`[{up_to_priority, pct}]`).
    #[schema(value_type = Vec<Reserve>)]
    pub reserve: serde_json::Value,
    /// `rate` or `concurrency` (then `limit` is its `max_in_flight`).
    pub kind: String,
    /// Concurrency versions only: the life of a permit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub permit_ttl_secs: Option<i32>,
    /// The token name of the writer: `admin`, or `anonymous/loopback`
    /// when no admin token is configured.
    pub changed_by: String,
    pub changed_at: DateTime<Utc>,
}

/// `GET /v1/policies/{tenant}/{resource}/versions` answer.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct PolicyVersions {
    pub tenant: String,
    pub resource: String,
    /// Oldest first.
    pub versions: Vec<PolicyVersion>,
}

/// A policy row.
#[derive(Debug, Clone)]
pub struct PolicyRow {
    pub tenant: String,
    pub resource: String,
    pub limit_tokens: i64,
    pub window_secs: i64,
    pub chunk_min: i64,
    pub chunk_max: i64,
    pub lease_ttl_secs: i64,
    pub fallback_per_region: i64,
    pub fail_mode: String,
    pub per_key_rate_milli: Option<i64>,
    pub per_key_burst: Option<i64>,
    pub enforce: bool,
    pub on_stale: String,
    /// `[{up_to_priority, pct}]`, validated when written.
    pub reserve: serde_json::Value,
    /// `rate` or `concurrency` (checked by the schema).
    pub kind: String,
    /// Concurrency policies only (and always).
    pub permit_ttl_secs: Option<i32>,
    pub version: i64,
    pub updated_at: DateTime<Utc>,
}

impl PolicyRow {
    /// The policy's fail mode (the column is checked by the schema).
    pub fn fail_mode(&self) -> FailMode {
        FailMode::parse(&self.fail_mode).unwrap_or(FailMode::Strict)
    }

    /// The policy's kind (the column is checked by the schema).
    pub fn kind(&self) -> PolicyKind {
        PolicyKind::parse(&self.kind).unwrap_or_default()
    }

    /// `max_in_flight` and `permit_ttl_secs` of a concurrency policy.
    pub fn concurrency(&self) -> Option<(i64, i64)> {
        match self.kind() {
            PolicyKind::Concurrency => {
                Some((self.limit_tokens, self.permit_ttl_secs.map_or(DEFAULT_PERMIT_TTL_SECS, i64::from)))
            }
            PolicyKind::Rate => None,
        }
    }

    /// Fallback allowance a region gets per window under this policy.
    pub fn fallback_allowance(&self) -> i64 {
        allowance(self.fail_mode(), self.fallback_per_region)
    }

    /// The reserves (written validated; a row that does not parse has none).
    pub fn reserve(&self) -> Vec<Reserve> {
        serde_json::from_value(self.reserve.clone()).unwrap_or_default()
    }

    /// Wire form.
    pub fn to_wire(&self) -> Policy {
        Policy {
            tenant: self.tenant.clone(),
            resource: self.resource.clone(),
            limit: self.limit_tokens,
            window_secs: self.window_secs,
            chunk_min: self.chunk_min,
            chunk_max: self.chunk_max,
            lease_ttl_secs: self.lease_ttl_secs,
            fallback_per_region: self.fallback_per_region,
            fail_mode: self.fail_mode(),
            per_key: PerKey::from_stored(self.per_key_rate_milli, self.per_key_burst),
            enforce: self.enforce,
            on_stale: OnStale::parse(&self.on_stale).unwrap_or_default(),
            reserve: self.reserve(),
            kind: self.kind(),
            max_in_flight: self.concurrency().map(|c| c.0),
            permit_ttl_secs: self.concurrency().map(|c| c.1),
            version: self.version,
            updated_at: self.updated_at,
            rollout: None,
        }
    }
}

/// The fallback allowance a region gets per window under `mode` with
/// `fallback_per_region` (none in strict mode).
pub fn allowance(mode: FailMode, fallback_per_region: i64) -> i64 {
    match mode {
        FailMode::Bounded => fallback_per_region,
        FailMode::Strict => 0,
    }
}

/// A spec with defaults filled in and every rule checked.
#[derive(Debug, Clone, PartialEq)]
pub struct Resolved {
    pub limit: i64,
    pub window_secs: i64,
    pub chunk_min: i64,
    pub chunk_max: i64,
    pub lease_ttl_secs: i64,
    pub fallback_per_region: i64,
    pub fail_mode: FailMode,
    /// `(rate in milli-tokens per second, burst)`.
    pub per_key: Option<(i64, i64)>,
    /// `false`: shadow mode.
    pub enforce: bool,
    pub on_stale: OnStale,
    pub reserve: Vec<Reserve>,
    pub kind: PolicyKind,
    /// Concurrency policies only.
    pub permit_ttl_secs: Option<i64>,
}

/// Checks a per-key bucket: `0.001 ≤ rate_per_sec ≤ 10⁹` (a whole number of
/// milli-tokens per second) and `1 ≤ burst ≤ 10⁹`; answers `(rate_milli, burst)`.
pub fn resolve_per_key(p: &PerKey) -> Result<(i64, i64)> {
    let max = PerKey::MAX as f64;
    if !p.rate_per_sec.is_finite() || !(0.001..=max).contains(&p.rate_per_sec) {
        return Err(Error::invalid(
            "per_key.rate_per_sec",
            format!("must be between 0.001 and {}, got {}", PerKey::MAX, p.rate_per_sec),
        ));
    }
    if !(1..=PerKey::MAX).contains(&p.burst) {
        return Err(Error::invalid(
            "per_key.burst",
            format!("must be between 1 and {}, got {}", PerKey::MAX, p.burst),
        ));
    }
    Ok((p.rate_milli().max(1), p.burst))
}

/// Checks the reserves: at most 4, `up_to_priority` 0 to 3 and each once,
/// `pct` 1 to 100, summing to at most 100.
pub fn resolve_reserve(reserve: &[ReserveSpec]) -> Result<Vec<Reserve>> {
    if reserve.len() > 4 {
        return Err(Error::invalid(
            "reserve",
            format!("at most 4 entries (one per up_to_priority), got {}", reserve.len()),
        ));
    }
    for (i, r) in reserve.iter().enumerate() {
        if r.up_to_priority > 3 {
            return Err(Error::invalid(
                format!("reserve[{i}].up_to_priority"),
                format!(
                    "must be between 0 and 3 (a reserve for priority 4 would hold back nothing), got {}",
                    r.up_to_priority
                ),
            ));
        }
        if !(1..=100).contains(&r.pct) {
            return Err(Error::invalid(
                format!("reserve[{i}].pct"),
                format!("must be between 1 and 100, got {}", r.pct),
            ));
        }
        if reserve[..i].iter().any(|o| o.up_to_priority == r.up_to_priority) {
            return Err(Error::invalid(
                format!("reserve[{i}].up_to_priority"),
                format!("{} is listed twice", r.up_to_priority),
            ));
        }
    }
    let total: i64 = reserve.iter().map(|r| r.pct).sum();
    if total > 100 {
        return Err(Error::invalid("reserve", format!("the shares sum to {total} %, above 100")));
    }
    let mut sorted: Vec<Reserve> =
        reserve.iter().map(|r| Reserve { up_to_priority: r.up_to_priority, pct: r.pct }).collect();
    sorted.sort_by_key(|r| r.up_to_priority);
    Ok(sorted)
}

/// Fills defaults and validates a spec of either kind (absent: rate); see
/// [`resolve_rate`] and [`resolve_concurrency`].
pub fn resolve(spec: &PolicySpec) -> Result<Resolved> {
    match spec.kind.unwrap_or_default() {
        PolicyKind::Rate => resolve_rate(spec),
        PolicyKind::Concurrency => resolve_concurrency(spec),
    }
}

/// The fields a concurrency policy does not take, each with whether the
/// spec gives it (`limit` and `window_secs` read 0 when absent, `enforce`
/// may be given as `true`, the only value a concurrency policy has).
fn rate_only_fields(spec: &PolicySpec) -> [(&'static str, bool); 10] {
    [
        ("limit", spec.limit != 0),
        ("window_secs", spec.window_secs != 0),
        ("chunk_min", spec.chunk_min.is_some()),
        ("chunk_max", spec.chunk_max.is_some()),
        ("lease_ttl_secs", spec.lease_ttl_secs.is_some()),
        ("fallback_per_region", spec.fallback_per_region.is_some()),
        ("per_key", spec.per_key.is_some()),
        ("enforce", spec.enforce == Some(false)),
        ("on_stale", spec.on_stale.is_some()),
        ("reserve", spec.reserve.is_some()),
    ]
}

/// What a concurrency policy stores in the rate columns of its row:
/// `(window_secs, chunk_min, chunk_max, lease_ttl_secs)`, chosen to meet
/// the row's constraints (`limit_tokens` is `max_in_flight` ≥ 1). Nothing
/// reads them: grants refuse the quota.
pub fn concurrency_placeholders() -> (i64, i64, i64, i64) {
    (86_400, 1, 1, 30)
}

/// A concurrency policy: `1 ≤ max_in_flight ≤ 1,000,000` (required),
/// `1 ≤ permit_ttl_secs ≤ 86,400` (default 60), `fail_mode` as given (its
/// fallback allowance is 0 in both modes), and no field of a rate policy.
pub fn resolve_concurrency(spec: &PolicySpec) -> Result<Resolved> {
    for (field, given) in rate_only_fields(spec) {
        if given {
            return Err(Error::invalid(
                field,
                "not a field of a concurrency policy (it takes max_in_flight, permit_ttl_secs and fail_mode)",
            ));
        }
    }
    let max_in_flight = spec.max_in_flight.ok_or_else(|| {
        Error::invalid("max_in_flight", "required for a concurrency policy: the most permits held at once")
    })?;
    if !(1..=MAX_IN_FLIGHT).contains(&max_in_flight) {
        return Err(Error::invalid(
            "max_in_flight",
            format!("must be between 1 and {MAX_IN_FLIGHT}, got {max_in_flight}"),
        ));
    }
    let permit_ttl_secs = spec.permit_ttl_secs.unwrap_or(DEFAULT_PERMIT_TTL_SECS);
    if !(1..=MAX_PERMIT_TTL_SECS).contains(&permit_ttl_secs) {
        return Err(Error::invalid(
            "permit_ttl_secs",
            format!("must be between 1 and {MAX_PERMIT_TTL_SECS}, got {permit_ttl_secs}"),
        ));
    }
    let (window_secs, chunk_min, chunk_max, lease_ttl_secs) = concurrency_placeholders();
    Ok(Resolved {
        limit: max_in_flight,
        window_secs,
        chunk_min,
        chunk_max,
        lease_ttl_secs,
        fallback_per_region: 0,
        fail_mode: spec.fail_mode.unwrap_or_default(),
        per_key: None,
        enforce: true,
        on_stale: OnStale::Keep,
        reserve: Vec::new(),
        kind: PolicyKind::Concurrency,
        permit_ttl_secs: Some(permit_ttl_secs),
    })
}

/// A rate policy: fills defaults and validates: `limit` given,
/// `window_secs` divides 86,400, `chunk_min ≤ chunk_max ≤ limit`,
/// `1 ≤ lease_ttl_secs ≤ window_secs`, `0 ≤ fallback_per_region ≤ limit`,
/// no fallback in strict mode, and no field of a concurrency policy.
pub fn resolve_rate(spec: &PolicySpec) -> Result<Resolved> {
    for (field, given) in
        [("max_in_flight", spec.max_in_flight.is_some()), ("permit_ttl_secs", spec.permit_ttl_secs.is_some())]
    {
        if given {
            return Err(Error::invalid(field, "not a field of a rate policy (only of kind \"concurrency\")"));
        }
    }
    if spec.limit == 0 {
        return Err(Error::invalid("limit", "required for a rate policy: tokens per window, at least 1"));
    }
    check_count("limit", spec.limit, 1)?;
    if spec.window_secs == 0 {
        return Err(Error::invalid(
            "window_secs",
            "required for a rate policy: the window length, a positive divisor of 86400",
        ));
    }
    if !quota_shared::window::valid_window_secs(spec.window_secs) {
        return Err(Error::invalid(
            "window_secs",
            format!("must be a positive divisor of 86400, got {}", spec.window_secs),
        ));
    }
    let limit = spec.limit;
    let chunk_min = spec.chunk_min.unwrap_or_else(|| (limit / 100).max(1));
    check_count("chunk_min", chunk_min, 1)?;
    let chunk_max = spec.chunk_max.unwrap_or_else(|| (limit / 10).max(chunk_min).min(limit));
    check_count("chunk_max", chunk_max, 1)?;
    if chunk_min > chunk_max {
        return Err(Error::invalid("chunk_min", format!("{chunk_min} is above chunk_max {chunk_max}")));
    }
    if chunk_max > limit {
        return Err(Error::invalid("chunk_max", format!("{chunk_max} is above limit {limit}")));
    }
    let lease_ttl_secs = spec.lease_ttl_secs.unwrap_or_else(|| spec.window_secs.min(30));
    if !(1..=spec.window_secs).contains(&lease_ttl_secs) {
        return Err(Error::invalid(
            "lease_ttl_secs",
            format!("must be between 1 and window_secs ({}), got {lease_ttl_secs}", spec.window_secs),
        ));
    }
    let fail_mode = spec.fail_mode.unwrap_or_default();
    let fallback_per_region = spec.fallback_per_region.unwrap_or(match fail_mode {
        FailMode::Bounded => limit / 100,
        FailMode::Strict => 0,
    });
    check_count("fallback_per_region", fallback_per_region, 0)?;
    if fallback_per_region > limit.min(MAX_COUNT) {
        return Err(Error::invalid(
            "fallback_per_region",
            format!("{fallback_per_region} is above limit {limit}"),
        ));
    }
    if fail_mode == FailMode::Strict && fallback_per_region > 0 {
        return Err(Error::invalid("fallback_per_region", "must be 0 when fail_mode is strict"));
    }
    let per_key = spec.per_key.as_ref().map(resolve_per_key).transpose()?;
    Ok(Resolved {
        per_key,
        enforce: spec.enforce.unwrap_or(true),
        on_stale: spec.on_stale.unwrap_or_default(),
        reserve: resolve_reserve(spec.reserve.as_deref().unwrap_or_default())?,
        limit,
        window_secs: spec.window_secs,
        chunk_min,
        chunk_max,
        lease_ttl_secs,
        fallback_per_region,
        fail_mode,
        kind: PolicyKind::Rate,
        permit_ttl_secs: None,
    })
}

/// Refuses to change a quota's kind (`was` is the stored one).
pub fn check_kind_unchanged(tenant: &str, resource: &str, was: PolicyKind, now: PolicyKind) -> Result<()> {
    if was == now {
        return Ok(());
    }
    Err(Error::invalid(
        "kind",
        format!(
            "quota {tenant}/{resource} is a {} policy; its kind cannot change (asked for {})",
            was.as_str(),
            now.as_str()
        ),
    ))
}

/// Loads the policy of a quota, if any.
#[tracing::instrument(level = "debug", skip_all, fields(tenant = %tenant, resource = %resource))]
pub async fn load(conn: &mut PgConnection, tenant: &str, resource: &str) -> Result<Option<PolicyRow>> {
    Ok(sqlx::query_file_as!(PolicyRow, "src/sql/policy_get.sql", tenant, resource)
        .fetch_optional(conn)
        .await?)
}

/// Loads the policy of a quota or answers 404.
pub async fn require(conn: &mut PgConnection, tenant: &str, resource: &str) -> Result<PolicyRow> {
    load(conn, tenant, resource).await?.ok_or_else(|| Error::UnknownQuota(format!("{tenant}/{resource}")))
}

/// The policy version in force at `at` (the latest written at or before it).
#[tracing::instrument(level = "debug", skip_all, fields(tenant = %tenant, resource = %resource, %at))]
pub async fn at(db: &PgPool, tenant: &str, resource: &str, at: DateTime<Utc>) -> Result<Option<PolicyRow>> {
    Ok(sqlx::query_file_as!(PolicyRow, "src/sql/policy_version_at.sql", tenant, resource, at)
        .fetch_optional(db)
        .await?)
}

/// Every quota's policy, by tenant and resource, at most `limit`.
#[tracing::instrument(level = "debug", skip_all)]
pub async fn list_all(db: &PgPool, limit: i64) -> Result<Vec<PolicyRow>> {
    Ok(sqlx::query_file_as!(PolicyRow, "src/sql/policy_list.sql", limit).fetch_all(db).await?)
}

/// `GET /v1/policies/{tenant}/{resource}/versions`: the whole history.
#[utoipa::path(
    get,
    path = "/v1/policies/{tenant}/{resource}/versions",
    params(("tenant" = String, Path), ("resource" = String, Path)),
    responses(
        (status = 200, description = "Every version, oldest first", body = PolicyVersions),
        (status = 401, description = "Missing or wrong admin token", body = ErrorBody),
        (status = 404, description = "Unknown quota", body = ErrorBody),
        (status = 422, description = "Invalid identifier", body = ErrorBody),
    ),
    security(("admin_token" = [])),
    tag = "policies"
)]
pub(crate) async fn list_versions(
    State(state): State<AppState>,
    ApiPath((tenant, resource)): ApiPath<(String, String)>,
) -> Result<Json<PolicyVersions>> {
    check_id("tenant", &tenant)?;
    check_id("resource", &resource)?;
    let versions =
        sqlx::query_file_as!(PolicyVersion, "src/sql/policy_versions.sql", tenant, resource, MAX_VERSIONS)
            .fetch_all(&state.db)
            .await?;
    if versions.is_empty() {
        return Err(Error::UnknownQuota(format!("{tenant}/{resource}")));
    }
    Ok(Json(PolicyVersions { tenant, resource, versions }))
}

/// `GET /v1/policies/{tenant}/{resource}`: the policy in force.
#[utoipa::path(
    get,
    path = "/v1/policies/{tenant}/{resource}",
    params(("tenant" = String, Path), ("resource" = String, Path)),
    responses(
        (status = 200, description = "The policy in force", body = Policy),
        (status = 401, description = "Missing or wrong admin token", body = ErrorBody),
        (status = 404, description = "Unknown quota", body = ErrorBody),
        (status = 422, description = "Invalid identifier", body = ErrorBody),
    ),
    security(("admin_token" = [])),
    tag = "policies"
)]
pub(crate) async fn get_policy(
    State(state): State<AppState>,
    ApiPath((tenant, resource)): ApiPath<(String, String)>,
) -> Result<Json<Policy>> {
    check_id("tenant", &tenant)?;
    check_id("resource", &resource)?;
    let mut conn = state.db.acquire().await?;
    let row = require(&mut conn, &tenant, &resource).await?;
    Ok(Json(crate::rollout::with_rollout(&mut conn, &row).await?))
}

/// `PUT /v1/policies/{tenant}/{resource}`: writes a new version (I9).
#[utoipa::path(
    put,
    path = "/v1/policies/{tenant}/{resource}",
    params(
        ("tenant" = String, Path), ("resource" = String, Path),
        ("If-Match" = Option<String>, Header, description = "Refuse with 412 unless this is the current version"),
    ),
    request_body = PolicySpec,
    responses(
        (status = 200, description = "The policy with its new version", body = Policy),
        (status = 401, description = "Missing or wrong admin token", body = ErrorBody),
        (status = 409, description = "rollout_in_progress: a rollout asked while another of the quota is live", body = ErrorBody),
        (status = 412, description = "If-Match names a version that is no longer the newest written (during a rollout, its candidate)", body = ErrorBody),
        (status = 422, description = "Invalid value; the message and `field` name the field (a field of the other kind of policy; `kind` when it differs from the quota's, which never changes)", body = ErrorBody),
    ),
    security(("admin_token" = [])),
    tag = "policies"
)]
#[tracing::instrument(name = "put_policy", skip_all, fields(tenant = %tenant, resource = %resource, version = tracing::field::Empty))]
pub(crate) async fn put_policy(
    State(state): State<AppState>,
    Extension(who): Extension<Principal>,
    ApiPath((tenant, resource)): ApiPath<(String, String)>,
    headers: HeaderMap,
    ApiJson(spec): ApiJson<PolicySpec>,
) -> Result<Json<Policy>> {
    check_id("tenant", &tenant)?;
    check_id("resource", &resource)?;
    let r = resolve(&spec)?;
    let if_match = match headers.get("if-match") {
        None => None,
        Some(v) => {
            let s = v.to_str().unwrap_or("").trim().trim_matches('"');
            Some(
                s.parse::<i64>()
                    .map_err(|_| Error::invalid("If-Match", "must be a policy version number"))?,
            )
        }
    };
    let plan = spec.rollout.as_ref().map(crate::rollout::resolve).transpose()?;
    let mut tx = crate::tx::begin(&state.db).await?;
    // Which pools are open (I9) is decided on the one clock (I8).
    let now = state.db_clock.now(&mut tx).await?;
    // The row lock serialises concurrent writers so versions stay strictly increasing.
    let locked = sqlx::query_file!("src/sql/policy_lock_version.sql", tenant, resource)
        .fetch_optional(&mut *tx)
        .await?;
    // Above every version written, a rollout's candidate included.
    let version = crate::rollout::next_version(&mut tx, &tenant, &resource).await?;
    tracing::Span::current().record("version", version);
    // If-Match names the newest version written: during a rollout, its
    // candidate (so an edit made from a read older than the rollout fails).
    let newest = (locked.is_some()).then_some(version - 1);
    if let Some(expected) = if_match {
        if newest != Some(expected) {
            return Err(Error::VersionMismatch {
                expected: expected.to_string(),
                current: newest.unwrap_or(0),
            });
        }
    }
    if let Some(was) = locked.as_ref().map(|l| PolicyKind::parse(&l.kind).unwrap_or_default()) {
        check_kind_unchanged(&tenant, &resource, was, r.kind)?;
    }
    if let Some(plan) = &plan {
        crate::rollout::check_rollable(&r, locked.as_ref().map(|l| (l.kind.as_str(), l.window_secs)))?;
        crate::rollout::check_regions_known(&mut tx, plan).await?;
        crate::rollout::refuse_if_live(&mut tx, &tenant, &resource).await?;
    }
    // A write during a live rollout replaces it (roll forward by hand).
    crate::rollout::supersede(&mut tx, &state.metrics, (&tenant, &resource), now, who.0, version).await?;
    if let Some(plan) = plan {
        let in_force = require(&mut tx, &tenant, &resource).await?;
        crate::rollout::start(&mut tx, (&tenant, &resource), &r, &plan, &in_force, version, now, who.0)
            .await?;
        let answer = crate::rollout::with_rollout(&mut tx, &in_force).await?;
        tx.commit().await?;
        state.metrics.inc("allocator_rollouts_total", &[("outcome", "started")]);
        tracing::info!(%tenant, %resource, version, canary = ?plan.canary_regions, limit = r.limit,
            soak_secs = plan.soak_secs, "policy rollout started");
        return Ok(Json(answer));
    }
    let row = sqlx::query_file_as!(
        PolicyRow,
        "src/sql/policy_upsert.sql",
        tenant,
        resource,
        r.limit,
        r.window_secs,
        r.chunk_min,
        r.chunk_max,
        r.lease_ttl_secs,
        r.fallback_per_region,
        r.fail_mode.as_str(),
        version,
        now,
        who.0,
        r.per_key.map(|p| p.0),
        r.per_key.map(|p| p.1),
        r.enforce,
        r.on_stale.as_str(),
        serde_json::to_value(&r.reserve).map_err(|e| Error::Internal(Box::new(e)))?,
        r.kind.as_str(),
        r.permit_ttl_secs.map(|t| t as i32)
    )
    .fetch_one(&mut *tx)
    .await?;
    sqlx::query_file!("src/sql/policy_version_insert.sql", tenant, resource, version)
        .execute(&mut *tx)
        .await?;
    // I9: open and future pools take the new limit now; issued leases stay.
    // A concurrency quota has no pools: a lowered max_in_flight takes
    // effect as regions shrink their permit leases (see crate::permits).
    if r.kind == PolicyKind::Rate {
        sqlx::query_file!(
            "src/sql/pool_apply_policy.sql",
            tenant,
            resource,
            r.limit,
            row.fallback_allowance(),
            now.timestamp()
        )
        .execute(&mut *tx)
        .await?;
    }
    let detail = serde_json::to_value(row.to_wire()).map_err(|e| Error::Internal(Box::new(e)))?;
    ledger::append(
        &mut tx,
        now,
        Kind::PolicyChanged,
        NewEvent {
            tenant: Some(tenant.clone()),
            resource: Some(resource.clone()),
            tokens: Some(r.limit),
            reason: Some(format!("by {}", who.0)),
            detail: Some(serde_json::json!({"changed_by": who.0, "changed_at": now, "policy": detail})),
            ..Default::default()
        },
    )
    .await?;
    let answer = crate::rollout::with_rollout(&mut tx, &row).await?;
    tx.commit().await?;
    tracing::info!(%tenant, %resource, version, kind = r.kind.as_str(), limit = r.limit, "policy written");
    Ok(Json(answer))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(limit: i64, window_secs: i64) -> PolicySpec {
        PolicySpec { limit, window_secs, ..Default::default() }
    }

    fn pk(s: PolicySpec, rate_per_sec: f64, burst: i64) -> PolicySpec {
        PolicySpec { per_key: Some(PerKey { rate_per_sec, burst }), ..s }
    }

    fn rs(s: PolicySpec, entries: &[(u8, i64)]) -> PolicySpec {
        let reserve =
            entries.iter().map(|&(up_to_priority, pct)| ReserveSpec { up_to_priority, pct }).collect();
        PolicySpec { reserve: Some(reserve), ..s }
    }

    #[test]
    fn reserves_are_kept_sorted_by_priority() {
        assert_eq!(resolve(&spec(100, 60)).unwrap().reserve, []);
        let r = resolve(&rs(spec(100, 60), &[(1, 10), (0, 5)])).unwrap().reserve;
        assert_eq!(r, [Reserve { up_to_priority: 0, pct: 5 }, Reserve { up_to_priority: 1, pct: 10 }]);
        assert_eq!(resolve(&rs(spec(100, 60), &[(0, 100)])).unwrap().reserve.len(), 1);
    }

    #[test]
    fn a_per_key_bucket_is_kept_in_whole_milli_tokens() {
        assert_eq!(resolve(&spec(100, 60)).unwrap().per_key, None);
        assert_eq!(resolve(&pk(spec(100, 60), 8.0, 8)).unwrap().per_key, Some((8000, 8)));
        assert_eq!(resolve(&pk(spec(100, 60), 0.0015, 1)).unwrap().per_key, Some((2, 1)));
        assert_eq!(resolve(&pk(spec(100, 60), 0.001, 1)).unwrap().per_key, Some((1, 1)));
        // The burst is the key's own cap: it may exceed the quota's limit
        // (the quota still refuses), so it is not checked against it.
        assert_eq!(resolve(&pk(spec(10, 60), 1.0, 500)).unwrap().per_key, Some((1000, 500)));
    }

    #[test]
    fn defaults_are_documented_fractions_of_the_limit() {
        let r = resolve(&spec(1000, 60)).unwrap();
        assert_eq!((r.chunk_min, r.chunk_max, r.lease_ttl_secs, r.fallback_per_region), (10, 100, 30, 10));
        assert_eq!(r.fail_mode, FailMode::Bounded);
        assert_eq!((r.per_key, r.enforce), (None, true));
        let tiny = resolve(&spec(1, 1)).unwrap();
        assert_eq!(
            (tiny.chunk_min, tiny.chunk_max, tiny.lease_ttl_secs, tiny.fallback_per_region),
            (1, 1, 1, 0)
        );
    }

    fn conc(max_in_flight: Option<i64>) -> PolicySpec {
        PolicySpec { kind: Some(PolicyKind::Concurrency), max_in_flight, ..Default::default() }
    }

    #[test]
    fn a_concurrency_policy_fills_its_placeholders_and_ttl() {
        let r = resolve(&conc(Some(3))).unwrap();
        assert_eq!(r.kind, PolicyKind::Concurrency);
        assert_eq!((r.limit, r.permit_ttl_secs, r.fallback_per_region), (3, Some(60), 0));
        assert_eq!((r.window_secs, r.chunk_min, r.chunk_max, r.lease_ttl_secs), concurrency_placeholders());
        assert_eq!((r.enforce, r.on_stale, r.per_key, r.reserve.len()), (true, OnStale::Keep, None, 0));
        let strict = PolicySpec {
            fail_mode: Some(FailMode::Strict),
            permit_ttl_secs: Some(86_400),
            enforce: Some(true),
            ..conc(Some(MAX_IN_FLIGHT))
        };
        let r = resolve(&strict).unwrap();
        assert_eq!(
            (r.fail_mode, r.permit_ttl_secs, r.limit),
            (FailMode::Strict, Some(86_400), MAX_IN_FLIGHT)
        );
        // Absent kind: rate, as before.
        assert_eq!(resolve(&spec(10, 60)).unwrap().kind, PolicyKind::Rate);
        assert_eq!(resolve(&spec(10, 60)).unwrap().permit_ttl_secs, None);
    }

    #[test]
    fn concurrency_rules_name_the_field() {
        let c = || conc(Some(5));
        let cases = [
            (conc(None), "max_in_flight"),
            (conc(Some(0)), "max_in_flight"),
            (conc(Some(MAX_IN_FLIGHT + 1)), "max_in_flight"),
            (PolicySpec { permit_ttl_secs: Some(0), ..c() }, "permit_ttl_secs"),
            (PolicySpec { permit_ttl_secs: Some(86_401), ..c() }, "permit_ttl_secs"),
            (PolicySpec { limit: 5, ..c() }, "limit"),
            (PolicySpec { window_secs: 60, ..c() }, "window_secs"),
            (PolicySpec { chunk_min: Some(1), ..c() }, "chunk_min"),
            (PolicySpec { chunk_max: Some(1), ..c() }, "chunk_max"),
            (PolicySpec { lease_ttl_secs: Some(1), ..c() }, "lease_ttl_secs"),
            (PolicySpec { fallback_per_region: Some(0), ..c() }, "fallback_per_region"),
            (pk(c(), 1.0, 1), "per_key"),
            (PolicySpec { enforce: Some(false), ..c() }, "enforce"),
            (PolicySpec { on_stale: Some(OnStale::Keep), ..c() }, "on_stale"),
            (rs(c(), &[]), "reserve"),
            // And the concurrency fields on a rate policy.
            (PolicySpec { max_in_flight: Some(5), ..spec(100, 60) }, "max_in_flight"),
            (PolicySpec { permit_ttl_secs: Some(5), ..spec(100, 60) }, "permit_ttl_secs"),
            (PolicySpec { kind: Some(PolicyKind::Rate), ..spec(0, 60) }, "limit"),
            (spec(100, 0), "window_secs"),
        ];
        for (s, field) in cases {
            match resolve(&s) {
                Err(Error::InvalidField { field: f, .. }) => assert_eq!(f, field, "{s:?}"),
                other => panic!("{s:?}: {other:?}"),
            }
        }
        match resolve(&spec(0, 60)) {
            Err(e) => assert!(e.to_string().contains("required for a rate policy"), "{e}"),
            Ok(r) => panic!("{r:?}"),
        }
    }

    #[test]
    fn a_quota_keeps_its_kind() {
        assert!(check_kind_unchanged("a", "b", PolicyKind::Rate, PolicyKind::Rate).is_ok());
        assert!(check_kind_unchanged("a", "b", PolicyKind::Concurrency, PolicyKind::Concurrency).is_ok());
        match check_kind_unchanged("a", "b", PolicyKind::Rate, PolicyKind::Concurrency) {
            Err(Error::InvalidField { field, message }) => {
                assert_eq!(field, "kind");
                assert!(message.contains("quota a/b is a rate policy; its kind cannot change"), "{message}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn rules_name_the_field() {
        let cases = [
            (spec(0, 60), "limit"),
            (spec(10, 7), "window_secs"),
            (PolicySpec { chunk_min: Some(50), chunk_max: Some(10), ..spec(100, 60) }, "chunk_min"),
            (PolicySpec { chunk_max: Some(101), ..spec(100, 60) }, "chunk_max"),
            (PolicySpec { lease_ttl_secs: Some(61), ..spec(100, 60) }, "lease_ttl_secs"),
            (PolicySpec { fallback_per_region: Some(-1), ..spec(100, 60) }, "fallback_per_region"),
            (
                PolicySpec {
                    fail_mode: Some(FailMode::Strict),
                    fallback_per_region: Some(5),
                    ..spec(100, 60)
                },
                "fallback_per_region",
            ),
            (pk(spec(100, 60), 0.0, 5), "per_key.rate_per_sec"),
            (pk(spec(100, 60), 0.0004, 5), "per_key.rate_per_sec"),
            (pk(spec(100, 60), f64::NAN, 5), "per_key.rate_per_sec"),
            (pk(spec(100, 60), 2e9, 5), "per_key.rate_per_sec"),
            (pk(spec(100, 60), 1.0, 0), "per_key.burst"),
            (pk(spec(100, 60), 1.0, PerKey::MAX + 1), "per_key.burst"),
            (rs(spec(100, 60), &[(4, 10)]), "reserve[0].up_to_priority"),
            (rs(spec(100, 60), &[(1, 0)]), "reserve[0].pct"),
            (rs(spec(100, 60), &[(1, 101)]), "reserve[0].pct"),
            (rs(spec(100, 60), &[(1, 10), (1, 5)]), "reserve[1].up_to_priority"),
            (rs(spec(100, 60), &[(0, 60), (1, 50)]), "reserve"),
            (rs(spec(100, 60), &[(0, 1), (1, 1), (2, 1), (3, 1), (0, 1)]), "reserve"),
        ];
        for (s, field) in cases {
            match resolve(&s) {
                Err(Error::InvalidField { field: f, .. }) => assert_eq!(f, field, "{s:?}"),
                other => panic!("{s:?}: {other:?}"),
            }
        }
    }
}
