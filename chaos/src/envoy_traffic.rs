//! The demo's clients through Envoy (`cargo lab demo --envoy`): what each
//! request is (a route of the Envoy example and a user, [`pick`]) and what
//! an Envoy answer means for the tally, per request and per quota the
//! route spends ([`read_answer`]).
//!
//! Envoy's answer does not carry the agent's `window_start` nor whether a
//! lease or the fallback allowance paid, so an admit is placed in its
//! window from Envoy's `X-RateLimit-Reset` (seconds to the window's end,
//! from the agent's `duration_until_reset`, taken when the decision
//! began) and the answer's arrival ([`admit_window`]). An admit whose
//! decision began in one window and whose answer came in the next (the
//! agent waited for a lease across the boundary) may be charged to either:
//! its quotas count it as unanswered (`ambiguous`), which the ledger check
//! allows for. The fallback column of the demo's table comes from the
//! allocator's accounting.

use crate::seen::Seen;

/// The quotas the example's descriptors name (tenant [`crate::envoy_front::DOMAIN`]).
pub const RESOURCES: [&str; 2] = ["catalog", "search"];
/// The example's route that spends `catalog` and `search` (both or neither).
pub const SEARCH: &str = "/search";
/// Any other path: the example's route that spends `catalog` only.
pub const BROWSE: &str = "/";
/// The header the example takes the user (the per-key principal) from.
pub const USER_HEADER: &str = "x-user-id";
/// The users the clients send as; the first is a heavy user who runs
/// into the per-user caps.
pub const USERS: [&str; 8] = ["alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi"];
/// Share of requests that search.
pub const SEARCH_SHARE: f64 = 0.5;
/// Share of requests sent as the heavy user.
pub const HEAVY_SHARE: f64 = 0.25;

/// One request: a path and a user.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    pub path: &'static str,
    pub user: &'static str,
}

/// SplitMix64: a well-mixed hash of a counter, so the mix is the same on
/// every run without a random generator to share between clients.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// `h`'s top 53 bits as a number in [0, 1).
fn unit(h: u64) -> f64 {
    (h >> 11) as f64 / (1u64 << 53) as f64
}

/// The request numbered `seed`: [`SEARCH`] with probability
/// [`SEARCH_SHARE`], else [`BROWSE`]; the heavy user with probability
/// [`HEAVY_SHARE`], else one of the others, evenly.
pub fn pick(seed: u64) -> Request {
    let a = mix(seed);
    let b = mix(a);
    let path = if unit(a) < SEARCH_SHARE { SEARCH } else { BROWSE };
    let user =
        if unit(b) < HEAVY_SHARE { USERS[0] } else { USERS[1 + ((b & 0xffff) as usize % (USERS.len() - 1))] };
    Request { path, user }
}

/// The quotas a route spends, as the example's descriptors say.
pub fn quotas_of(path: &str) -> &'static [&'static str] {
    if path.starts_with(SEARCH) {
        &RESOURCES
    } else {
        &RESOURCES[..1]
    }
}

/// The quota a refusal's `RateLimit` header names
/// (`"atlas/search/per_key";r=0;t=1` → `search`).
pub fn refused_by(ratelimit: &str) -> Option<&str> {
    let name = ratelimit.strip_prefix('"')?.split('"').next()?;
    name.split('/').nth(1).filter(|r| !r.is_empty())
}

/// The start (Unix seconds) of the window an admit went into, `None`
/// when it may be either of two. The agent began deciding between
/// `sent_ms` and `done_ms`, and Envoy's `reset_s` is the whole seconds from
/// then to that window's end, so the end is the one multiple of the
/// window in `[sent + reset − 1 s, done + reset + 1 s]` (without the
/// header, the window `sent_ms` is in). The admit is in that window when
/// the answer came before its end; an answer after it may have been
/// admitted before the boundary or after it (`None`).
pub fn admit_window(sent_ms: i64, done_ms: i64, reset_s: Option<i64>, secs: i64) -> Option<i64> {
    let w = secs * 1000;
    let began = match reset_s {
        Some(reset) => {
            let lo = sent_ms + (reset - 1) * 1000;
            let hi = done_ms + (reset + 1) * 1000;
            let end = (lo + w - 1).div_euclid(w);
            // Two candidate ends: an answer slower than a window.
            if end != hi.div_euclid(w) {
                return None;
            }
            end * secs - secs
        }
        None => sent_ms.div_euclid(w) * secs,
    };
    (done_ms.div_euclid(w) * secs == began).then_some(began)
}

