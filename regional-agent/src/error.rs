//! The agent's one error enum and its mapping to status, JSON code and
//! headers (DESIGN §5): 400 malformed JSON, 413 body too large, 422 invalid
//! value naming the field, 404 unknown quota, 409 request id mismatch, 429
//! quota exhausted or per-key limited (the body's `limit` names which:
//! `per_key`, `reserve` or the resource; `resource` the quota that
//! refused), 503
//! allocator unreachable, store unavailable, shed (priority shedding,
//! see `crate::shed`) or policy stale (see `crate::stale`). 429 and 503 carry a `Retry-After` in whole
//! seconds, at least 1, jittered.

use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use rand::Rng;
use std::sync::atomic::{AtomicBool, Ordering};

/// Why a policy can never admit a request as sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PolicyRefusal {
    /// The cost is above the quota's limit.
    CostAboveLimit,
    /// The quota has a per-key limit and the request names no principal.
    PrincipalMissing,
    /// The cost is above the per-key burst.
    CostAboveBurst,
    /// The quota is a concurrency policy: its permits are taken alone by
    /// `POST /v1/acquire` and given back by `release`, which neither a
    /// request naming several quotas nor Envoy (which never releases) can do.
    ConcurrencyQuota,
}

impl PolicyRefusal {
    /// The label of metrics and of the RLS answer's `x-quota-refused` header.
    pub fn label(self) -> &'static str {
        match self {
            PolicyRefusal::CostAboveLimit => "cost_above_limit",
            PolicyRefusal::PrincipalMissing => "principal_missing",
            PolicyRefusal::CostAboveBurst => "cost_above_burst",
            PolicyRefusal::ConcurrencyQuota => "concurrency",
        }
    }
}

/// `Result` with the agent's error.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything an acquire can be refused with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The body is not JSON.
    #[error("{0}")]
    MalformedJson(String),
    /// A field has an invalid value.
    #[error("{field}: {message}")]
    InvalidField { field: String, message: String },
    /// A well-formed request its quota's policy can never admit as sent
    /// (see [`PolicyRefusal`]). Over HTTP a 422 `invalid_field` like any
    /// bad value; over RLS a refusal (`OVER_LIMIT`), since Envoy lets a
    /// request through on any error when `failure_mode_deny` is off.
    #[error("{field}: {message}")]
    PolicyRefuses { field: String, reason: PolicyRefusal, message: String },
    /// Body over 64 KiB.
    #[error("request body is larger than 64 KiB")]
    PayloadTooLarge,
    /// The allocator has no policy for the quota.
    #[error("no policy for quota {0}")]
    UnknownQuota(String),
    /// The request id was first used with another resource or cost.
    #[error("{0}")]
    RequestIdMismatch(String),
    /// The quota's pool is exhausted for the window.
    #[error("quota exhausted for this window")]
    Exhausted { resource: String, retry_after_ms: i64 },
    /// The request's key has spent its per-key bucket of `resource`;
    /// `retry_after_ms` until the bucket holds the request's cost again.
    /// (The key is not repeated: it may be an API key.)
    #[error("the request's key is over the per-key limit of quota {resource}")]
    KeyLimited { resource: String, retry_after_ms: i64, remaining: i64 },
    /// What is left of quota `resource`'s window is kept for priorities
    /// more important than the request's (the policy's `reserve`).
    #[error("what is left of quota {resource} for this window is reserved for more important priorities")]
    Reserved { resource: String, retry_after_ms: i64 },
    /// Every permit of concurrency quota `resource` is held (in this
    /// region, and the allocator has none left for it), or the region may
    /// hand out none for a while (its Redis forgot which are held).
    #[error("every permit of concurrency quota {resource} is held")]
    ConcurrencyLimited { resource: String, retry_after_ms: i64 },
    /// No live permit has this id (released, expired, or never handed out).
    #[error("no live permit {0}")]
    PermitNotFound(String),
    /// The permit was handed out to another holder (`key`).
    #[error("permit {0} is held by another key")]
    NotHolder(String),
    /// The agent cannot reach the allocator and may not admit on its own.
    #[error("the allocator is unreachable and the quota's fallback allowance does not admit this request")]
    AllocatorUnreachable,
    /// The quota's policy is older than the agent's maximum policy age
    /// while the allocator is unreachable, and the policy says to fail as
    /// its strict fail mode says (see [`crate::stale`]).
    #[error("the quota's policy could not be refreshed for longer than this agent's maximum policy age ({age_secs} s old) and its on_stale is fail_mode with fail_mode strict")]
    PolicyStale { age_secs: i64 },
    /// Redis cannot be reached.
    #[error("the region's store is unavailable")]
    StoreUnavailable,
    /// Redis answers but may not be trusted to keep the agent's keys (an
    /// evicting `maxmemory-policy`, or not yet checked); the message says
    /// why and how to fix it. Answered as `store_unavailable`.
    #[error("{0}")]
    StoreNotSafe(String),
    /// Too many new quota names are learning their policy at once (each
    /// is one grant away from knowing; see `quotas::MAX_LEARNING`).
    #[error("this agent is learning the policies of too many new quota names at once; retry")]
    TooManyQuotas,
    /// This agent is overloaded and sheds the request's priority first
    /// (see [`crate::shed`]); nothing was charged.
    #[error("this agent is overloaded and sheds priority {priority} requests first; retry later")]
    Shed { priority: u8 },
    /// No such route.
    #[error("no route {0}")]
    NoRoute(String),
}

