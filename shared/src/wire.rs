//! JSON bodies of the allocator's HTTP API (DESIGN §5). The agent is the
//! allocator's main client, so both sides compile against these types and a
//! renamed field breaks the build rather than the wire. With the `service`
//! feature each type is also an OpenAPI schema, so both binaries' documents
//! describe the very types they serialise.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// What a region does when it holds no valid lease and cannot reach the
/// allocator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "service", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum FailMode {
    /// Admit up to `fallback_per_region` per window from a region counter.
    #[default]
    Bounded,
    /// Answer `503 allocator_unreachable`.
    Strict,
}

impl FailMode {
    /// The name stored in the database and shown on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            FailMode::Bounded => "bounded",
            FailMode::Strict => "strict",
        }
    }

    /// Parses the stored name.
    pub fn parse(s: &str) -> Option<FailMode> {
        match s {
            "bounded" => Some(FailMode::Bounded),
            "strict" => Some(FailMode::Strict),
            _ => None,
        }
    }
}

/// What an agent does with a policy it could not refresh for longer than
/// its maximum policy age (`--max-policy-age-secs`) because the allocator
/// is unreachable (F24).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "service", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum OnStale {
    /// Keep enforcing the last version learnt (its fallback allowance,
    /// per-key bucket and shadow mode) however long the partition lasts.
    #[default]
    Keep,
    /// Stop trusting the last version and fail as the policy's `fail_mode`
    /// says: `strict` answers `503 policy_stale`; `bounded` admits only the
    /// fallback allowance, enforced even when the version was in shadow
    /// mode.
    FailMode,
}

impl OnStale {
    /// The name stored in the database and shown on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            OnStale::Keep => "keep",
            OnStale::FailMode => "fail_mode",
        }
    }

    /// Parses the stored name.
    pub fn parse(s: &str) -> Option<OnStale> {
        match s {
            "keep" => Some(OnStale::Keep),
            "fail_mode" => Some(OnStale::FailMode),
            _ => None,
        }
    }
}

/// What a policy limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "service", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum PolicyKind {
    /// Tokens per UTC window, leased to regions and spent (the default).
    #[default]
    Rate,
    /// Permits held at once (a global semaphore): leased to regions,
    /// handed out by agents, returned when released or expired.
    Concurrency,
}

impl PolicyKind {
    /// The name stored in the database and shown on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            PolicyKind::Rate => "rate",
            PolicyKind::Concurrency => "concurrency",
        }
    }

    /// Parses the stored name.
    pub fn parse(s: &str) -> Option<PolicyKind> {
        match s {
            "rate" => Some(PolicyKind::Rate),
            "concurrency" => Some(PolicyKind::Concurrency),
            _ => None,
        }
    }
}

/// How long a region's permit lease lasts after an applied request: the
/// permit TTL and a slack of `max(30 s, TTL / 20)`. The agent hands out a
/// permit only when its lease outlives the permit, so a region cut off
/// from the allocator can hand out full-length permits for about the
/// slack after its last renewal, and a region that vanishes strands its
/// permits for at most this long. The slack grows with the TTL so that it
/// always covers the agent's margin for clocks that run at different rates
/// (1 % of the lease, plus a second).
pub fn permit_lease_secs(permit_ttl_secs: i64) -> i64 {
    permit_ttl_secs + (permit_ttl_secs / 20).max(30)
}

/// `POST /v1/permits/lease` body (agent → allocator): set the number of
/// permits region `region` holds for a concurrency quota to `want`, if the
/// region's lease is still at `seq` (compare-and-set: the replicas of a
/// region share one lease, and an answer applied late must not undo a
/// newer one). Every applied request renews the lease.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[cfg_attr(feature = "service", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct PermitLeaseRequest {
    pub tenant: String,
    pub resource: String,
    pub region: String,
    pub agent: String,
    /// The agent's registered epoch (fenced as for grants).
    pub epoch: i64,
    /// The lease's sequence number as the region last applied it (0: the
    /// region knows of no lease).
    pub seq: i64,
    /// Permits the region wants to hold, 0 to `max_in_flight`. Less than
    /// it holds: the rest return to the pool at once. More: granted up to
    /// what the other regions' live leases leave.
    pub want: i64,
}

