//! The allocator's own window accounting (`GET /v1/windows/...`), the
//! numbers the ground truth of [`crate::traffic`] is compared with.

use quota_tests::http::Http;
use std::collections::BTreeMap;

// The allocator's own answer types: the lab reads exactly what operators read.
pub use allocator::windows::{RegionAccount, WindowAccount, WindowsPage as Page};

/// Most pages read in one call (each holds up to 100 windows).
const MAX_PAGES: usize = 100;

/// Every window of `tenant/resource` starting in `[from, to)`, by start.
pub async fn windows(
    admin: &Http,
    tenant: &str,
    resource: &str,
    from: i64,
    to: i64,
) -> Result<BTreeMap<i64, WindowAccount>, String> {
    let mut out = BTreeMap::new();
    let fmt = |t: i64| {
        chrono::DateTime::from_timestamp(t, 0)
            .unwrap_or_default()
            .to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
    };
    let mut cursor = fmt(from);
    for _ in 0..MAX_PAGES {
        let path = format!("/v1/windows/{tenant}/{resource}?from={}&to={}", enc(&cursor), enc(&fmt(to)));
        let resp = admin.get(&path).await;
        if resp.status != 200 {
            return Err(format!("GET {path}: {} {}", resp.status, resp.body));
        }
        let page: Page = serde_json::from_value(resp.body).map_err(|e| format!("windows answer: {e}"))?;
        for w in page.windows {
            out.insert(w.window_start.timestamp(), w);
        }
        match page.next_from {
            Some(n) => cursor = n.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
            None => return Ok(out),
        }
    }
    Ok(out)
}

/// `+` in an RFC 3339 offset must not turn into a space.
fn enc(s: &str) -> String {
    s.replace('+', "%2B").replace(':', "%3A")
}

/// How often [`settled`] reads the accounts again.
const SETTLE_POLL: std::time::Duration = std::time::Duration::from_millis(200);

/// Waits until `agrees` holds for the allocator's accounts of every window
/// in `tally` (the agents' outboxes have drained; the caller judges, see
/// `report::ledger_agrees`) and every such window has closed, then returns
/// the accounts; after `timeout` returns what it has, so the caller's
/// checks show the difference.
pub async fn settled(
    admin: &Http,
    tenant: &str,
    resource: &str,
    tally: &crate::traffic::Tally,
    secs: i64,
    timeout: std::time::Duration,
    agrees: impl Fn(&BTreeMap<i64, WindowAccount>) -> bool,
) -> Result<BTreeMap<i64, WindowAccount>, String> {
    let grouped = crate::traffic::by_window(tally, secs);
    let (Some(first), Some(last)) = (grouped.keys().next().copied(), grouped.keys().last().copied()) else {
        return Ok(BTreeMap::new());
    };
    let agrees = &agrees;
    let grouped = &grouped;
    // `Ok(Err(_))`: the accounts could not be read, which ends the wait.
    let read = quota_tests::wait::poll(timeout, SETTLE_POLL, || async move {
        let acc = match windows(admin, tenant, resource, first, last + secs).await {
            Ok(acc) => acc,
            Err(e) => return Ok(Err(e)),
        };
        let closed = grouped.keys().all(|ws| acc.get(ws).is_none_or(|a| a.closed));
        if closed && agrees(&acc) {
            Ok(Ok(acc))
        } else {
            Err(acc)
        }
    })
    .await;
    match read {
        Ok(read) => read,
        Err(unsettled) => Ok(unsettled),
    }
}
