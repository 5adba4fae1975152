//! The lab's own look into PostgreSQL (the allocator's database or the
//! bench's), beside the allocator: a small pool that gives up waiting for
//! a connection after [`ACQUIRE_TIMEOUT`], so a database a scenario killed
//! fails the check instead of hanging the run.

use sqlx::postgres::{PgPool, PgPoolOptions};
use std::time::Duration;

/// Longest a query waits for a connection of the pool.
pub const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(10);

/// A pool of at most `max` connections to `url`; an error says `what` the
/// connection was for.
pub async fn connect(url: &str, max: u32, what: &str) -> Result<PgPool, String> {
    PgPoolOptions::new()
        .max_connections(max)
        .acquire_timeout(ACQUIRE_TIMEOUT)
        .connect(url)
        .await
        .map_err(|e| format!("{what}: {e}"))
}
