//! Request ids (`request_id`): one id stands for one request, tenant-wide,
//! until its window ends. The claim is a plain Redis key (see
//! [`crate::commands::claim_request_id`]); the spend script answers a
//! repeat with the first decision.

use crate::app::Decider;
use crate::quotas::PolicyInfo;
use crate::request::Acquire;
use quota_shared::window::Window;

/// How long past its window's end a request id is remembered.
pub const REQUEST_ID_MARGIN_MS: i64 = 10_000;

/// Why a request id could not be claimed.
pub(crate) enum ClaimError {
    Mismatch(String),
    Store(crate::store::StoreError),
}

/// Ties a request id to its request, tenant-wide: the first use records
/// the quotas and costs (until the current window's end plus a margin); a
/// repeat with the same ones proceeds (the spend script answers it with
/// the first decision), one with others is refused. Returns whether this
/// request made the claim.
pub(crate) async fn claim(
    app: &Decider,
    req: &Acquire,
    rid: &str,
    p: PolicyInfo,
) -> std::result::Result<bool, ClaimError> {
    let key = app.keys.request_id_claim(&req.tenant, rid);
    let value = req.claim();
    let ttl = ttl_ms(app, p);
    let old =
        crate::commands::claim_request_id(&app.store, &key, &value, ttl).await.map_err(ClaimError::Store)?;
    match old {
        None => Ok(true),
        Some(o) if o == value => Ok(false),
        Some(o) => Err(ClaimError::Mismatch(format!(
            "request_id {rid:?} was first used for {}; this request names {}",
            describe_claim(&o).unwrap_or_else(|| "another request".into()),
            describe_claim(&value).unwrap_or_default(),
        ))),
    }
}

/// A claim's value in words: `resource "read" with cost 1 and key "u"`.
fn describe_claim(v: &str) -> Option<String> {
    let mut parts = Vec::new();
    let mut rest = v;
    let mut key = None;
    loop {
        let (n, after) = rest.split_once(':')?;
        let n: usize = n.parse().ok()?;
        let (res, after) = (after.get(..n)?, after.get(n + 1..)?);
        let end = after.find(['+', ':']).unwrap_or(after.len());
        parts.push(format!("resource {res:?} with cost {}", &after[..end]));
        match after.as_bytes().get(end) {
            Some(b'+') => rest = &after[end + 1..],
            Some(_) => {
                key = after[end + 1..].split_once(':').map(|(_, k)| k.to_string());
                break;
            }
            None => break,
        }
    }
    let key = key.map(|k| format!(" and key {k:?}")).unwrap_or_default();
    Some(format!("{}{key}", parts.join(" + ")))
}

/// How long a request id is remembered: until the end of the window it is
/// decided in, plus a margin for clocks and retries.
pub(crate) fn ttl_ms(app: &Decider, p: PolicyInfo) -> i64 {
    let now = app.clock.now_utc();
    Window::containing(now, p.window_secs).ms_until_end(now).max(0) + REQUEST_ID_MARGIN_MS
}

/// Gives up this request's claim of `rid`: only admits are remembered, so
/// a refused request may be retried with the same id and another cost.
pub(crate) async fn forget(app: &Decider, req: &Acquire, rid: &str) {
    let key = app.keys.request_id_claim(&req.tenant, rid);
    let _ = crate::commands::forget_request_id(&app.store, &key).await;
}
