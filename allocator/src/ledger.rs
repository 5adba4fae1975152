//! The append-only ledger: every registration, grant, replay, refusal,
//! release, report, policy change and change of a region's permits is one
//! row, and `GET /v1/ledger` reads
//! them back in commit order with a cursor that is stable while events
//! arrive and live while other connections hold transactions open.
//!
//! The cursor walks `(txid, id)`, where `txid` is the row's position, fixed
//! by a trigger as the row is inserted (migration `20261204200001`). A read
//! first computes a [`Horizon`] from this database's ledger writers only
//! (`sql/ledger_tick.sql`, `sql/ledger_horizon.sql`) and then serves rows
//! below it: each is committed, and every row still to commit sorts at or
//! above it. Only a transaction that itself wrote ledger rows can hold the
//! horizon back, and the trigger lets such a transaction stay idle (or run
//! one more statement) for at most `quota.ledger_writer_timeout` (30 s).
//! Every page says up to which instant it is complete (`as_of`).

use crate::error::{Error, Result};
use crate::http::extract::{check_id, ApiQuery};
use crate::state::AppState;
use axum::body::Body;
use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::Json;
use chrono::{DateTime, Utc};
use quota_shared::wire::ErrorBody;
use serde::{Deserialize, Serialize};
use sqlx::{PgConnection, PgPool};
use utoipa::{IntoParams, ToSchema};
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
    /// A region's permit lease of a concurrency quota changed what it
    /// holds (`tokens`: permits held now; see `crate::permits`).
    PermitLease,
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
            Kind::PermitLease => "permit_lease",
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
#[tracing::instrument(level = "debug", skip_all, fields(kind = kind.as_str()))]
pub async fn append(conn: &mut PgConnection, at: DateTime<Utc>, kind: Kind, e: NewEvent) -> Result<()> {
    sqlx::query_file!(
        "src/sql/ledger_append.sql",
        at,
        kind.as_str(),
        e.tenant,
        e.resource,
        e.region,
        e.agent,
        e.epoch,
        e.seq,
        e.lease_id,
        e.tokens,
        e.reason,
        e.detail
    )
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
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Event {
    /// Unique; draws from a sequence, so it is not the order of commits.
    pub id: i64,
    pub at: DateTime<Utc>,
    /// `registered`, `granted`, `replayed`, `refused`, `released`, `reported`, `policy_changed`,
    /// `permit_lease` (a region's permits changed: `tokens` is what it holds
    /// now, `detail.held_before` what it held before, `seq` the lease's new
    /// sequence number).
    pub kind: String,
    pub tenant: Option<String>,
    pub resource: Option<String>,
    pub region: Option<String>,
    pub agent: Option<String>,
    pub epoch: Option<i64>,
    pub seq: Option<i64>,
    pub lease_id: Option<Uuid>,
    pub tokens: Option<i64>,
    /// Why a request was refused (`stale_epoch`, `idempotency_mismatch`,
    /// `wrong_region`).
    pub reason: Option<String>,
    #[schema(value_type = Option<Object>)]
    pub detail: Option<serde_json::Value>,
    /// The writing transaction's id, the first half of the cursor order.
    #[serde(skip)]
    #[schema(ignore)]
    pub txid: String,
}

impl Event {
    /// The cursor that continues after this event.
    pub fn cursor(&self) -> String {
        format!("{}.{}", self.txid, self.id)
    }
}

/// Query of `GET /v1/ledger`.
#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct LedgerQuery {
    pub tenant: Option<String>,
    pub resource: Option<String>,
    pub region: Option<String>,
    /// RFC 3339; only events at or after it.
    pub since: Option<String>,
    /// The `next_cursor` of the previous page (opaque).
    pub cursor: Option<String>,
    /// Page size, 1..=1000 (default 100); not with `format=ndjson`.
    pub limit: Option<i64>,
    /// `json` (default, one page) or `ndjson` (every matching event, streamed).
    pub format: Option<String>,
}

/// A page of events in commit order.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct LedgerPage {
    pub events: Vec<Event>,
    /// Pass as `cursor` to read the following events; the cursor given (or
    /// null) when the page is empty. Events still being committed appear on
    /// a later page, never before this cursor.
    pub next_cursor: Option<String>,
    /// The newest commit this read reflects (allocator clock): every event
    /// committed before it is on this page, behind the cursor, or (when the
    /// page is full) on the pages that follow. Normally the instant of the
    /// read; earlier while a transaction that wrote ledger events is still
    /// open (it is then that transaction's start). Null only when such a
    /// transaction belongs to another database role whose start this role
    /// may not see. `format=ndjson` answers it in the `Ledger-As-Of` header.
    pub as_of: Option<DateTime<Utc>>,
}