/// `POST /v1/permits/lease` answer.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[cfg_attr(feature = "service", derive(utoipa::ToSchema))]
pub struct PermitLease {
    pub tenant: String,
    pub resource: String,
    pub region: String,
    /// The lease's sequence number now (the `seq` of the next request).
    pub seq: i64,
    /// Permits the region holds now (0 once its lease expired).
    pub held: i64,
    /// Remaining life of the lease (ms): [`permit_lease_secs`] after an
    /// applied request (never less than it had), what is left of it after
    /// a conflict, 0 when it expired.
    pub lease_ms: i64,
    /// `true`: the request's `seq` was not the lease's; nothing changed,
    /// and the answer is the lease as it is.
    pub conflict: bool,
    pub max_in_flight: i64,
    pub permit_ttl_secs: i64,
    /// The longest TTL a permit handed out under this lease may have (the
    /// policy's TTL may have been lowered while permits were out): a
    /// region that lost its record of them waits this long.
    pub longest_ttl_secs: i64,
    pub fail_mode: FailMode,
    /// The policy version the answer was made under.
    pub version: i64,
}

/// One region's permit lease as operators see it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "service", derive(utoipa::ToSchema))]
pub struct PermitRegion {
    pub region: String,
    /// Permits the region holds (0 once expired).
    pub held: i64,
    pub seq: i64,
    pub expires_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

/// `GET /v1/permits/{tenant}/{resource}` answer: where a concurrency
/// quota's permits are.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "service", derive(utoipa::ToSchema))]
pub struct PermitView {
    pub tenant: String,
    pub resource: String,
    pub max_in_flight: i64,
    pub permit_ttl_secs: i64,
    pub version: i64,
    /// Permits held by regions whose lease is live (never above
    /// `max_in_flight` unless the limit was lowered since).
    pub held: i64,
    pub regions: Vec<PermitRegion>,
}

/// A reserve as a policy PUT gives it (unknown fields refused); see
/// [`Reserve`].
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[cfg_attr(feature = "service", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ReserveSpec {
    /// 0 to 3.
    #[cfg_attr(feature = "service", schema(minimum = 0, maximum = 3))]
    pub up_to_priority: u8,
    /// 1 to 100.
    #[cfg_attr(feature = "service", schema(minimum = 1, maximum = 100))]
    pub pct: i64,
}

/// A share of a policy's window kept for the important priorities: once
/// what is left of the window's pool falls to it, requests of a priority
/// above `up_to_priority` are refused (`429`, `limit: "reserve"`). As
/// policies and grants show it: fields a newer allocator may add are
/// ignored, so an agent keeps reading grants across an upgrade.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[cfg_attr(feature = "service", derive(utoipa::ToSchema))]
pub struct Reserve {
    /// The least important priority the share is kept for, 0 to 3
    /// (priorities run from 0, the most important, to 4).
    #[cfg_attr(feature = "service", schema(minimum = 0, maximum = 3))]
    pub up_to_priority: u8,
    /// The share, in whole percent of the policy's limit, 1 to 100.
    #[cfg_attr(feature = "service", schema(minimum = 1, maximum = 100))]
    pub pct: i64,
}

impl Reserve {
    /// Tokens of a window of `limit` that a request of `priority` may not
    /// take: the reserves kept for more important priorities than it, each
    /// `ceil(limit × pct / 100)`. Entries are validated by the allocator;
    /// out-of-range ones here count as they are, clamped, so a bad cached
    /// entry can only keep more back, never less than 0.
    pub fn held(limit: i64, reserves: &[Reserve], priority: u8) -> i64 {
        let limit = limit.max(0);
        reserves
            .iter()
            .filter(|r| priority > r.up_to_priority)
            .map(|r| (i128::from(limit) * i128::from(r.pct.clamp(0, 100)) + 99) / 100)
            .sum::<i128>()
            .min(i128::from(limit)) as i64
    }
}

/// `PUT /v1/policies/{tenant}/{resource}` body. Omitted fields get the
/// documented defaults (see the allocator's `policies` module).
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "service", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct PolicySpec {
    /// `rate` (default: `limit` tokens per window) or `concurrency`
    /// (`max_in_flight` permits held at once, returned when released).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<PolicyKind>,
    /// `G`: tokens per window (required for a rate policy, absent from a
    /// concurrency one).
    #[serde(default)]
    pub limit: i64,
    /// Window length in seconds; must divide 86,400 (required for a rate
    /// policy, absent from a concurrency one).
    #[serde(default)]
    pub window_secs: i64,
    /// Concurrency policies: the most permits live at once across every
    /// region, 1 to 1,000,000.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_in_flight: Option<i64>,
    /// Concurrency policies: the life of a permit that is neither released
    /// nor renewed, 1 to 86,400 s (default 60).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub permit_ttl_secs: Option<i64>,
    /// Smallest chunk granted while tokens remain.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chunk_min: Option<i64>,
    /// Largest chunk one grant may carry.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chunk_max: Option<i64>,
    /// Longest life of a lease (still clamped to the window end).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_ttl_secs: Option<i64>,
    /// Tokens a region may admit per window without a lease while the
    /// allocator is unreachable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fallback_per_region: Option<i64>,
    /// `bounded` or `strict`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fail_mode: Option<FailMode>,
    /// A token bucket per principal (the acquire's `key`), checked before
    /// the quota, enforced by each region on its own traffic.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub per_key: Option<PerKey>,
    /// `false`: shadow mode. The policy decides and counts exactly as an
    /// enforced one, but a request it would refuse is admitted with
    /// `shadow_refused: true` (default `true`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enforce: Option<bool>,
    /// What an agent cut off from the allocator for longer than its
    /// maximum policy age does (default `keep`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_stale: Option<OnStale>,
    /// Shares of each window kept for the important priorities (default
    /// none): at most 4, one per `up_to_priority`, summing to at most 100.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reserve: Option<Vec<ReserveSpec>>,
    /// Publish the change to canary regions first (a staged rollout, rate
    /// policies only; see docs/api.md "Staged rollouts").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollout: Option<RolloutSpec>,
}

/// `rollout` of a policy `PUT`: the new version goes to `canary_regions`
/// first and to every region after `soak_secs`, unless the canary's
/// refusal rate under it rises above the old version's by `halt_factor`
/// (and above 1 %), in which case it halts by itself.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
#[cfg_attr(feature = "service", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct RolloutSpec {
    /// The regions that take the new version first (1 to 16).
    pub canary_regions: Vec<String>,
    /// How long the canary runs before the version goes everywhere
    /// (1 to 86,400 s, default 300).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub soak_secs: Option<i64>,
    /// The new version halts when its refusal rate in the canary is above
    /// this many times the old version's (1 to 1,000, default 2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub halt_factor: Option<f64>,
    /// Decisions under the new version the canary must have made before
    /// the rollout halts or promotes by itself (1 to 10^9, default 100).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_decisions: Option<i64>,
}

/// Where a staged rollout stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "service", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum RolloutState {
    /// The canary regions are on the new version, every other region on the old.
    Canary,
    /// The new version is in force everywhere.
    Promoted,
    /// The canary went back to the old version, published again as a newer one.
    Halted,
    /// A later `PUT` replaced the rollout before it ended.
    Superseded,
}

impl RolloutState {
    /// The name stored in the database.
    pub fn as_str(self) -> &'static str {
        match self {
            RolloutState::Canary => "canary",
            RolloutState::Promoted => "promoted",
            RolloutState::Halted => "halted",
            RolloutState::Superseded => "superseded",
        }
    }

