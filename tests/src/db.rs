//! The SQL tests run against the allocator's database, as named functions:
//! one per question a test asks of the tables (or of PostgreSQL's own
//! state), so a test reads as its assertion and a schema change is fixed
//! here once. Writes are only what a test must stage behind the
//! allocator's back (a late ledger event, a prefetched pool).
//!
//! Every function panics on a database error: in a test that is the
//! failure to report.

use chrono::{DateTime, Utc};
use sqlx::{PgConnection, PgPool};

/// A table whose rows a test counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Table {
    LedgerEvent,
    Lease,
    Pool,
    PoolRegion,
    Report,
    Agent,
    AgentStatus,
    PolicyVersion,
}

impl Table {
    fn name(self) -> &'static str {
        match self {
            Table::LedgerEvent => "ledger_event",
            Table::Lease => "lease",
            Table::Pool => "pool",
            Table::PoolRegion => "pool_region",
            Table::Report => "report",
            Table::Agent => "agent",
            Table::AgentStatus => "agent_status",
            Table::PolicyVersion => "policy_version",
        }
    }
}

/// How many rows `table` holds.
pub async fn rows(db: &PgPool, table: Table) -> i64 {
    // The name comes from the enum above, never from input.
    sqlx::query_scalar(&format!("select count(*) from {}", table.name())).fetch_one(db).await.unwrap()
}

// --- the ledger ------------------------------------------------------

/// The ids of the tenant's ledger events, in order.
pub async fn ledger_ids(db: &PgPool, tenant: &str) -> Vec<i64> {
    sqlx::query_scalar("select id from ledger_event where tenant = $1 order by id")
        .bind(tenant)
        .fetch_all(db)
        .await
        .unwrap()
}

/// Whether ledger event `id` exists.
pub async fn ledger_event_exists(db: &PgPool, id: i64) -> bool {
    sqlx::query_scalar::<_, i64>("select count(*) from ledger_event where id = $1")
        .bind(id)
        .fetch_one(db)
        .await
        .unwrap()
        > 0
}

/// Ledger events older than `at`.
pub async fn ledger_events_before(db: &PgPool, at: DateTime<Utc>) -> i64 {
    sqlx::query_scalar("select count(*) from ledger_event where at < $1")
        .bind(at)
        .fetch_one(db)
        .await
        .unwrap()
}

/// Refusals of a region's credential acting for another region, in the
/// ledger.
pub async fn wrong_region_refusals(db: &PgPool, region: &str) -> i64 {
    sqlx::query_scalar(
        "select count(*) from ledger_event where kind = 'refused' and reason = 'wrong_region' and region = $1",
    )
    .bind(region)
    .fetch_one(db)
    .await
    .unwrap()
}

/// Appends a `reported` ledger event on `conn` (inside the caller's
/// transaction, when it holds one: an event committed late); returns its id.
pub async fn insert_reported_event(
    conn: &mut PgConnection,
    tenant: &str,
    resource: Option<&str>,
    region: Option<&str>,
) -> i64 {
    sqlx::query_scalar(
        "insert into ledger_event (at, kind, tenant, resource, region) values (now(), 'reported', $1, $2, $3) \
         returning id",
    )
    .bind(tenant)
    .bind(resource)
    .bind(region)
    .fetch_one(conn)
    .await
    .unwrap()
}

/// Appends `n` `reported` events with tokens 1 to `n`.
pub async fn insert_reported_series(db: &PgPool, tenant: &str, resource: &str, region: &str, n: i64) {
    sqlx::query(
        "insert into ledger_event (at, kind, tenant, resource, region, tokens) \
         select now(), 'reported', $1, $2, $3, g from generate_series(1, $4) g",
    )
    .bind(tenant)
    .bind(resource)
    .bind(region)
    .bind(n)
    .execute(db)
    .await
    .unwrap();
}

// --- leases and pools ------------------------------------------------

/// Leases that expire after their window ends (I2; a check constraint
/// forbids them too).
pub async fn leases_past_window_end(db: &PgPool) -> i64 {
    sqlx::query_scalar(
        "select count(*) from lease where expires_at > to_timestamp((window_start + window_secs)::double precision)",
    )
    .fetch_one(db)
    .await
    .unwrap()
}

/// Leases of neither the window they were issued in nor the next, or
/// expiring after their window ends (I2).
pub async fn leases_off_window(db: &PgPool) -> i64 {
    sqlx::query_scalar(
        "select count(*) from lease where window_start not in \
           (floor(extract(epoch from issued_at) / window_secs)::bigint * window_secs, \
            floor(extract(epoch from issued_at) / window_secs)::bigint * window_secs + window_secs) \
         or expires_at > to_timestamp((window_start + window_secs)::double precision)",
    )
    .fetch_one(db)
    .await
    .unwrap()
}

/// Leases expiring before `at`.
pub async fn leases_expiring_before(db: &PgPool, at: DateTime<Utc>) -> i64 {
    sqlx::query_scalar("select count(*) from lease where expires_at < $1")
        .bind(at)
        .fetch_one(db)
        .await
        .unwrap()
}

/// Whether lease `id` is committed.
pub async fn lease_exists(db: &PgPool, id: &str) -> bool {
    sqlx::query_scalar::<_, i64>("select count(*) from lease where lease_id = $1::uuid")
        .bind(id)
        .fetch_one(db)
        .await
        .unwrap()
        > 0
}

