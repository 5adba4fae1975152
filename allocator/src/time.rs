//! The allocator's one clock for windows (I8, DESIGN §6): the database's.
//!
//! Every decision that depends on "now" (which window is current or next,
//! whether `"next"` may be granted yet, `expires_at` and `expires_in_ms`,
//! whether a release still returns tokens, whether a report item is in the
//! future or beyond the horizon, which open pools a policy change touches,
//! the retention cutoffs) reads `clock_timestamp()` of the database inside
//! the transaction that makes it. Replicas of the allocator therefore agree
//! on windows whatever their own clocks say; the cost is one statement per
//! transaction (a local round trip to the database).
//!
//! Tests stand at a chosen instant with [`DbClock::shifted`]: the offset of
//! the given clock from the system clock is added to the database's time,
//! so time still flows. Production never shifts it.

use crate::error::Result;
use chrono::{DateTime, Utc};
use quota_shared::clock::Clock;
use sqlx::PgConnection;
use std::sync::Arc;

/// Reads "now" from the database.
#[derive(Clone, Default)]
pub struct DbClock {
    shift: Option<Arc<dyn Clock>>,
}

impl DbClock {
    /// The database's clock as it is (production).
    pub fn database() -> Self {
        DbClock { shift: None }
    }

    /// The database's clock shifted by `clock`'s offset from the system
    /// clock (tests that stand at a chosen instant).
    pub fn shifted(clock: Arc<dyn Clock>) -> Self {
        DbClock { shift: Some(clock) }
    }

    /// The database's current time (plus the test shift), read on `conn`,
    /// usually inside the transaction that decides with it.
    #[tracing::instrument(name = "db_now", level = "debug", skip_all)]
    pub async fn now(&self, conn: &mut PgConnection) -> Result<DateTime<Utc>> {
        // clock_timestamp() is never null; the "!" tells the macro so.
        let db = sqlx::query_file_scalar!("src/sql/db_now.sql").fetch_one(conn).await?;
        Ok(match &self.shift {
            Some(c) => db + (c.now_utc() - Utc::now()),
            None => db,
        })
    }

    /// The test shift in microseconds (0 in production), for statements
    /// that read the database's clock themselves (`quota_grant`).
    pub fn shift_us(&self) -> i64 {
        match &self.shift {
            Some(c) => (c.now_utc() - Utc::now()).num_microseconds().unwrap_or(0),
            None => 0,
        }
    }

    /// [`DbClock::now`] on a connection of its own.
    pub async fn now_on(&self, db: &sqlx::PgPool) -> Result<DateTime<Utc>> {
        let mut conn = db.acquire().await?;
        self.now(&mut conn).await
    }
}