    /// The state stored as `s`.
    pub fn parse(s: &str) -> Option<RolloutState> {
        [RolloutState::Canary, RolloutState::Promoted, RolloutState::Halted, RolloutState::Superseded]
            .into_iter()
            .find(|r| r.as_str() == s)
    }
}

/// A version's decisions in a rollout, summed over the agents' latest
/// statuses (each agent's counts of its open window).
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Default)]
#[cfg_attr(feature = "service", derive(utoipa::ToSchema))]
pub struct VersionCounts {
    pub version: i64,
    pub admitted: i64,
    /// Answered `429 quota_exhausted` or `per_key_limited`.
    pub refused: i64,
}

impl VersionCounts {
    /// Decisions counted.
    pub fn decisions(&self) -> i64 {
        self.admitted + self.refused
    }

    /// Refused ÷ decisions (0 without decisions).
    pub fn refusal_rate(&self) -> f64 {
        match self.decisions() {
            0 => 0.0,
            n => self.refused as f64 / n as f64,
        }
    }
}

/// What the rollout watcher last compared.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "service", derive(utoipa::ToSchema))]
pub struct RolloutMeasured {
    pub at: DateTime<Utc>,
    /// The new version in the canary regions.
    pub new: VersionCounts,
    /// The old version in the other regions.
    pub old: VersionCounts,
}