/// Pools granted beyond their limit or whose granted count differs from
/// their leases' tokens (I1): `(resource, granted, lease tokens)`.
pub async fn pools_out_of_balance(db: &PgPool) -> Vec<(String, i64, i64)> {
    sqlx::query_as(
        "select p.resource, p.granted, coalesce((select sum(tokens)::bigint from lease l
                  where l.tenant = p.tenant and l.resource = p.resource and l.window_start = p.window_start), 0)
           from pool p where p.granted > p.limit_tokens
              or p.granted <> coalesce((select sum(tokens)::bigint from lease l
                  where l.tenant = p.tenant and l.resource = p.resource and l.window_start = p.window_start), 0)",
    )
    .fetch_all(db)
    .await
    .unwrap()
}

/// Stages a pool row for a window, as a prefetch would leave it.
pub async fn insert_pool(
    db: &PgPool,
    tenant: &str,
    resource: &str,
    window_start: i64,
    window_secs: i64,
    limit: i64,
) {
    sqlx::query(
        "insert into pool (tenant, resource, window_start, window_secs, limit_tokens, fallback_per_region, created_at) \
         values ($1, $2, $3, $4, $5, 1, now())",
    )
    .bind(tenant)
    .bind(resource)
    .bind(window_start)
    .bind(window_secs)
    .bind(limit)
    .execute(db)
    .await
    .unwrap();
}

/// Pool-region rows of the oldest window any pool has.
pub async fn oldest_window_regions(db: &PgPool) -> i64 {
    sqlx::query_scalar(
        "select count(*) from pool_region where window_start = (select min(window_start) from pool)",
    )
    .fetch_one(db)
    .await
    .unwrap()
}

/// Tokens every region reported consumed, in all.
pub async fn consumed_total(db: &PgPool) -> i64 {
    sqlx::query_scalar::<_, Option<i64>>("select sum(consumed)::bigint from pool_region")
        .fetch_one(db)
        .await
        .unwrap()
        .unwrap_or(0)
}

// --- agents and reports ----------------------------------------------

/// The report ids kept.
pub async fn report_ids(db: &PgPool) -> Vec<String> {
    sqlx::query_scalar("select report_id from report order by report_id").fetch_all(db).await.unwrap()
}

/// The registered agents' names, in order.
pub async fn agent_names(db: &PgPool) -> Vec<String> {
    sqlx::query_scalar("select agent from agent order by agent").fetch_all(db).await.unwrap()
}

/// The stored agent statuses: `(agent, epoch, outbox_depth)` by region
/// and agent.
pub async fn agent_statuses(db: &PgPool) -> Vec<(String, i64, i64)> {
    sqlx::query_as("select agent, epoch, outbox_depth from agent_status order by region, agent")
        .fetch_all(db)
        .await
        .unwrap()
}

/// Locks agent `region/agent`'s row on `conn` until its transaction ends
/// (a registration of that agent then waits).
pub async fn lock_agent_row(conn: &mut PgConnection, region: &str, agent: &str) {
    sqlx::query("select 1 from agent where region = $1 and agent = $2 for update")
        .bind(region)
        .bind(agent)
        .execute(conn)
        .await
        .unwrap();
}

// --- PostgreSQL's own state --------------------------------------------

/// The database's clock, read now (not at the transaction's start).
pub async fn clock_timestamp(db: &PgPool) -> DateTime<Utc> {
    sqlx::query_scalar("select clock_timestamp()").fetch_one(db).await.unwrap()
}

/// The process id of `conn`'s backend.
pub async fn backend_pid(conn: &mut PgConnection) -> i32 {
    sqlx::query_scalar("select pg_backend_pid()").fetch_one(conn).await.unwrap()
}

/// The transaction id of `conn`'s open transaction (assigned now).
pub async fn current_xact_id(conn: &mut PgConnection) -> u64 {
    let id: String = sqlx::query_scalar("select pg_current_xact_id()::text").fetch_one(conn).await.unwrap();
    id.parse().unwrap()
}

/// The oldest transaction id a new snapshot still sees as running.
pub async fn snapshot_xmin(db: &PgPool) -> u64 {
    let id: String = sqlx::query_scalar("select pg_snapshot_xmin(pg_current_snapshot())::text")
        .fetch_one(db)
        .await
        .unwrap();
    id.parse().unwrap()
}

/// The state of backend `pid` (`active`, `idle in transaction`, ...);
/// `None` once it is gone.
pub async fn backend_state(db: &PgPool, pid: i32) -> Option<String> {
    sqlx::query_scalar::<_, Option<String>>("select state from pg_stat_activity where pid = $1")
        .bind(pid)
        .fetch_optional(db)
        .await
        .unwrap()
        .flatten()
}

/// Backends waiting on a lock while running a statement containing `text`.
pub async fn lock_waiters(db: &PgPool, text: &str) -> i64 {
    sqlx::query_scalar(
        "select count(*) from pg_stat_activity where wait_event_type = 'Lock' and strpos(query, $1) > 0",
    )
    .bind(text)
    .fetch_one(db)
    .await
    .unwrap()
}

/// Other backends idle inside an open transaction.
pub async fn idle_in_transaction(db: &PgPool) -> i64 {
    sqlx::query_scalar(
        "select count(*) from pg_stat_activity where state like 'idle in transaction%' and pid <> pg_backend_pid()",
    )
    .fetch_one(db)
    .await
    .unwrap()
}

/// Sleeps inside `conn`'s transaction (keeps it open for `secs`).
pub async fn sleep_in_transaction(conn: &mut PgConnection, secs: f64) {
    sqlx::query("select pg_sleep($1)").bind(secs).execute(conn).await.unwrap();
}
