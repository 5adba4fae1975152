//! The `RateLimit-Policy` and `RateLimit` headers of an acquire answer
//! (IETF httpapi ratelimit-headers draft, structured-field form, one
//! dialect): which limit they describe (the quota or the request's per-key
//! bucket, whichever has fewer tokens left) as a pure function, and the
//! headers written from it, with `Quota-Policy-Version`, the version of
//! that quota's policy.

use crate::quotas::PolicyInfo;
use axum::http::{HeaderMap, HeaderValue};
use chrono::Utc;
use quota_shared::window::Window;

/// `RateLimit-Policy` and `RateLimit` in the IETF httpapi draft's
/// structured-field form, for the most restrictive limit of the request
/// (see [`header_limit`]). Before the policy is known both say 0.
pub fn rate_limit_headers(
    h: &mut HeaderMap,
    name: &str,
    policy: Option<PolicyInfo>,
    remaining: Option<i64>,
    key_remaining: Option<i64>,
    now: chrono::DateTime<Utc>,
) {
    let l = header_limit(name, policy, remaining, key_remaining, now);
    if let Ok(v) = HeaderValue::from_str(&format!("\"{}\";q={};w={}", l.name, l.q, l.w)) {
        h.insert("ratelimit-policy", v);
    }
    if let Ok(v) = HeaderValue::from_str(&format!("\"{}\";r={};t={}", l.name, l.r, l.t)) {
        h.insert("ratelimit", v);
    }
    // The version of the policy that decided (the quota the headers
    // describe), so a client or proxy log can tie a refusal to a policy
    // change; absent while no policy is known.
    if let Some(p) = policy {
        h.insert(POLICY_VERSION_HEADER, HeaderValue::from(p.version));
    }
}

/// The header naming the version of the policy that decided.
pub const POLICY_VERSION_HEADER: &str = "quota-policy-version";

/// One limit as the `RateLimit` headers show it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeaderLimit {
    pub name: String,
    /// Quota units per `w` seconds.
    pub q: i64,
    pub w: i64,
    /// Units left, and seconds until the limit is whole again.
    pub r: i64,
    pub t: i64,
}

/// The limit the headers describe: the quota
/// (`"<tenant>/<resource>";q=<limit>;w=<window>`, `r=<remaining>;t=<seconds
/// to the window end>`), or, when the request's per-key bucket has fewer
/// tokens left, the bucket (`"<tenant>/<resource>/per_key";q=<burst>;w=<seconds
/// to refill from empty>`, `r=<tokens left>;t=<seconds until full>`).
/// `remaining` is `None` when the quota's balance is unknown (the key's
/// bucket refused before the quota was looked at): then the bucket.
pub fn header_limit(
    name: &str,
    policy: Option<PolicyInfo>,
    remaining: Option<i64>,
    key_remaining: Option<i64>,
    now: chrono::DateTime<Utc>,
) -> HeaderLimit {
    let Some(p) = policy else {
        return HeaderLimit { name: name.to_string(), q: 0, w: 0, r: 0, t: 0 };
    };
    let remaining = remaining.map(|r| r.max(0));
    if let (Some(b), Some(k)) = (p.per_key, key_remaining) {
        let k = k.clamp(0, b.burst);
        if remaining.is_none_or(|r| k < r) {
            // Seconds for `tokens` to refill at `rate_milli` milli-tokens/s.
            let refill = |tokens: i64| (tokens.saturating_mul(1000) + b.rate_milli - 1) / b.rate_milli;
            return HeaderLimit {
                name: format!("{name}/per_key"),
                q: b.burst,
                w: refill(b.burst).max(1),
                r: k,
                t: refill(b.burst - k),
            };
        }
    }
    let win = Window::containing(now, p.window_secs);
    HeaderLimit {
        name: name.to_string(),
        q: p.limit,
        w: p.window_secs,
        r: remaining.unwrap_or(0),
        t: (win.ms_until_end(now) + 999) / 1000,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scripts::Bucket;
    use quota_shared::wire::FailMode;

    fn policy(per_key: Option<Bucket>) -> PolicyInfo {
        PolicyInfo {
            limit: 100,
            window_secs: 60,
            fail_mode: FailMode::Bounded,
            fallback_allowance: 1,
            version: 1,
            per_key,
            enforce: true,
            on_stale: Default::default(),
            held: [0; 5],
        }
    }

    fn lim(name: &str, q: i64, w: i64, r: i64, t: i64) -> HeaderLimit {
        HeaderLimit { name: name.into(), q, w, r, t }
    }

    #[test]
    fn the_headers_describe_the_most_restrictive_limit() {
        // 20 s before the window's end.
        let now = chrono::DateTime::from_timestamp(1_800_000_040, 0).unwrap();
        let key = Some(Bucket { rate_milli: 2000, burst: 8 });
        let cases = [
            // Policy unknown: zeros.
            (None, Some(5), None, lim("a/r", 0, 0, 0, 0)),
            // No per-key limit: the quota.
            (Some(policy(None)), Some(42), None, lim("a/r", 100, 60, 42, 20)),
            // A key with more left than the quota: the quota.
            (Some(policy(key)), Some(3), Some(7), lim("a/r", 100, 60, 3, 20)),
            // Equal: the quota (the key is not stricter).
            (Some(policy(key)), Some(7), Some(7), lim("a/r", 100, 60, 7, 20)),
            // The key is stricter: its bucket, refilled at 2/s: 8 tokens
            // take 4 s from empty, 3 missing take 1.5 s, shown as 2.
            (Some(policy(key)), Some(40), Some(5), lim("a/r/per_key", 8, 4, 5, 2)),
            // A key refusal: the quota's balance is unknown.
            (Some(policy(key)), None, Some(0), lim("a/r/per_key", 8, 4, 0, 4)),
            // A negative quota remaining shows as 0.
            (Some(policy(None)), Some(-3), None, lim("a/r", 100, 60, 0, 20)),
        ];
        for (p, remaining, key_remaining, want) in cases {
            assert_eq!(
                header_limit("a/r", p, remaining, key_remaining, now),
                want,
                "{p:?} {remaining:?} {key_remaining:?}"
            );
        }
    }
}