/// A policy's latest staged rollout, in its `GET` answer.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "service", derive(utoipa::ToSchema))]
pub struct Rollout {
    pub state: RolloutState,
    /// The new version (the candidate).
    pub version: i64,
    /// The version in force when the rollout started.
    pub from_version: i64,
    /// The candidate's limit.
    pub limit: i64,
    pub canary_regions: Vec<String>,
    pub soak_secs: i64,
    pub halt_factor: f64,
    pub min_decisions: i64,
    pub started_at: DateTime<Utc>,
    pub started_by: String,
    /// When the soak time is over.
    pub soak_ends_at: DateTime<Utc>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ended_at: Option<DateTime<Utc>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ended_by: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// The version a halt published (the old one, renumbered).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub halted_to_version: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub measured: Option<RolloutMeasured>,
}

/// `POST /v1/policies/{tenant}/{resource}/rollout/{promote|halt}` body
/// (optional): `version` names the rollout's candidate, so a late or
/// replayed call about an older rollout changes nothing.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
#[cfg_attr(feature = "service", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct RolloutAction {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<i64>,
}

fn yes() -> bool {
    true
}

/// A per-key limit: a token bucket of `burst` tokens refilled at
/// `rate_per_sec` (kept as integer milli-tokens per second, so rates are
/// multiples of 0.001/s).
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "service", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct PerKey {
    /// Tokens added per second, 0.001 to 1,000,000,000.
    #[cfg_attr(feature = "service", schema(minimum = 0.001, maximum = 1_000_000_000.0))]
    pub rate_per_sec: f64,
    /// Bucket size: the most one key may spend at once, 1 to 1,000,000,000.
    #[cfg_attr(feature = "service", schema(minimum = 1, maximum = 1_000_000_000))]
    pub burst: i64,
}

impl PerKey {
    /// Largest `rate_per_sec` and `burst`.
    pub const MAX: i64 = 1_000_000_000;

    /// The rate in milli-tokens per second, as stored and sent to Redis.
    pub fn rate_milli(&self) -> i64 {
        (self.rate_per_sec * 1000.0).round() as i64
    }

    /// The wire form of a stored `(rate_milli, burst)` pair.
    pub fn from_stored(rate_milli: Option<i64>, burst: Option<i64>) -> Option<PerKey> {
        Some(PerKey { rate_per_sec: rate_milli? as f64 / 1000.0, burst: burst? })
    }
}

/// A policy in force.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "service", derive(utoipa::ToSchema))]
pub struct Policy {
    pub tenant: String,
    pub resource: String,
    pub limit: i64,
    pub window_secs: i64,
    pub chunk_min: i64,
    pub chunk_max: i64,
    pub lease_ttl_secs: i64,
    pub fallback_per_region: i64,
    pub fail_mode: FailMode,
    /// The per-key bucket, when the policy has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub per_key: Option<PerKey>,
    /// `false`: shadow mode (refuses nobody, counts what it would refuse).
    pub enforce: bool,
    /// What a partitioned agent does once the policy is older than its
    /// maximum policy age.
    pub on_stale: OnStale,
    /// Shares of each window kept for the important priorities.
    pub reserve: Vec<Reserve>,
    /// `rate` or `concurrency` (absent from an older allocator's answers:
    /// `rate`). A concurrency policy's `limit` is its `max_in_flight`;
    /// its window fields are unused.
    #[serde(default)]
    pub kind: PolicyKind,
    /// Concurrency policies only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_in_flight: Option<i64>,
    /// Concurrency policies only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub permit_ttl_secs: Option<i64>,
    /// Strictly increasing per quota.
    pub version: i64,
    pub updated_at: DateTime<Utc>,
    /// The quota's latest staged rollout, if it ever had one (while its
    /// `state` is `canary`, the canary regions are on its `version`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollout: Option<Rollout>,
}

