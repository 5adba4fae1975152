//! Waiting for a condition with a deadline: tests never sleep for a fixed
//! time hoping something happened. Every loop of the harness, the tests and
//! the lab that polls until a deadline goes through here, so each keeps its
//! own timeout and says what it waited for when that runs out.
//!
//! * [`until`]: async, polls an `Option` every 20 ms, panics with what it
//!   waited for (tests).
//! * [`poll`]: async, polls a `Result` at a given pace and answers the last
//!   `Err` at the deadline (what was seen instead), for callers that report
//!   errors rather than panic or that name the last observation.
//! * [`poll_blocking`] and [`until_blocking`]: the same for code that runs
//!   on a plain thread (starting servers, stopping processes).

use std::future::Future;
use std::time::{Duration, Instant};

/// How often [`until`] polls.
const EVERY: Duration = Duration::from_millis(20);

/// Polls `check` every 20 ms until it returns `Some`, or panics with `what`
/// after `timeout`.
pub async fn until<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let found = poll(timeout, EVERY, || {
        let f = check();
        async move { f.await.ok_or(()) }
    })
    .await;
    found.unwrap_or_else(|()| panic!("timed out after {timeout:?} waiting for {what}"))
}

/// Polls `check` every `every` until it returns `Ok`; after `timeout`
/// answers the `Err` of the last poll. `check` runs at least once; the
/// deadline is looked at after each poll.
pub async fn poll<T, E, F, Fut>(timeout: Duration, every: Duration, mut check: F) -> Result<T, E>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, E>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        match check().await {
            Ok(v) => return Ok(v),
            Err(e) if Instant::now() > deadline => return Err(e),
            Err(_) => tokio::time::sleep(every).await,
        }
    }
}

/// [`poll`] on the calling thread (sleeping it between polls).
pub fn poll_blocking<T, E>(
    timeout: Duration,
    every: Duration,
    mut check: impl FnMut() -> Result<T, E>,
) -> Result<T, E> {
    let deadline = Instant::now() + timeout;
    loop {
        match check() {
            Ok(v) => return Ok(v),
            Err(e) if Instant::now() > deadline => return Err(e),
            Err(_) => std::thread::sleep(every),
        }
    }
}

/// [`until`] on the calling thread, polling every `every`.
pub fn until_blocking<T>(
    what: &str,
    timeout: Duration,
    every: Duration,
    mut check: impl FnMut() -> Option<T>,
) -> T {
    poll_blocking(timeout, every, || check().ok_or(()))
        .unwrap_or_else(|()| panic!("timed out after {timeout:?} waiting for {what}"))
}

/// Sleeps until the wall clock reaches `at` (used to line a test up with a
/// UTC window boundary, which is a condition on time itself).
pub async fn until_utc(at: chrono::DateTime<chrono::Utc>) {
    let now = chrono::Utc::now();
    if at > now {
        tokio::time::sleep((at - now).to_std().unwrap_or_default()).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn poll_answers_the_first_ok() {
        let mut n = 0;
        let got: Result<i32, i32> = poll(Duration::from_secs(5), Duration::from_millis(1), || {
            n += 1;
            let seen = n;
            async move {
                if seen == 3 {
                    Ok(seen)
                } else {
                    Err(seen)
                }
            }
        })
        .await;
        assert_eq!(got, Ok(3));
    }

    #[tokio::test]
    async fn poll_answers_the_last_err_at_the_deadline() {
        let mut n = 0;
        let started = Instant::now();
        let got: Result<(), i32> = poll(Duration::from_millis(50), Duration::from_millis(5), || {
            n += 1;
            let seen = n;
            async move { Err(seen) }
        })
        .await;
        assert!(started.elapsed() >= Duration::from_millis(50));
        assert_eq!(got, Err(n), "the last poll's observation");
        assert!(n > 1, "polled more than once");
    }

    #[test]
    fn until_blocking_names_what_it_waited_for() {
        let r = std::panic::catch_unwind(|| {
            until_blocking("the moon", Duration::from_millis(10), Duration::from_millis(2), || None::<()>)
        });
        let msg = r.expect_err("times out");
        let msg = msg.downcast_ref::<String>().expect("a formatted message");
        assert!(msg.contains("waiting for the moon"), "{msg}");
    }
}
