//! The one way the allocator begins a transaction.
//!
//! sqlx 0.8's `Pool::begin` is not cancel-safe on PostgreSQL
//! (transact-rs/sqlx#4393): it sends `BEGIN` and only counts the
//! transaction once the answer is read, so a request future dropped in
//! between (a client that gave up, the request timeout, a process resumed
//! from SIGSTOP finding its clients gone) leaves the session inside a
//! transaction that nothing rolls back, and the pool hands that connection
//! to the next request. Its statements then run inside the stale
//! transaction ("there is already a transaction in progress"), where a
//! write already answered can still be lost with it.
//!
//! Beginning on a task of its own makes the round trip finish whatever
//! happens to the caller: a caller that is gone drops the finished
//! transaction, which queues the `ROLLBACK` sqlx sends before the
//! connection is used again. Everything after `BEGIN` is cancel-safe in
//! sqlx (a dropped transaction rolls back, a dropped statement is drained).
//! `allocator/clippy.toml` forbids `Pool::begin` anywhere else.

use sqlx::{PgPool, Postgres, Transaction};

/// Begins a transaction on a connection of `db`.
pub async fn begin(db: &PgPool) -> Result<Transaction<'static, Postgres>, sqlx::Error> {
    let db = db.clone();
    #[allow(clippy::disallowed_methods)] // the one place, made cancel-safe here
    let task = tokio::spawn(async move { db.begin().await });
    match task.await {
        Ok(begun) => begun,
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        // Only a runtime shutting down cancels the task.
        Err(_) => Err(sqlx::Error::PoolClosed),
    }
}
