//! The answer of `GET /v1/explain/...` and its parts, as they go on the
//! wire (and into the OpenAPI document).

use crate::ledger::Event;
use chrono::{DateTime, Utc};
use quota_shared::wire::Policy;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;
use uuid::Uuid;

/// The pool of the window as stored.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
pub struct ExplainPool {
    /// Whether any grant or report created the pool yet.
    pub exists: bool,
    pub limit: i64,
    pub granted: i64,
    pub returned: i64,
    /// `limit − (granted − returned) − fallback repaid` (fallback reported
    /// while the window was open), never below 0.
    pub available: i64,
}

/// One lease of the region in the window.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
pub struct ExplainLease {
    pub lease_id: Uuid,
    pub agent: String,
    pub epoch: i64,
    pub seq: i64,
    pub tokens: i64,
    pub issued_at: DateTime<Utc>,
    pub expires_at: DateTime<Utc>,
    /// `expires_at ≤ at`.
    pub expired: bool,
    /// `tokens − unspent` as the agent reported on release; null until released.
    pub spent: Option<i64>,
    /// Tokens credited back to the pool on release; null until released.
    pub returned: Option<i64>,
    pub released_at: Option<DateTime<Utc>>,
}

/// The region's fallback position in the window.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
pub struct ExplainFallback {
    /// `fallback_per_region` of the window (0 in strict mode).
    pub allowance: i64,
    /// Fallback admits the region reported for the window.
    pub admitted: i64,
    /// `allowance − admitted`, never below 0.
    pub left: i64,
    /// The region reported fallback admits in this window, so it lost the
    /// allocator during it.
    pub in_fallback: bool,
}

/// The region's row of the window.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
pub struct ExplainRegion {
    pub region: String,
    pub granted: i64,
    pub returned: i64,
    /// Admits from leases, as reported.
    pub consumed: i64,
    pub demand_per_sec: f64,
    pub last_want: i64,
    pub demand_at: Option<DateTime<Utc>>,
}

/// The instant each part of an [`Explanation`] is from: `at`, or the
/// instant of `current` where the history to rebuild `at` is gone.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
pub struct ExplainInstants {
    /// `policy`: the version in force at this instant.
    pub policy: DateTime<Utc>,
    /// `pool`: leases issued and released up to this instant.
    pub pool: DateTime<Utc>,
    /// `region_account`: grants and returns as `pool`; consumption as
    /// reported up to this instant.
    pub region_account: DateTime<Utc>,
    /// `leases` and `live_lease_tokens`: issued, expired and released up to
    /// this instant.
    pub leases: DateTime<Utc>,
    /// `fallback`: admits reported up to this instant.
    pub fallback: DateTime<Utc>,
    /// `refusals`: recorded up to this instant.
    pub refusals: DateTime<Utc>,
}

/// The window's totals as stored when the explanation was made.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
pub struct ExplainCurrent {
    /// Read just before the totals (allocator clock): every commit before it
    /// is counted.
    pub as_of: DateTime<Utc>,
    pub pool: ExplainPool,
    pub region_account: ExplainRegion,
    pub fallback: ExplainFallback,
}

/// `GET /v1/explain/...` answer.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Explanation {
    pub tenant: String,
    pub resource: String,
    pub region: String,
    pub at: DateTime<Utc>,
    /// The policy version in force at `at`.
    pub policy: Policy,
    pub window_start: DateTime<Utc>,
    pub window_end: DateTime<Utc>,
    pub pool: ExplainPool,
    pub region_account: ExplainRegion,
    /// Leases issued to the region in the window up to `at`, oldest first.
    pub leases: Vec<ExplainLease>,
    /// Tokens of leases live at `at` (issued, not expired, not released).
    pub live_lease_tokens: i64,
    pub fallback: ExplainFallback,
    /// The region's latest refusals for this quota up to `at`, newest first.
    pub refusals: Vec<Event>,
    /// The first that applies: `leased` (a live lease at `at`), `fallback`
    /// (the region reported fallback admits in the window), `no demand` (no
    /// lease and no demand stated), `exhausted` (a grant got 0 tokens or the
    /// pool has none left), else `idle`.
    pub verdict: String,
    /// One sentence saying why.
    pub reason: String,
    /// The instant each part above is from.
    pub as_of: ExplainInstants,
    /// The same window's totals as stored now.
    pub current: ExplainCurrent,
    /// Which parts could not be rebuilt as of `at` and why, and what the
    /// reader should know about the numbers; empty when nothing applies.
    pub notes: Vec<String>,
}