/// Header of an NDJSON export carrying the `as_of` of the whole export.
pub const AS_OF_HEADER: &str = "ledger-as-of";

/// Largest page of `GET /v1/ledger`, and the batch an NDJSON export reads.
pub const MAX_PAGE: i64 = 1000;

/// Parses an RFC 3339 query parameter.
pub fn parse_time(field: &str, s: &str) -> Result<DateTime<Utc>> {
    DateTime::parse_from_rfc3339(s)
        .map(|t| t.with_timezone(&Utc))
        .map_err(|e| Error::invalid(field, format!("{s:?} is not an RFC 3339 timestamp: {e}")))
}

/// Filters of a ledger read, validated.
#[derive(Debug, Clone)]
struct Filter {
    tenant: Option<String>,
    resource: Option<String>,
    region: Option<String>,
    since: Option<DateTime<Utc>>,
}

/// A position in the `(txid, id)` order; the start is `(0, 0)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
struct Cursor {
    txid: u64,
    id: i64,
}

impl Cursor {
    fn parse(s: &str) -> Result<Cursor> {
        let bad = || Error::invalid("cursor", format!("{s:?} is not a cursor this endpoint returned"));
        let (t, i) = s.split_once('.').ok_or_else(bad)?;
        let txid = t.parse::<u64>().map_err(|_| bad())?;
        let id = i.parse::<i64>().map_err(|_| bad())?;
        if id < 0 {
            return Err(bad());
        }
        Ok(Cursor { txid, id })
    }
}

/// Where a read of the ledger may stop, and up to which instant that read
/// is complete.
#[derive(Debug, Clone)]
pub struct Horizon {
    /// Serve only rows whose position is below this (an xid8, as text).
    position: String,
    /// See [`LedgerPage::as_of`].
    pub as_of: Option<DateTime<Utc>>,
}

/// Takes the ledger's horizon now (see `sql/ledger_horizon.sql`). Three
/// statements in order, each with its own snapshot: the tick, the horizon,
/// and later the page query.
#[tracing::instrument(level = "debug", skip_all)]
pub async fn horizon(db: &PgPool, clock: &crate::time::DbClock) -> Result<Horizon> {
    let mut conn = db.acquire().await?;
    // On the database's clock, like every event's `at` (I8).
    let now = clock.now(&mut conn).await?;
    sqlx::query_file!("src/sql/ledger_tick.sql").fetch_one(&mut *conn).await?;
    let row = sqlx::query_file!("src/sql/ledger_horizon.sql").fetch_one(&mut *conn).await?;
    // `now` was read before the tick, so every commit before it is below the
    // horizon. An open ledger writer holds back what committed after it got
    // its xid, hence after its transaction started: `as_of` moves back by
    // how long that transaction has run (measured on the database's clock,
    // like `now`).
    let as_of = match (row.since_unknown, row.held_secs) {
        (true, _) => None,
        (false, None) => Some(now),
        (false, Some(secs)) => {
            let held = chrono::Duration::milliseconds((secs.max(0.0) * 1000.0).ceil() as i64);
            Some(now - held)
        }
    };
    Ok(Horizon { position: row.horizon, as_of })
}

#[tracing::instrument(level = "debug", skip_all, fields(limit = limit))]
async fn page(db: &PgPool, f: &Filter, after: Cursor, limit: i64, horizon: &Horizon) -> Result<Vec<Event>> {
    Ok(sqlx::query_file_as!(
        Event,
        "src/sql/ledger_page.sql",
        after.txid.to_string(),
        after.id,
        f.tenant,
        f.resource,
        f.region,
        f.since,
        limit,
        horizon.position
    )
    .fetch_all(db)
    .await?)
}

