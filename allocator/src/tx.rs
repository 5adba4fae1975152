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
//!
//! It also owns following a PostgreSQL failover (issue 34): which errors
//! mean "this connection no longer reaches a writable primary"
//! ([`crate::error::is_failover_error`], a rule of the error module),
//! retrying a statement that is safe to repeat
//! within a short budget ([`retry_failover`]), and dropping the pooled
//! connections opened before the failover ([`opened_before_failover`]).

use crate::error::Error;
use sqlx::{PgPool, Postgres, Transaction};
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

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

/// How long a statement is retried across a PostgreSQL failover, from its
/// first attempt: short enough to stay inside an agent's grant timeout,
/// long enough to cover HAProxy noticing a demoted primary (its check runs
/// every 500 ms, see deploy/patroni/haproxy.cfg) and a switchover's
/// demote-then-promote.
pub const FAILOVER_BUDGET: Duration = Duration::from_millis(900);

/// Pauses between attempts; the last one repeats until the budget is spent.
const FAILOVER_BACKOFF: [Duration; 4] = [
    Duration::from_millis(25),
    Duration::from_millis(75),
    Duration::from_millis(150),
    Duration::from_millis(250),
];

/// When (ms after [`clock_origin`], 0 for never) a failover error was last
/// seen. Process-wide: an allocator process talks to one database.
static LAST_FAILOVER_MS: AtomicU64 = AtomicU64::new(0);

fn clock_origin() -> Instant {
    static ORIGIN: OnceLock<Instant> = OnceLock::new();
    *ORIGIN.get_or_init(Instant::now)
}

/// Records that a failover error was seen now: every pooled connection
/// opened before this instant may lead to the old primary (a demoted one
/// answers 25006 on each write), so the pool drops them
/// ([`opened_before_failover`]) instead of handing them out one by one.
pub fn mark_failover() {
    let ms = clock_origin().elapsed().as_millis() as u64;
    LAST_FAILOVER_MS.store(ms.max(1), Ordering::Relaxed);
}

/// Whether a connection `age` old was opened before the last failover
/// error ([`mark_failover`]); the pool's `before_acquire` closes it.
pub fn opened_before_failover(age: Duration) -> bool {
    opened_before(LAST_FAILOVER_MS.load(Ordering::Relaxed), clock_origin().elapsed(), age)
}

/// Whether a connection `age` old at `now` was opened before the mark at
/// `mark_ms` (0: no mark); instants count from [`clock_origin`].
fn opened_before(mark_ms: u64, now: Duration, age: Duration) -> bool {
    mark_ms != 0 && now.saturating_sub(age) < Duration::from_millis(mark_ms)
}

/// Runs `op` and, while it fails with a failover error
/// ([`Error::is_failover`]), again on a fresh connection, until it succeeds,
/// fails otherwise, or [`FAILOVER_BUDGET`] is spent (the last error is
/// answered: 503). Only for operations safe to repeat: a grant is
/// idempotent by its key (I3), a report by its id (I7), so an attempt that
/// committed before its answer was lost is replayed, not applied twice.
pub async fn retry_failover<T, F, Fut>(what: &'static str, mut op: F) -> Result<T, Error>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, Error>>,
{
    let started = Instant::now();
    let mut attempt = 0;
    loop {
        match op().await {
            Err(e) if e.is_failover() => {
                mark_failover();
                let pause = FAILOVER_BACKOFF[attempt.min(FAILOVER_BACKOFF.len() - 1)];
                attempt += 1;
                if started.elapsed() + pause > FAILOVER_BUDGET {
                    return Err(e);
                }
                tracing::warn!(what, attempt, error = %e, "database failover: retrying on a fresh connection");
                tokio::time::sleep(pause).await;
            }
            other => return other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::error::fake_db::server;

    #[test]
    fn a_read_only_primary_is_unavailable_and_a_failover() {
        let e = Error::from(server("25006"));
        assert_eq!(e.code(), "database_unavailable");
        assert!(e.is_failover());
        assert!(!Error::from(server("57014")).is_failover());
    }

    #[test]
    fn connections_opened_before_a_failover_are_dropped() {
        let s = Duration::from_secs;
        // No failover seen: every connection is kept.
        assert!(!opened_before(0, s(100), s(100)));
        // Marked at 50 s: at 60 s a connection 20 s old predates the mark,
        // one 5 s old was opened after it.
        assert!(opened_before(50_000, s(60), s(20)));
        assert!(!opened_before(50_000, s(60), s(5)));
    }

    #[tokio::test]
    async fn failovers_are_retried_within_the_budget_and_other_errors_not() {
        let mut calls = 0;
        let r = retry_failover("test", || {
            calls += 1;
            let n = calls;
            async move {
                if n < 3 {
                    Err(Error::from(server("57P01")))
                } else {
                    Ok(n)
                }
            }
        })
        .await;
        assert_eq!(r.ok(), Some(3));
        let started = Instant::now();
        let r: Result<(), Error> =
            retry_failover("test", || async { Err(Error::from(server("25006"))) }).await;
        assert!(r.is_err());
        assert!(started.elapsed() <= FAILOVER_BUDGET, "{:?}", started.elapsed());
        let mut calls = 0;
        let r: Result<(), Error> = retry_failover("test", || {
            calls += 1;
            async { Err(Error::from(server("23505"))) }
        })
        .await;
        assert!(r.is_err());
        assert_eq!(calls, 1);
    }
}