/// `POST /v1/agents/register` body.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "service", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct RegisterRequest {
    pub region: String,
    pub agent: String,
}

/// `POST /v1/agents/register` answer.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[cfg_attr(feature = "service", derive(utoipa::ToSchema))]
pub struct RegisterResponse {
    pub region: String,
    pub agent: String,
    /// Strictly greater than any epoch issued before to `(region, agent)`.
    pub epoch: i64,
}

/// Which window a grant is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "service", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum WindowSel {
    /// The window that contains the allocator's "now".
    #[default]
    Current,
    /// The following window; allowed only within the last `lease_ttl` of the
    /// current one (prefetch, DESIGN §4).
    Next,
}

impl WindowSel {
    /// The name stored in the database.
    pub fn as_str(self) -> &'static str {
        match self {
            WindowSel::Current => "current",
            WindowSel::Next => "next",
        }
    }
}

/// `POST /v1/grants` body. `(region, agent, epoch, seq)` is the idempotency
/// key (I3).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "service", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct GrantRequest {
    pub tenant: String,
    pub resource: String,
    pub region: String,
    pub agent: String,
    pub epoch: i64,
    pub seq: i64,
    /// Tokens the region would like.
    pub want: i64,
    /// The region's measured demand, tokens per second.
    pub demand_per_sec: f64,
    #[serde(default)]
    pub window: Option<WindowSel>,
}

/// The pool as seen right after a grant.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[cfg_attr(feature = "service", derive(utoipa::ToSchema))]
pub struct PoolSnapshot {
    pub limit: i64,
    pub granted: i64,
    pub available: i64,
}

/// `POST /v1/grants` answer.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "service", derive(utoipa::ToSchema))]
pub struct GrantResponse {
    pub lease_id: Uuid,
    pub tenant: String,
    pub resource: String,
    pub region: String,
    pub agent: String,
    pub epoch: i64,
    pub seq: i64,
    /// Tokens in the lease; may be 0 when the pool is empty.
    pub tokens: i64,
    pub window_start: DateTime<Utc>,
    pub window_end: DateTime<Utc>,
    /// `min(issued_at + lease_ttl, window_end)` (I2).
    pub expires_at: DateTime<Utc>,
    /// Relative life of the lease at the moment the answer was written; the
    /// agent measures it from the instant it sent the request.
    pub expires_in_ms: i64,
    pub policy_version: i64,
    pub fallback_allowance: i64,
    pub fail_mode: FailMode,
    pub pool: PoolSnapshot,
    /// The policy's per-key bucket (as of `policy_version`), when it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub per_key: Option<PerKey>,
    /// `false`: the policy (as of `policy_version`) is in shadow mode. An
    /// allocator older than shadow mode omits it: enforced.
    #[serde(default = "yes")]
    pub enforce: bool,
    /// The policy's stale behaviour (as of `policy_version`). An allocator
    /// older than it omits it: `keep`, what agents did before.
    #[serde(default)]
    pub on_stale: OnStale,
    /// The policy's reserves (as of `policy_version`); absent: none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub reserve: Vec<Reserve>,
    /// Present when `tokens` is 0: when asking again may help.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after_ms: Option<i64>,
}

/// Most items one `POST /v1/grants` batch may carry (422 `items` above it):
/// 64 renewals fit well inside the 64 KiB body limit, and a batch is
/// answered only when its last item is, so a larger one would hold its
/// first answers back for longer than a renewal can wait.
pub const MAX_GRANT_BATCH: usize = 64;

/// `POST /v1/grants` batch body: several grants in one request, each with
/// its own idempotency key `(region, agent, epoch, seq)` (I3), each decided
/// on its own exactly as the single form is.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "service", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct GrantBatchRequest {
    /// 1 to [`MAX_GRANT_BATCH`] grant requests.
    pub items: Vec<GrantRequest>,
}

