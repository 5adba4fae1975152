//! The append-only ledger: every registration, grant, replay, refusal,
//! release, report and policy change is one row, and `GET /v1/ledger` reads
//! them back in order with a cursor.

use crate::http::extract::{check_id, ApiQuery};
use crate::{AppState, Error, Result};
use axum::extract::State;
use axum::routing::get;
use axum::{Json, Router};
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use sqlx::{PgConnection, PgPool};
use uuid::Uuid;

/// Kinds of ledger events.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Registered,
    Granted,
    Replayed,
    Refused,
    Released,
    Reported,
    PolicyChanged,
}

impl Kind {
    fn as_str(self) -> &'static str {
        match self {
            Kind::Registered => "registered",
            Kind::Granted => "granted",
            Kind::Replayed => "replayed",
            Kind::Refused => "refused",
            Kind::Released => "released",
            Kind::Reported => "reported",
            Kind::PolicyChanged => "policy_changed",
        }
    }
}

/// One event to append; fields that do not apply stay `None`.
#[derive(Debug, Clone, Default)]
pub struct NewEvent {
    pub tenant: Option<String>,
    pub resource: Option<String>,
    pub region: Option<String>,
    pub agent: Option<String>,
    pub epoch: Option<i64>,
    pub seq: Option<i64>,
    pub lease_id: Option<Uuid>,
    pub tokens: Option<i64>,
    pub reason: Option<String>,
    pub detail: Option<serde_json::Value>,
}

/// Appends one event inside the caller's transaction, so an event exists if
/// and only if the change it describes committed.
pub async fn append(conn: &mut PgConnection, at: DateTime<Utc>, kind: Kind, e: NewEvent) -> Result<()> {
    sqlx::query(include_str!("sql/ledger_append.sql"))
        .bind(at)
        .bind(kind.as_str())
        .bind(e.tenant)
        .bind(e.resource)
        .bind(e.region)
        .bind(e.agent)
        .bind(e.epoch)
        .bind(e.seq)
        .bind(e.lease_id)
        .bind(e.tokens)
        .bind(e.reason)
        .bind(e.detail)
        .execute(conn)
        .await?;
    Ok(())
}

/// Appends a refusal in its own transaction: the refused request changed
/// nothing, but the ledger must still show it was refused and why.
pub async fn append_refusal(db: &PgPool, at: DateTime<Utc>, e: NewEvent) -> Result<()> {
    let mut conn = db.acquire().await?;
    append(&mut conn, at, Kind::Refused, e).await
}

/// One ledger event as read back.
#[derive(Debug, Clone, Serialize, Deserialize, sqlx::FromRow)]
pub struct Event {
    pub id: i64,
    pub at: DateTime<Utc>,
    pub kind: String,
    pub tenant: Option<String>,
    pub resource: Option<String>,
    pub region: Option<String>,
    pub agent: Option<String>,
    pub epoch: Option<i64>,
    pub seq: Option<i64>,
    pub lease_id: Option<Uuid>,
    pub tokens: Option<i64>,
    pub reason: Option<String>,
    pub detail: Option<serde_json::Value>,
}

/// Query of `GET /v1/ledger`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LedgerQuery {
    pub tenant: Option<String>,
    pub resource: Option<String>,
    pub region: Option<String>,
    /// RFC 3339; only events at or after it.
    pub since: Option<String>,
    /// The `next_cursor` of the previous page.
    pub cursor: Option<i64>,
    /// Page size, 1..=1000 (default 100).
    pub limit: Option<i64>,
}

/// A page of events, oldest first.
#[derive(Debug, Serialize, Deserialize)]
pub struct LedgerPage {
    pub events: Vec<Event>,
    /// Pass as `cursor` to read the following events.
    pub next_cursor: i64,
}

/// Largest page of `GET /v1/ledger`.
pub const MAX_PAGE: i64 = 1000;

/// Routes of this module.
pub fn router() -> Router<AppState> {
    Router::new().route("/v1/ledger", get(list))
}

/// Parses an RFC 3339 query parameter.
pub fn parse_time(field: &str, s: &str) -> Result<DateTime<Utc>> {
    DateTime::parse_from_rfc3339(s)
        .map(|t| t.with_timezone(&Utc))
        .map_err(|e| Error::invalid(field, format!("{s:?} is not an RFC 3339 timestamp: {e}")))
}

async fn list(State(state): State<AppState>, ApiQuery(q): ApiQuery<LedgerQuery>) -> Result<Json<LedgerPage>> {
    for (field, v) in [("tenant", &q.tenant), ("resource", &q.resource), ("region", &q.region)] {
        if let Some(v) = v {
            check_id(field, v)?;
        }
    }
    let since = q.since.as_deref().map(|s| parse_time("since", s)).transpose()?;
    let limit = q.limit.unwrap_or(100);
    if !(1..=MAX_PAGE).contains(&limit) {
        return Err(Error::invalid("limit", format!("must be between 1 and {MAX_PAGE}, got {limit}")));
    }
    let cursor = q.cursor.unwrap_or(0);
    if cursor < 0 {
        return Err(Error::invalid("cursor", "must not be negative"));
    }
    let events: Vec<Event> = sqlx::query_as(include_str!("sql/ledger_page.sql"))
        .bind(cursor)
        .bind(q.tenant)
        .bind(q.resource)
        .bind(q.region)
        .bind(since)
        .bind(limit)
        .fetch_all(&state.db)
        .await?;
    let next_cursor = events.last().map(|e| e.id).unwrap_or(cursor);
    Ok(Json(LedgerPage { events, next_cursor }))
}

/// Events that mention one lease, oldest first.
pub async fn for_lease(db: &PgPool, lease_id: Uuid) -> Result<Vec<Event>> {
    Ok(sqlx::query_as(include_str!("sql/ledger_for_lease.sql")).bind(lease_id).fetch_all(db).await?)
}