/// `GET /v1/ledger`: one page of events in commit order, or with
/// `format=ndjson` every matching event as one JSON object per line.
#[utoipa::path(
    get,
    path = "/v1/ledger",
    params(LedgerQuery),
    responses(
        (status = 200, description = "A page of events (or NDJSON with format=ndjson)", body = LedgerPage,
            headers(("ledger-as-of" = String, description = "format=ndjson only: the export's as_of (RFC 3339), see LedgerPage.as_of"))),
        (status = 401, description = "Missing or wrong admin token", body = ErrorBody),
        (status = 422, description = "Invalid filter; the message names the field", body = ErrorBody),
    ),
    security(("admin_token" = [])),
    tag = "operator"
)]
pub(crate) async fn list(
    State(state): State<AppState>,
    ApiQuery(q): ApiQuery<LedgerQuery>,
) -> Result<Response> {
    for (field, v) in [("tenant", &q.tenant), ("resource", &q.resource), ("region", &q.region)] {
        if let Some(v) = v {
            check_id(field, v)?;
        }
    }
    let since = q.since.as_deref().map(|s| parse_time("since", s)).transpose()?;
    // An empty cursor is the start, so a shell loop can begin with `cursor=`.
    let cursor = q.cursor.as_deref().filter(|c| !c.is_empty()).map(Cursor::parse).transpose()?;
    let filter = Filter { tenant: q.tenant, resource: q.resource, region: q.region, since };
    match q.format.as_deref().unwrap_or("json") {
        "json" => {}
        "ndjson" => {
            if q.limit.is_some() {
                return Err(Error::invalid(
                    "limit",
                    "format=ndjson exports every matching event; omit limit",
                ));
            }
            let horizon = horizon(&state.db, &state.db_clock).await?;
            return Ok(export(state.db.clone(), filter, cursor.unwrap_or_default(), horizon));
        }
        other => return Err(Error::invalid("format", format!("must be json or ndjson, got {other:?}"))),
    }
    let limit = q.limit.unwrap_or(100);
    if !(1..=MAX_PAGE).contains(&limit) {
        return Err(Error::invalid("limit", format!("must be between 1 and {MAX_PAGE}, got {limit}")));
    }
    let horizon = horizon(&state.db, &state.db_clock).await?;
    let events = page(&state.db, &filter, cursor.unwrap_or_default(), limit, &horizon).await?;
    let next_cursor = events.last().map(Event::cursor).or(q.cursor.filter(|c| !c.is_empty()));
    Ok(Json(LedgerPage { events, next_cursor, as_of: horizon.as_of }).into_response())
}

/// Streams every matching event as NDJSON, one bounded page at a time, so
/// memory stays at one page however long the ledger is. The same stable
/// cursor walks the pages, all below one horizon taken before the first:
/// the export is every matching event committed before its `as_of` (the
/// `Ledger-As-Of` header), and it ends at the first short page, so it
/// terminates even while writers keep appending. A database error after the
/// first byte cannot change the status any more: it is logged and the body
/// is cut short, which a client sees as an incomplete transfer.
fn export(db: PgPool, filter: Filter, start: Cursor, horizon: Horizon) -> Response {
    let as_of = horizon.as_of;
    let stream = futures::stream::try_unfold(Some(start), move |state| {
        let (db, filter, horizon) = (db.clone(), filter.clone(), horizon.clone());
        async move {
            let Some(after) = state else { return Ok(None) };
            let events = page(&db, &filter, after, MAX_PAGE, &horizon).await.map_err(|e| {
                tracing::warn!(error = %e, "ledger export failed");
                std::io::Error::other(e.to_string())
            })?;
            let mut buf = Vec::with_capacity(events.len() * 256);
            for e in &events {
                serde_json::to_writer(&mut buf, e).map_err(std::io::Error::other)?;
                buf.push(b'\n');
            }
            let next = match events.last() {
                Some(last) if events.len() as i64 == MAX_PAGE => {
                    Some(Cursor { txid: last.txid.parse().unwrap_or(u64::MAX), id: last.id })
                }
                _ => None,
            };
            Ok::<_, std::io::Error>(Some((axum::body::Bytes::from(buf), next)))
        }
    });
    let mut resp = Body::from_stream(stream).into_response();
    resp.headers_mut()
        .insert(header::CONTENT_TYPE, axum::http::HeaderValue::from_static("application/x-ndjson"));
    if let Some(v) = as_of.and_then(|t| axum::http::HeaderValue::from_str(&t.to_rfc3339()).ok()) {
        resp.headers_mut().insert(AS_OF_HEADER, v);
    }
    resp
}

/// The latest refusals of `region` for a quota up to `at`, newest first.
#[tracing::instrument(level = "debug", skip_all, fields(tenant = %tenant, resource = %resource, region = %region, limit = limit))]
pub async fn refusals(
    conn: &mut PgConnection,
    tenant: &str,
    resource: &str,
    region: &str,
    at: DateTime<Utc>,
    limit: i64,
) -> Result<Vec<Event>> {
    Ok(sqlx::query_file_as!(Event, "src/sql/ledger_refusals.sql", tenant, resource, region, at, limit)
        .fetch_all(conn)
        .await?)
}

/// Events that mention one lease of quota `tenant`/`resource`, oldest
/// first (the quota bounds the search to its own rows).
#[tracing::instrument(level = "debug", skip_all, fields(%lease_id))]
pub async fn for_lease(db: &PgPool, lease_id: Uuid, tenant: &str, resource: &str) -> Result<Vec<Event>> {
    Ok(sqlx::query_file_as!(Event, "src/sql/ledger_for_lease.sql", lease_id, tenant, resource)
        .fetch_all(db)
        .await?)
}