/// The answer to one item of a batch: the status the single form would have
/// answered, with its lease or its error body.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "service", derive(utoipa::ToSchema))]
pub struct GrantItemAnswer {
    /// 200, or the single form's error status (403, 404, 409, 422, 500, 503).
    pub status: u16,
    /// `true` when the lease is a replay (the single form's
    /// `Idempotent-Replayed: true`).
    #[serde(default)]
    pub replayed: bool,
    /// The lease, when `status` is 200.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grant: Option<GrantResponse>,
    /// The error, when `status` is not 200.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<ErrorBody>,
}

/// `POST /v1/grants` batch answer: one answer per item, in the items' order.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "service", derive(utoipa::ToSchema))]
pub struct GrantBatchResponse {
    pub items: Vec<GrantItemAnswer>,
}

/// `POST /v1/leases/{lease_id}/release` body.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "service", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ReleaseRequest {
    /// The sender's current epoch for the lease's `(region, agent)`.
    pub epoch: i64,
    /// Tokens of the lease that were never spent.
    pub unspent: i64,
}

/// Most items one `POST /v1/leases/release` batch may carry (422 `items`
/// above it), for the reasons [`MAX_GRANT_BATCH`] gives.
pub const MAX_RELEASE_BATCH: usize = 64;

/// One item of a `POST /v1/leases/release` batch: the single form's path
/// lease id beside its body.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "service", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ReleaseItem {
    pub lease_id: Uuid,
    /// The sender's current epoch for the lease's `(region, agent)`.
    pub epoch: i64,
    /// Tokens of the lease that were never spent.
    pub unspent: i64,
}

/// `POST /v1/leases/release` body: several releases in one request, each
/// decided on its own exactly as `POST /v1/leases/{lease_id}/release` is
/// (idempotent per lease, epoch-fenced).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "service", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ReleaseBatchRequest {
    /// 1 to [`MAX_RELEASE_BATCH`] releases.
    pub items: Vec<ReleaseItem>,
}

/// The answer to one release of a batch: the status the single form would
/// have answered, with its lease or its error body.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "service", derive(utoipa::ToSchema))]
pub struct ReleaseItemAnswer {
    /// 200, or the single form's error status (403, 404, 409, 422, 500, 503).
    pub status: u16,
    /// The lease with `returned`, when `status` is 200.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease: Option<LeaseView>,
    /// The error, when `status` is not 200.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<ErrorBody>,
}

/// `POST /v1/leases/release` answer: one answer per item, in the items' order.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "service", derive(utoipa::ToSchema))]
pub struct ReleaseBatchResponse {
    pub items: Vec<ReleaseItemAnswer>,
}

/// One lease as the ledger knows it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "service", derive(utoipa::ToSchema))]
pub struct LeaseView {
    pub lease_id: Uuid,
    pub tenant: String,
    pub resource: String,
    pub region: String,
    pub agent: String,
    pub epoch: i64,
    pub seq: i64,
    pub tokens: i64,
    pub window_start: DateTime<Utc>,
    pub window_end: DateTime<Utc>,
    pub issued_at: DateTime<Utc>,
    pub expires_at: DateTime<Utc>,
    pub policy_version: i64,
    /// Unspent tokens the agent reported on release, if released.
    pub unspent: Option<i64>,
    /// Tokens credited back to the pool (0 when released after the window
    /// closed), if released.
    pub returned: Option<i64>,
    pub released_at: Option<DateTime<Utc>>,
}

/// One quota's counts for one window in a report.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "service", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ReportItem {
    pub tenant: String,
    pub resource: String,
    pub window_start: DateTime<Utc>,
    /// Tokens admitted from leases.
    pub consumed: i64,
    /// Tokens admitted from the fallback allowance.
    pub fallback_admitted: i64,
    /// Requests a shadow-mode policy would have refused (admitted anyway).
    /// Omitted when 0, so an allocator older than shadow mode accepts the
    /// report of a quota that never had one.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub shadow_refused: i64,
}

fn is_zero(n: &i64) -> bool {
    *n == 0
}

/// `POST /v1/reports` body; idempotent by `report_id` (I7).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "service", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ReportRequest {
    pub region: String,
    pub agent: String,
    pub epoch: i64,
    pub report_id: String,
    pub items: Vec<ReportItem>,
}

