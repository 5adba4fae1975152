//! The allocator's one error enum and its mapping to HTTP (DESIGN §5):
//! 400 malformed JSON, 401 token, 403 credential of another region, 404 unknown quota or lease, 409 stale epoch,
//! idempotency mismatch, a quota of the other kind (`concurrency_policy`, `rate_policy`), or a rollout
//! that is not live (`no_live_rollout`, `not_current_rollout`) or already live (`rollout_in_progress`), 412 version precondition, 413 body too large,
//! 422 invalid value (naming the field, and the report item when one is at
//! fault) or a report item beyond the retention horizon (`report_expired`),
//! 503 database unavailable. Internal errors are logged
//! with their cause and answered without detail.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use quota_shared::wire::ErrorBody;

/// `Result` with the allocator's error.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything a request can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The body is not JSON.
    #[error("{0}")]
    MalformedJson(String),
    /// The body is not `application/json`.
    #[error("{0}")]
    UnsupportedMediaType(String),
    /// Missing or wrong bearer token.
    #[error("missing or invalid bearer token")]
    Unauthorized,
    /// A region-bound credential (tokens-file token or client certificate)
    /// used for another region.
    #[error("this credential acts only for region {allowed}, not {requested}")]
    WrongRegion { allowed: String, requested: String },
    /// A field has an invalid value; the message names the field.
    #[error("{field}: {message}")]
    InvalidField { field: String, message: String },
    /// No policy for the quota.
    #[error("no policy for quota {0}")]
    UnknownQuota(String),
    /// No such lease.
    #[error("no lease {0}")]
    UnknownLease(String),
    /// The agent never registered.
    #[error("agent {0} is not registered; call POST /v1/agents/register first")]
    UnknownAgent(String),
    /// No such route.
    #[error("no route {0}")]
    NoRoute(String),
    /// I4: the request's epoch is below the agent's current epoch.
    #[error("epoch {got} is stale: the current epoch of {who} is {current}")]
    StaleEpoch { who: String, got: i64, current: i64 },
    /// I3: a known idempotency key with a different body.
    #[error("{0}")]
    IdempotencyMismatch(String),
    /// A grant asked of a concurrency quota: its permits are leased, not
    /// granted.
    #[error("quota {0} is a concurrency policy: its permits are leased through POST /v1/permits/lease, not granted")]
    ConcurrencyPolicy(String),
    /// A permit lease (or view) asked of a rate quota: it has no permits.
    #[error("quota {0} is a rate policy: it has no permits; its tokens are granted through POST /v1/grants")]
    RatePolicy(String),
    /// A rollout asked while another of the same quota is live: its canary
    /// regions hold its candidate, which a second rollout could not take back.
    #[error("quota {quota} has a live rollout of version {version}: promote or halt it first (a PUT without rollout replaces it)")]
    RolloutInProgress { quota: String, version: i64 },
    /// A promote or halt of a quota with no live rollout.
    #[error("quota {0} has no live rollout (it ended, or never started)")]
    NoLiveRollout(String),
    /// A promote or halt naming another candidate than the live rollout's
    /// (a late or replayed call about an older rollout).
    #[error("the live rollout of {quota} is of version {live}, not {asked}")]
    NotCurrentRollout { quota: String, asked: i64, live: i64 },
    /// `If-Match` named a version that is no longer current.
    #[error("policy version is {current}, If-Match asked for {expected}")]
    VersionMismatch { expected: String, current: i64 },
    /// A report item counts a window that started beyond the retention
    /// horizon: its report record may already be deleted, so it could not be
    /// applied exactly once (I7). Never changes: the sender should drop it.
    #[error("{0}")]
    ReportExpired(String),
    /// One report item is at fault; the report was not applied at all.
    #[error("{source}")]
    InItem {
        item: usize,
        #[source]
        source: Box<Error>,
    },
    /// Body over 64 KiB.
    #[error("request body is larger than 64 KiB")]
    PayloadTooLarge,
    /// PostgreSQL cannot be reached (or timed out).
    #[error("database unavailable")]
    DatabaseUnavailable(#[source] sqlx::Error),
    /// I3: a concurrent grant inserted a lease under the same idempotency key
    /// (`lease_idempotency_key`) after this one looked the key up. The grant
    /// retries once and then reads the winner's lease; if it still surfaces,
    /// it is answered as internal.
    #[error("internal error")]
    KeyTaken(#[source] sqlx::Error),
    /// Anything else; logged, never detailed to the client.
    #[error("internal error")]
    Internal(#[source] Box<dyn std::error::Error + Send + Sync>),
}

impl Error {
    /// This error, attributed to report item `item`.
    pub fn in_item(self, item: usize) -> Self {
        match self {
            // Already attributed, or not the item's fault (logged as is).
            e @ (Error::InItem { .. }
            | Error::Internal(_)
            | Error::KeyTaken(_)
            | Error::DatabaseUnavailable(_)) => e,
            e => Error::InItem { item, source: Box::new(e) },
        }
    }

    /// This error as the answer to item `i` of a batch (grants, releases):
    /// a field it names becomes `items[i].<field>`, and it is attributed
    /// to the item.
    pub fn of_batch_item(self, i: usize) -> Self {
        match self {
            Error::InvalidField { field, message } => {
                Error::InvalidField { field: format!("items[{i}].{field}"), message }
            }
            e => e,
        }
        .in_item(i)
    }

    /// Shorthand for [`Error::InvalidField`].
    pub fn invalid(field: impl Into<String>, message: impl Into<String>) -> Self {
        Error::InvalidField { field: field.into(), message: message.into() }
    }

    /// The status code of this error.
    pub fn status_code(&self) -> StatusCode {
        match self {
            Error::MalformedJson(_) => StatusCode::BAD_REQUEST,
            Error::UnsupportedMediaType(_) => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            Error::Unauthorized => StatusCode::UNAUTHORIZED,
            Error::WrongRegion { .. } => StatusCode::FORBIDDEN,
            Error::InvalidField { .. } | Error::ReportExpired(_) => StatusCode::UNPROCESSABLE_ENTITY,
            Error::InItem { source, .. } => source.status_code(),
            Error::UnknownQuota(_) | Error::UnknownLease(_) | Error::UnknownAgent(_) | Error::NoRoute(_) => {
                StatusCode::NOT_FOUND
            }
            Error::StaleEpoch { .. }
            | Error::IdempotencyMismatch(_)
            | Error::ConcurrencyPolicy(_)
            | Error::RatePolicy(_)
            | Error::NoLiveRollout(_)
            | Error::NotCurrentRollout { .. }
            | Error::RolloutInProgress { .. } => StatusCode::CONFLICT,
            Error::VersionMismatch { .. } => StatusCode::PRECONDITION_FAILED,
            Error::PayloadTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Error::DatabaseUnavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            Error::KeyTaken(_) | Error::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The machine-readable code in the JSON body.
    pub fn code(&self) -> &'static str {
        match self {
            Error::MalformedJson(_) => "malformed_json",
            Error::UnsupportedMediaType(_) => "unsupported_media_type",
            Error::Unauthorized => "unauthorized",
            Error::WrongRegion { .. } => "wrong_region",
            Error::InvalidField { .. } => "invalid_field",
            Error::ReportExpired(_) => "report_expired",
            Error::InItem { source, .. } => source.code(),
            Error::UnknownQuota(_) => "unknown_quota",
            Error::UnknownLease(_) => "unknown_lease",
            Error::UnknownAgent(_) => "unknown_agent",
            Error::NoRoute(_) => "not_found",
            Error::StaleEpoch { .. } => "stale_epoch",
            Error::IdempotencyMismatch(_) => "idempotency_mismatch",
            Error::ConcurrencyPolicy(_) => "concurrency_policy",
            Error::RatePolicy(_) => "rate_policy",
            Error::NoLiveRollout(_) => "no_live_rollout",
            Error::RolloutInProgress { .. } => "rollout_in_progress",
            Error::NotCurrentRollout { .. } => "not_current_rollout",
            Error::VersionMismatch { .. } => "version_mismatch",
            Error::PayloadTooLarge => "payload_too_large",
            Error::DatabaseUnavailable(_) => "database_unavailable",
            Error::KeyTaken(_) | Error::Internal(_) => "internal",
        }
    }
}

/// Connection-level failures mean "unavailable" (retry), anything else is a
/// bug or a constraint we failed to map, which is internal.
impl From<sqlx::Error> for Error {
    fn from(e: sqlx::Error) -> Self {
        match &e {
            sqlx::Error::PoolTimedOut
            | sqlx::Error::Io(_)
            | sqlx::Error::PoolClosed
            | sqlx::Error::Tls(_) => Error::DatabaseUnavailable(e),
            sqlx::Error::Database(db) if is_unavailable_sqlstate(db.code().as_deref()) => {
                Error::DatabaseUnavailable(e)
            }
            _ => Error::Internal(Box::new(e)),
        }
    }
}

/// Maps a violation of the named constraint to `to` at the statement that
/// can violate it (`.map_err(on_constraint("lease_idempotency_key", Error::KeyTaken))`);
/// every other error converts as usual.
pub fn on_constraint(
    name: &'static str,
    to: impl FnOnce(sqlx::Error) -> Error,
) -> impl FnOnce(sqlx::Error) -> Error {
    move |e| match &e {
        sqlx::Error::Database(dbe) if dbe.constraint() == Some(name) => to(e),
        _ => e.into(),
    }
}

/// Whether `e` says the connection's server is not (or no longer) a
/// writable primary, or the connection itself broke, so the same statement
/// may succeed on a fresh connection through the load balancer: the
/// session ended under it (closed or reset socket), the server refused a
/// write because it now runs read-only (25006, a demoted primary or a
/// replica reached through a stale route), it is shutting down or not yet
/// accepting (57P01 admin shutdown, 57P02 crash shutdown, 57P03 cannot
/// connect now), or a connection exception (class 08). Statement and lock
/// timeouts, serialization failures and anything else are not failovers.
pub fn is_failover_error(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_) => true,
        sqlx::Error::Database(db) => match db.code() {
            Some(code) => matches!(&*code, "25006" | "57P01" | "57P02" | "57P03") || code.starts_with("08"),
            None => false,
        },
        _ => false,
    }
}

/// SQLSTATEs that mean the server cannot serve right now and a retry may
/// succeed: statement or lock timeouts (57014, 55P03), shutdown and
/// connection classes (57P0x, 08xxx), too many connections (53300), a
/// transaction chosen as a deadlock or serialization victim (40P01, 40001),
/// and a write refused by a server in read-only mode (25006: a primary
/// Patroni demoted, or a replica reached before the load balancer noticed).
fn is_unavailable_sqlstate(code: Option<&str>) -> bool {
    match code {
        Some(c) => {
            matches!(c, "57014" | "55P03" | "53300" | "40P01" | "40001" | "25006")
                || c.starts_with("57P")
                || c.starts_with("08")
        }
        None => false,
    }
}

impl Error {
    /// Whether this is a database failover seen from a connection
    /// ([`is_failover_error`]): retried where safe.
    pub fn is_failover(&self) -> bool {
        matches!(self, Error::DatabaseUnavailable(e) if is_failover_error(e))
    }

    /// The JSON body of this error (logging an internal cause, never
    /// answering it): an HTTP answer's, or one batch item's.
    pub fn to_body(&self) -> ErrorBody {
        let message = match self {
            Error::DatabaseUnavailable(e) => {
                tracing::warn!(error = %e, "database unavailable");
                self.to_string()
            }
            Error::KeyTaken(e) => {
                tracing::error!(error = %e, "internal error");
                self.to_string()
            }
            Error::Internal(e) => {
                let mut chain = e.to_string();
                let mut src = e.source();
                while let Some(s) = src {
                    chain.push_str(": ");
                    chain.push_str(&s.to_string());
                    src = s.source();
                }
                tracing::error!(error = %chain, "internal error");
                self.to_string()
            }
            _ => self.to_string(),
        };
        let (field, item) = match self {
            Error::InItem { item, source } => match source.as_ref() {
                Error::InvalidField { field, .. } => (Some(field.clone()), Some(*item)),
                _ => (None, Some(*item)),
            },
            Error::InvalidField { field, .. } => (Some(field.clone()), None),
            _ => (None, None),
        };
        ErrorBody { error: self.code().into(), message, field, item }
    }
}

impl IntoResponse for Error {
    fn into_response(self) -> Response {
        let status = self.status_code();
        let body = self.to_body();
        let mut resp = (status, Json(body)).into_response();
        if status == StatusCode::SERVICE_UNAVAILABLE {
            resp.headers_mut().insert("retry-after", axum::http::HeaderValue::from_static("1"));
        }
        resp
    }
}

/// Database errors as PostgreSQL reports them, for the unit tests of the
/// error mappings here and in `tx`.
#[cfg(test)]
pub(crate) mod fake_db {
    /// A server error: a SQLSTATE, and a constraint for a unique violation.
    #[derive(Debug)]
    struct Server {
        code: &'static str,
        constraint: Option<&'static str>,
    }

    impl std::fmt::Display for Server {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "SQLSTATE {} (constraint {:?})", self.code, self.constraint)
        }
    }

    impl std::error::Error for Server {}

    impl sqlx::error::DatabaseError for Server {
        fn message(&self) -> &str {
            "server error"
        }
        fn code(&self) -> Option<std::borrow::Cow<'_, str>> {
            Some(self.code.into())
        }
        fn as_error(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
            self
        }
        fn as_error_mut(&mut self) -> &mut (dyn std::error::Error + Send + Sync + 'static) {
            self
        }
        fn into_error(self: Box<Self>) -> Box<dyn std::error::Error + Send + Sync + 'static> {
            self
        }
        fn constraint(&self) -> Option<&str> {
            self.constraint
        }
        fn kind(&self) -> sqlx::error::ErrorKind {
            match self.code {
                "23505" => sqlx::error::ErrorKind::UniqueViolation,
                _ => sqlx::error::ErrorKind::Other,
            }
        }
    }

    /// An error with SQLSTATE `code`.
    pub fn server(code: &'static str) -> sqlx::Error {
        sqlx::Error::Database(Box::new(Server { code, constraint: None }))
    }

    /// A unique violation of `constraint`.
    pub fn unique_violation(constraint: Option<&'static str>) -> sqlx::Error {
        sqlx::Error::Database(Box::new(Server { code: "23505", constraint }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn violation(constraint: Option<&'static str>) -> sqlx::Error {
        fake_db::unique_violation(constraint)
    }

    #[test]
    fn failover_errors_are_read_only_shutdown_connection_and_closed_sockets() {
        for code in ["25006", "57P01", "57P02", "57P03", "08000", "08003", "08006", "08P01"] {
            assert!(is_failover_error(&fake_db::server(code)), "{code}");
        }
        let closed = std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "connection closed");
        assert!(is_failover_error(&sqlx::Error::Io(closed)));
        // Timeouts, contention, constraint and anything not about the
        // server's role or the connection: not retried here.
        for code in ["57014", "55P03", "40001", "40P01", "23505", "53300", "42P01"] {
            assert!(!is_failover_error(&fake_db::server(code)), "{code}");
        }
        assert!(!is_failover_error(&sqlx::Error::PoolTimedOut));
        assert!(!is_failover_error(&sqlx::Error::RowNotFound));
    }

    #[test]
    fn on_constraint_maps_only_the_named_constraint() {
        let map = || on_constraint("lease_idempotency_key", Error::KeyTaken);
        assert!(matches!(map()(violation(Some("lease_idempotency_key"))), Error::KeyTaken(_)));
        assert!(matches!(map()(violation(Some("lease_clamped_to_window"))), Error::Internal(_)));
        assert!(matches!(map()(violation(None)), Error::Internal(_)));
        assert!(matches!(map()(sqlx::Error::PoolTimedOut), Error::DatabaseUnavailable(_)));
    }

    #[test]
    fn a_raced_key_still_answers_as_internal() {
        let e =
            on_constraint("lease_idempotency_key", Error::KeyTaken)(violation(Some("lease_idempotency_key")));
        assert_eq!((e.status_code(), e.code()), (StatusCode::INTERNAL_SERVER_ERROR, "internal"));
    }
}
