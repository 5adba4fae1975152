//! Waiting for a condition with a deadline: tests never sleep for a fixed
//! time hoping something happened.

use std::future::Future;
use std::time::{Duration, Instant};

/// Polls `check` every 20 ms until it returns `Some`, or panics with `what`
/// after `timeout`.
pub async fn until<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = check().await {
            return v;
        }
        if Instant::now() > deadline {
            panic!("timed out after {timeout:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Sleeps until the wall clock reaches `at` (used to line a test up with a
/// UTC window boundary, which is a condition on time itself).
pub async fn until_utc(at: chrono::DateTime<chrono::Utc>) {
    let now = chrono::Utc::now();
    if at > now {
        tokio::time::sleep((at - now).to_std().unwrap_or_default()).await;
    }
}