/// `POST /v1/reports` answer.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[cfg_attr(feature = "service", derive(utoipa::ToSchema))]
pub struct ReportResponse {
    /// Items applied (on a replay, the count applied the first time).
    pub accepted: i64,
}

/// Every error answer: `{"error": "<code>", "message": "..."}`, plus, where
/// they apply, the field at fault and the index of the report item at fault.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[cfg_attr(feature = "service", derive(utoipa::ToSchema))]
pub struct ErrorBody {
    pub error: String,
    pub message: String,
    /// The field an `invalid_field` error names, e.g. `items[2].window_start`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
    /// The index of the report item refused; nothing of the report was applied.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub item: Option<usize>,
}

/// A quota's mode as an agent sees it (`GET /v1/status` of the agent).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "service", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum QuotaMode {
    /// Spending leases.
    Leased,
    /// The allocator is unreachable; admitting from the fallback allowance.
    Fallback,
    /// The allocator is unreachable; strict fail mode refuses.
    Strict,
    /// The allocator said the pool is empty.
    Exhausted,
}

/// One quota in an agent's status: its mode, and the acquires this agent
/// answered 429 and 503 in the window starting at `window_start`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "service", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct AgentQuotaStatus {
    pub tenant: String,
    pub resource: String,
    pub mode: QuotaMode,
    /// The window the two counts are of (the agent's view of the open one).
    pub window_start: DateTime<Utc>,
    /// Acquires answered `429 quota_exhausted` in that window.
    pub quota_exhausted: i64,
    /// Acquires answered 503 (`allocator_unreachable`, `store_unavailable`) in that window.
    pub unavailable: i64,
    /// Acquires answered `429 per_key_limited` in that window (absent from
    /// older agents: 0).
    #[serde(default)]
    pub per_key_limited: i64,
    /// Acquires admitted in that window, a shadow policy's refusals
    /// included (absent from older agents: 0).
    #[serde(default)]
    pub admitted: i64,
    /// The policy version these counts are of: they restart when it changes
    /// (absent from older agents).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy_version: Option<i64>,
}

/// `PUT /v1/agents/{region}/{agent}/status` body: what an agent says about
/// itself, every few seconds, for the allocator's fleet pages.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "service", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct AgentStatusReport {
    pub epoch: i64,
    /// Whether the agent's circuit breaker counts the allocator as reachable.
    pub allocator_reachable: bool,
    /// Outbox entries waiting for the allocator (as of the last drain round).
    pub outbox_depth: i64,
    /// Entries in the region's dead-letter list; null when unreadable.
    #[serde(default)]
    pub dead_letters: Option<i64>,
    /// Quotas the agent holds (the list below may be cut).
    pub quotas_total: i64,
    /// At most 200 quotas: those with refusals or not leased first.
    pub quotas: Vec<AgentQuotaStatus>,
}

#[cfg(test)]
mod reserve_tests {
    use super::Reserve;

    #[test]
    fn a_priority_may_not_take_the_reserves_kept_for_more_important_ones() {
        let r = [Reserve { up_to_priority: 1, pct: 10 }, Reserve { up_to_priority: 0, pct: 5 }];
        // G = 1000: priority 0 takes everything; 1 leaves 0's 5 %; 2-4 leave both.
        let held: Vec<i64> = (0..=4).map(|p| Reserve::held(1000, &r, p)).collect();
        assert_eq!(held, [0, 50, 150, 150, 150]);
        // Rounded up: 10 % of 25 keeps 3.
        assert_eq!(Reserve::held(25, &[Reserve { up_to_priority: 1, pct: 10 }], 2), 3);
        assert_eq!(Reserve::held(1000, &[], 4), 0);
        // Never more than the limit, whatever a bad entry says.
        let bad = [Reserve { up_to_priority: 0, pct: 400 }, Reserve { up_to_priority: 1, pct: 90 }];
        assert_eq!(Reserve::held(100, &bad, 4), 100);
        assert_eq!(Reserve::held(i64::MAX, &[Reserve { up_to_priority: 0, pct: 100 }], 1), i64::MAX);
    }
}
