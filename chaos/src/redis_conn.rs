//! The lab's own look into a region's Redis (beside the agents, never for
//! them): a connection whose connect and every reply are bounded, so a
//! Redis that a scenario stopped or cut fails the check instead of hanging
//! the run, and SCAN over a key pattern that ends even when the pattern is
//! wrong.

use redis::aio::{ConnectionLike, MultiplexedConnection};
use std::time::Duration;

/// Most SCAN pages read (each asks for 1,000 keys): the lab's Redis holds
/// a few thousand keys at most, so hitting this means the cursor never
/// came back to 0, not a large keyspace.
pub const MAX_SCAN_PAGES: usize = 1_000;

/// A multiplexed connection to `url`; the connect and every reply give up
/// after `timeout`.
pub async fn connect(url: &str, timeout: Duration) -> Result<MultiplexedConnection, String> {
    let client = redis::Client::open(url).map_err(|e| format!("redis url: {e}"))?;
    let cfg = redis::AsyncConnectionConfig::new().set_response_timeout(Some(timeout));
    tokio::time::timeout(timeout, client.get_multiplexed_async_connection_with_config(&cfg))
        .await
        .map_err(|_| "connecting to Redis timed out".to_string())?
        .map_err(|e| format!("connecting to Redis: {e}"))
}

/// Every key that matches the glob `pattern`, in SCAN order (a key may
/// repeat if the keyspace is rehashed meanwhile, as SCAN promises).
pub async fn scan<C: ConnectionLike>(conn: &mut C, pattern: &str) -> Result<Vec<String>, String> {
    let mut cursor: u64 = 0;
    let mut all = Vec::new();
    for _ in 0..MAX_SCAN_PAGES {
        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(1000)
            .query_async(conn)
            .await
            .map_err(|e| format!("SCAN: {e}"))?;
        all.extend(keys);
        if next == 0 {
            return Ok(all);
        }
        cursor = next;
    }
    Err(format!("SCAN of {pattern} did not finish in {MAX_SCAN_PAGES} pages"))
}

/// `prefix` with the glob's special characters escaped, followed by `*`:
/// the pattern of every key under `prefix`.
pub fn under(prefix: &str) -> String {
    format!("{}*", prefix.replace('[', "\\[").replace('*', "\\*").replace('?', "\\?"))
}

#[cfg(test)]
mod tests {
    use super::under;

    #[test]
    fn a_prefix_matches_literally() {
        assert_eq!(under("q:{a/b}:"), "q:{a/b}:*");
        assert_eq!(under("x[1]*?"), "x\\[1]\\*\\?*");
    }
}