impl Error {
    /// Shorthand for [`Error::InvalidField`].
    pub fn invalid(field: impl Into<String>, message: impl Into<String>) -> Self {
        Error::InvalidField { field: field.into(), message: message.into() }
    }

    /// The status code.
    pub fn status_code(&self) -> StatusCode {
        match self {
            Error::MalformedJson(_) => StatusCode::BAD_REQUEST,
            Error::InvalidField { .. } | Error::PolicyRefuses { .. } => StatusCode::UNPROCESSABLE_ENTITY,
            Error::PayloadTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Error::UnknownQuota(_) | Error::NoRoute(_) | Error::PermitNotFound(_) => StatusCode::NOT_FOUND,
            Error::RequestIdMismatch(_) | Error::NotHolder(_) => StatusCode::CONFLICT,
            Error::Exhausted { .. }
            | Error::KeyLimited { .. }
            | Error::Reserved { .. }
            | Error::ConcurrencyLimited { .. } => StatusCode::TOO_MANY_REQUESTS,
            Error::AllocatorUnreachable
            | Error::PolicyStale { .. }
            | Error::StoreUnavailable
            | Error::StoreNotSafe(_)
            | Error::TooManyQuotas
            | Error::Shed { .. } => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    /// The JSON `error` code.
    pub fn code(&self) -> &'static str {
        match self {
            Error::MalformedJson(_) => "malformed_json",
            Error::InvalidField { .. } | Error::PolicyRefuses { .. } => "invalid_field",
            Error::PayloadTooLarge => "payload_too_large",
            Error::UnknownQuota(_) => "unknown_quota",
            Error::RequestIdMismatch(_) => "request_id_mismatch",
            Error::Exhausted { .. } | Error::Reserved { .. } | Error::ConcurrencyLimited { .. } => {
                "quota_exhausted"
            }
            Error::PermitNotFound(_) => "permit_not_found",
            Error::NotHolder(_) => "not_holder",
            Error::KeyLimited { .. } => "per_key_limited",
            Error::AllocatorUnreachable => "allocator_unreachable",
            Error::PolicyStale { .. } => "policy_stale",
            Error::StoreUnavailable | Error::StoreNotSafe(_) => "store_unavailable",
            Error::TooManyQuotas => "too_many_quotas",
            Error::Shed { .. } => "shed",
            Error::NoRoute(_) => "not_found",
        }
    }

    /// `Retry-After` seconds for 429 and 503.
    pub fn retry_after_s(&self) -> Option<i64> {
        match self {
            Error::Exhausted { retry_after_ms, .. }
            | Error::KeyLimited { retry_after_ms, .. }
            | Error::Reserved { retry_after_ms, .. }
            | Error::ConcurrencyLimited { retry_after_ms, .. } => Some(retry_after_secs(*retry_after_ms)),
            Error::AllocatorUnreachable
            | Error::PolicyStale { .. }
            | Error::StoreUnavailable
            | Error::StoreNotSafe(_)
            | Error::TooManyQuotas
            | Error::Shed { .. } => Some(retry_after_secs(1000)),
            _ => None,
        }
    }
}

/// A request body axum could not read: over the size limit (413), or
/// broken on the way (400).
impl From<axum::extract::rejection::BytesRejection> for Error {
    fn from(r: axum::extract::rejection::BytesRejection) -> Error {
        if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
            Error::PayloadTooLarge
        } else {
            Error::MalformedJson(r.body_text())
        }
    }
}