/// What one Envoy answer means: for the request, and for each quota its
/// route spends. A 429 counts against the quota its `RateLimit` header
/// names (every quota of the route when it names none); a 5xx (Envoy's
/// 500 when the agent cannot decide, as `failure_mode_deny: true` makes
/// it) counts as a 503: nothing was charged.
pub fn read_answer(
    path: &str,
    status: u16,
    reset_s: Option<i64>,
    ratelimit: Option<&str>,
    (sent_ms, done_ms): (i64, i64),
    secs: i64,
) -> (Seen, Vec<(&'static str, Seen)>) {
    let quotas = quotas_of(path);
    let each = |s: Seen| quotas.iter().map(|q| (*q, s)).collect();
    match status {
        200 => match admit_window(sent_ms, done_ms, reset_s, secs) {
            Some(ws) => (Seen::Lease(ws), each(Seen::Lease(ws))),
            // Admitted, in one of two windows: the request counts where
            // the answer came (the live lines), the quotas as unanswered.
            None => (Seen::Lease(done_ms.div_euclid(secs * 1000) * secs), each(Seen::Ambiguous)),
        },
        429 => {
            let by = ratelimit.and_then(refused_by);
            match quotas.iter().find(|q| Some(**q) == by) {
                Some(q) => (Seen::Denied, vec![(*q, Seen::Denied)]),
                None => (Seen::Denied, each(Seen::Denied)),
            }
        }
        500..=599 => (Seen::Unavailable, each(Seen::Unavailable)),
        _ => (Seen::Ambiguous, each(Seen::Ambiguous)),
    }
}

/// One request through an Envoy as the tally reads it.
pub(crate) struct EnvoyAnswer {
    pub request: Seen,
    pub quotas: Vec<(&'static str, Seen)>,
    /// HTTP status; 0 when no answer came.
    pub status: u16,
    /// The agent's `x-quota-refused` reason, if any.
    pub error: String,
}

/// Sends request number `seed` ([`pick`]) to the Envoy at `base`.
pub(crate) async fn call(client: &reqwest::Client, base: &str, seed: u64, secs: i64) -> EnvoyAnswer {
    let req = pick(seed);
    let now_ms = || chrono::Utc::now().timestamp_millis();
    let sent_ms = now_ms();
    let resp = client.get(format!("{base}{}", req.path)).header(USER_HEADER, req.user).send().await;
    let no_answer = |s: Seen| EnvoyAnswer {
        request: s,
        quotas: quotas_of(req.path).iter().map(|q| (*q, s)).collect(),
        status: 0,
        error: String::new(),
    };
    let r = match resp {
        Ok(r) => r,
        Err(e) if e.is_connect() => return no_answer(Seen::Refused),
        Err(_) => return no_answer(Seen::Ambiguous),
    };
    let status = r.status().as_u16();
    let header = |n: &str| r.headers().get(n).and_then(|v| v.to_str().ok()).map(str::to_string);
    let reset = header("x-ratelimit-reset").and_then(|v| v.trim().parse().ok());
    let ratelimit = header("ratelimit");
    let error = header("x-quota-refused").unwrap_or_default();
    // The body is read so the connection can carry the next request; it
    // says nothing the headers do not.
    if r.bytes().await.is_err() {
        return no_answer(Seen::Ambiguous);
    }
    let done_ms = now_ms();
    let (request, quotas) =
        read_answer(req.path, status, reset, ratelimit.as_deref(), (sent_ms, done_ms), secs);
    EnvoyAnswer { request, quotas, status, error }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    #[test]
    fn the_mix_searches_half_the_time_and_a_quarter_is_the_heavy_user() {
        let n = 20_000u64;
        let (mut search, mut users) = (0u64, BTreeMap::<&str, u64>::new());
        for s in 0..n {
            let r = pick(s);
            assert!(r.path == SEARCH || r.path == BROWSE, "{r:?}");
            search += u64::from(r.path == SEARCH);
            *users.entry(r.user).or_default() += 1;
        }
        let share = |k: u64| k as f64 / n as f64;
        assert!((share(search) - SEARCH_SHARE).abs() < 0.02, "searches {search} of {n}");
        assert!((share(users["alice"]) - HEAVY_SHARE).abs() < 0.02, "{users:?}");
        // Every user appears, the others about evenly.
        assert_eq!(users.len(), USERS.len(), "{users:?}");
        let even = (1.0 - HEAVY_SHARE) / (USERS.len() - 1) as f64;
        for u in &USERS[1..] {
            assert!((share(users[u]) - even).abs() < 0.02, "{u}: {users:?}");
        }
        // The same numbers draw the same requests on every run.
        assert_eq!(pick(7), pick(7));
        assert!((0..64).any(|s| pick(s) != pick(7)));
    }

    #[test]
    fn routes_spend_the_quotas_of_the_example() {
        assert_eq!(quotas_of(SEARCH), &["catalog", "search"]);
        assert_eq!(quotas_of(BROWSE), &["catalog"]);
    }

    #[test]
    fn a_refusal_names_its_quota() {
        assert_eq!(refused_by("\"atlas/search/per_key\";r=0;t=1"), Some("search"));
        assert_eq!(refused_by("\"atlas/catalog\";r=0;t=4"), Some("catalog"));
        assert_eq!(refused_by("atlas/catalog"), None);
        assert_eq!(refused_by("\"atlas\";r=0"), None);
    }

    #[test]
    fn an_admit_lands_in_the_window_envoys_reset_points_at() {
        // Window of 10 s; decided at 1,000,003.4 s: 6.6 s left, shown as 6 or 7.
        let (sent, done) = (1_000_003_300, 1_000_003_500);
        assert_eq!(admit_window(sent, done, Some(6), 10), Some(1_000_000));
        assert_eq!(admit_window(sent, done, Some(7), 10), Some(1_000_000));
        assert_eq!(admit_window(sent, done, None, 10), Some(1_000_000));
        // Sent just before a boundary, decided just after: the new window.
        let (sent, done) = (1_000_009_950, 1_000_010_010);
        assert_eq!(admit_window(sent, done, Some(9), 10), Some(1_000_010));
        assert_eq!(admit_window(sent, done, Some(10), 10), Some(1_000_010));
        // Begun just before it, answered after it (the agent may have
        // waited for a lease across it): either window.
        assert_eq!(admit_window(sent, done, Some(0), 10), None);
        assert_eq!(admit_window(sent, done, None, 10), None);
        // An answer slower than a window.
        assert_eq!(admit_window(1_000_001_000, 1_000_019_000, Some(5), 10), None);
    }

    #[test]
    fn answers_count_per_request_and_per_quota() {
        let t = (1_000_003_300, 1_000_003_500);
        let (r, q) = read_answer(SEARCH, 200, Some(6), None, t, 10);
        assert_eq!(r, Seen::Lease(1_000_000));
        assert_eq!(q, vec![("catalog", Seen::Lease(1_000_000)), ("search", Seen::Lease(1_000_000))]);
        // Begun before a boundary, answered after it: admitted, window unknown.
        let (r, q) = read_answer(SEARCH, 200, Some(0), None, (1_000_009_950, 1_000_010_010), 10);
        assert_eq!(r, Seen::Lease(1_000_010));
        assert_eq!(q, vec![("catalog", Seen::Ambiguous), ("search", Seen::Ambiguous)]);
        // A search refused by its per-user cap counts against search only.
        let (r, q) = read_answer(SEARCH, 429, None, Some("\"atlas/search/per_key\";r=0;t=1"), t, 10);
        assert_eq!((r, q), (Seen::Denied, vec![("search", Seen::Denied)]));
        // A refusal that names nothing counts against every quota of the route.
        let (_, q) = read_answer(SEARCH, 429, None, None, t, 10);
        assert_eq!(q, vec![("catalog", Seen::Denied), ("search", Seen::Denied)]);
        // Envoy's 500 (failure_mode_deny, the agent cannot decide) is a 503.
        let (r, q) = read_answer(BROWSE, 500, None, None, t, 10);
        assert_eq!((r, q), (Seen::Unavailable, vec![("catalog", Seen::Unavailable)]));
        let (r, _) = read_answer(BROWSE, 404, None, None, t, 10);
        assert_eq!(r, Seen::Ambiguous);
    }
}