/// `--retry-after-jitter`. A process-wide switch rather than a field of
/// the app's settings: an error is turned into its answer (`IntoResponse`)
/// with no access to the app, and the switch is set once, before serving.
static RETRY_AFTER_JITTER: AtomicBool = AtomicBool::new(true);

/// Sets `--retry-after-jitter` (at start).
pub fn set_retry_after_jitter(on: bool) {
    RETRY_AFTER_JITTER.store(on, Ordering::Relaxed);
}

/// Whole seconds, at least 1, plus (unless `--retry-after-jitter false`) up
/// to one second of jitter so clients told to come back do not all come
/// back at the same instant.
pub fn retry_after_secs(ms: i64) -> i64 {
    let jitter = if RETRY_AFTER_JITTER.load(Ordering::Relaxed) { rand::rng().random_range(0..=1) } else { 0 };
    whole_secs(ms) + jitter
}

/// `ms` rounded up to whole seconds, at least 1.
fn whole_secs(ms: i64) -> i64 {
    ((ms.max(1) + 999) / 1000).max(1)
}

/// The body of a `429` on `POST /v1/acquire` (and of every other error,
/// without the refusal's fields): what refused, and when to come back.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct ErrorAnswer {
    /// The error code (`quota_exhausted`, `per_key_limited`, ...).
    pub error: String,
    pub message: String,
    /// The field at fault (`invalid_field`, a policy's refusal).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
    /// `false` on a 429: nothing was debited on any quota.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allowed: Option<bool>,
    /// The quota that refused (429).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resource: Option<String>,
    /// What refused (429): the resource's name for its pool, `per_key`
    /// for the key's bucket, `reserve` for a share kept for more important
    /// priorities.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<String>,
    /// Seconds until a retry may succeed (429), as in `Retry-After`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after_s: Option<i64>,
}

impl IntoResponse for Error {
    fn into_response(self) -> Response {
        let status = self.status_code();
        let retry = self.retry_after_s();
        let (limit, resource) = match &self {
            Error::Exhausted { resource, .. } => (Some(resource.clone()), Some(resource.clone())),
            Error::KeyLimited { resource, .. } => (Some("per_key".to_string()), Some(resource.clone())),
            Error::Reserved { resource, .. } => (Some("reserve".to_string()), Some(resource.clone())),
            Error::ConcurrencyLimited { resource, .. } => {
                (Some("concurrency".to_string()), Some(resource.clone()))
            }
            _ => (None, None),
        };
        let field = match &self {
            Error::InvalidField { field, .. } | Error::PolicyRefuses { field, .. } => Some(field.clone()),
            _ => None,
        };
        let refused = limit.is_some();
        let body = ErrorAnswer {
            error: self.code().to_string(),
            message: self.to_string(),
            field,
            allowed: refused.then_some(false),
            resource,
            limit,
            retry_after_s: if refused { retry } else { None },
        };
        let mut resp = (status, Json(body)).into_response();
        if let Some(s) = retry {
            resp.headers_mut().insert("retry-after", HeaderValue::from(s));
        }
        resp
    }
}

#[cfg(test)]
mod tests {
    use super::whole_secs;

    #[test]
    fn a_wait_rounds_up_to_whole_seconds_of_at_least_one() {
        for (ms, want) in [(-5, 1), (0, 1), (1, 1), (999, 1), (1000, 1), (1001, 2), (2500, 3)] {
            assert_eq!(whole_secs(ms), want, "{ms} ms");
        }
    }
}
