//! Turns a [`Snapshot`] into the answer without any I/O: the pool, the
//! region's account and its fallback position as of `at` (or as stored now,
//! with a note, where retention removed the history), the leases as they
//! stood at `at`, and the verdict. Every choice the answer makes is here,
//! so the tests below run it on snapshots written by hand.

use super::answer::{
    ExplainCurrent, ExplainFallback, ExplainInstants, ExplainLease, ExplainPool, ExplainRegion, Explanation,
};
use super::load::{PoolAtRow, PoolRow, ReportsAtRow, Snapshot, MAX_LEASES};
use crate::leases::LeaseRow;
use crate::{policies, share};
use chrono::{DateTime, Utc};
use quota_shared::window::Window;

/// The explanation of what `s` read, as of `at` (the instant it was read for).
pub fn assemble(s: Snapshot, at: DateTime<Utc>) -> Explanation {
    let window = Window::containing(at, s.policy.window_secs);
    let current = current_totals(s.pool.as_ref(), &s.policy, &s.region, s.now);
    let rebuilt = rebuild(&current, s.pool_at.as_ref(), &s.reports_at, s.owed_at, &s.policy, &s.region, at);
    let Rebuilt { pool: pool_view, region_account, fallback, as_of, mut notes } = rebuilt;
    let rows = &s.leases;
    if rows.len() as i64 == MAX_LEASES {
        notes.push(format!(
            "the region had more than {MAX_LEASES} leases in the window up to `at`: `leases` lists the \
             first {MAX_LEASES} and `live_lease_tokens` counts only those"
        ));
    }
    let live = |l: &LeaseRow| l.tokens > 0 && l.expires_at > at && l.released_at.is_none_or(|r| r > at);
    let live_lease_tokens: i64 = rows.iter().filter(|l| live(l)).map(|l| l.tokens).sum();
    let empty_grant = rows.iter().rev().find(|l| l.tokens == 0);
    let leases: Vec<ExplainLease> = rows
        .iter()
        .map(|l| {
            // A release after `at` had not happened yet at `at`.
            let released = l.released_at.is_some_and(|r| r <= at);
            ExplainLease {
                lease_id: l.lease_id,
                agent: l.agent.clone(),
                epoch: l.epoch,
                seq: l.seq,
                tokens: l.tokens,
                issued_at: l.issued_at,
                expires_at: l.expires_at,
                expired: l.expires_at <= at,
                spent: l.unspent.filter(|_| released).map(|u| l.tokens - u),
                returned: l.returned.filter(|_| released),
                released_at: l.released_at.filter(|_| released),
            }
        })
        .collect();

    let position = Position {
        live_lease_tokens,
        fallback: &fallback,
        demand_per_sec: region_account.demand_per_sec,
        leases_in_window: rows.len(),
        pool: &pool_view,
        empty_grant_seq: empty_grant.map(|l| l.seq),
    };
    let (verdict, reason) = verdict(&position);
    Explanation {
        tenant: s.tenant,
        resource: s.resource,
        region: s.region,
        at,
        policy: s.policy.to_wire(),
        window_start: window.start_at(),
        window_end: window.end_at(),
        pool: pool_view,
        region_account,
        leases,
        live_lease_tokens,
        fallback,
        refusals: s.refusals,
        verdict: verdict.to_string(),
        reason,
        as_of,
        current,
        notes,
    }
}

/// The window's totals as stored at `now`.
fn current_totals(
    pool: Option<&PoolRow>,
    policy: &policies::PolicyRow,
    region: &str,
    now: DateTime<Utc>,
) -> ExplainCurrent {
    let pool_view = match pool {
        Some(p) => ExplainPool {
            exists: true,
            limit: p.limit_tokens,
            granted: p.granted,
            returned: p.returned,
            available: share::available(p.limit_tokens, p.granted, p.returned, p.fallback_owed),
        },
        None => ExplainPool {
            exists: false,
            limit: policy.limit_tokens,
            granted: 0,
            returned: 0,
            available: policy.limit_tokens,
        },
    };
    let region_account = ExplainRegion {
        region: region.to_string(),
        granted: pool.and_then(|p| p.r_granted).unwrap_or(0),
        returned: pool.and_then(|p| p.r_returned).unwrap_or(0),
        consumed: pool.and_then(|p| p.r_consumed).unwrap_or(0),
        demand_per_sec: pool.and_then(|p| p.r_demand).unwrap_or(0.0),
        last_want: pool.and_then(|p| p.r_last_want).unwrap_or(0),
        demand_at: pool.and_then(|p| p.r_demand_at),
    };
    let allowance = pool.map(|p| p.fallback_per_region).unwrap_or_else(|| policy.fallback_allowance());
    let admitted = pool.and_then(|p| p.r_fallback).unwrap_or(0);
    let fallback = fallback_view(allowance, admitted);
    ExplainCurrent { as_of: now, pool: pool_view, region_account, fallback }
}

fn fallback_view(allowance: i64, admitted: i64) -> ExplainFallback {
    ExplainFallback { allowance, admitted, left: (allowance - admitted).max(0), in_fallback: admitted > 0 }
}

/// The parts of an explanation as of `at`, with the instant of each.
struct Rebuilt {
    pool: ExplainPool,
    region_account: ExplainRegion,
    fallback: ExplainFallback,
    as_of: ExplainInstants,
    notes: Vec<String>,
}

/// Rebuilds the pool, the region and its fallback position as of `at` from
/// the leases and the reported events, falling back to the stored totals
/// (and saying so) where retention removed that history. A pure function of
/// what was read, so the choice of each part's instant is in one place.
fn rebuild(
    current: &ExplainCurrent,
    pool_at: Option<&PoolAtRow>,
    reports: &ReportsAtRow,
    owed_at: i64,
    policy: &policies::PolicyRow,
    region: &str,
    at: DateTime<Utc>,
) -> Rebuilt {
    let mut notes = Vec::new();
    let mut as_of =
        ExplainInstants { policy: at, pool: at, region_account: at, leases: at, fallback: at, refusals: at };
    // The limit and the allowance in force at `at` (a policy change applies
    // to the open window at once, I9).
    let limit = policy.limit_tokens;
    let allowance = policy.fallback_allowance();
    let (pool, lease_history_whole, region_lease_history_whole) = match pool_at {
        None => (ExplainPool { exists: false, limit, granted: 0, returned: 0, available: limit }, true, true),
        Some(p) => {
            let whole = p.lease_granted == p.stored_granted && p.lease_returned == p.stored_returned;
            let r_whole = p.r_lease_granted == current.region_account.granted
                && p.r_lease_returned == current.region_account.returned;
            let (granted, returned) =
                if whole { (p.granted, p.returned) } else { (p.stored_granted, p.stored_returned) };
            let exists = if whole { p.created_at <= at } else { true };
            let pool = if exists {
                ExplainPool {
                    exists,
                    limit,
                    granted,
                    returned,
                    available: share::available(limit, granted, returned, owed_at),
                }
            } else {
                ExplainPool { exists, limit, granted: 0, returned: 0, available: limit }
            };
            (pool, whole, r_whole)
        }
    };
    let pool = if lease_history_whole {
        pool
    } else {
        as_of.pool = current.as_of;
        notes.push(
            "retention removed leases of this window, so the pool cannot be rebuilt as of `at`: \
             `pool` is the total as stored now"
                .to_string(),
        );
        ExplainPool { limit: current.pool.limit, available: current.pool.available, ..pool }
    };
    let reports_whole = reports.all_consumed == current.region_account.consumed
        && reports.all_fallback_admitted == current.fallback.admitted;
    let mut region_account = match pool_at {
        Some(p) if region_lease_history_whole => ExplainRegion {
            region: region.to_string(),
            granted: p.r_granted,
            returned: p.r_returned,
            consumed: reports.consumed,
            demand_per_sec: p.r_demand.unwrap_or(0.0),
            last_want: p.r_last_want.unwrap_or(0),
            demand_at: p.r_demand_at,
        },
        Some(_) => current.region_account.clone(),
        None => ExplainRegion {
            region: region.to_string(),
            granted: 0,
            returned: 0,
            consumed: reports.consumed,
            demand_per_sec: 0.0,
            last_want: 0,
            demand_at: None,
        },
    };
    let mut fallback = fallback_view(allowance, reports.fallback_admitted);
    if !region_lease_history_whole || !reports_whole {
        as_of.region_account = current.as_of;
        as_of.fallback = current.as_of;
        region_account = current.region_account.clone();
        fallback = fallback_view(allowance, current.fallback.admitted);
        notes.push(
            "retention removed leases or reports of this region in this window, so its account cannot \
             be rebuilt as of `at`: `region_account` and `fallback.admitted` are the totals as stored now"
                .to_string(),
        );
    } else if reports.consumed != current.region_account.consumed
        || reports.fallback_admitted != current.fallback.admitted
    {
        notes.push(
            "consumption and fallback admits are those reported by `at`; agents report after they \
             admit, so `current` (as stored now) also counts reports received since"
                .to_string(),
        );
    }
    Rebuilt { pool, region_account, fallback, as_of, notes }
}

/// What [`verdict`] reads of the region's position at `at`.
#[derive(Debug, Clone, Copy)]
pub struct Position<'a> {
    /// Tokens of the region's leases live at `at`.
    pub live_lease_tokens: i64,
    pub fallback: &'a ExplainFallback,
    pub demand_per_sec: f64,
    /// Leases of the region in the window up to `at` (empty grants too).
    pub leases_in_window: usize,
    pub pool: &'a ExplainPool,
    /// The sequence number of the region's last grant that got 0 tokens.
    pub empty_grant_seq: Option<i64>,
}

/// The explain verdict and its reason: the first of these that holds —
/// live leases (`leased`), fallback admits reported in the window
/// (`fallback`), nothing asked for (`no demand`), an empty pool or an empty
/// grant (`exhausted`), else `idle` (the agent renews on its next demand).
pub fn verdict(p: &Position) -> (&'static str, String) {
    let f = p.fallback;
    if p.live_lease_tokens > 0 {
        ("leased", format!("the region held {} tokens in live leases at that instant", p.live_lease_tokens))
    } else if f.in_fallback {
        (
            "fallback",
            format!(
                "no live lease; the region admitted {} of its {} fallback allowance ({} left) in this window",
                f.admitted, f.allowance, f.left
            ),
        )
    } else if p.demand_per_sec == 0.0 && p.leases_in_window == 0 {
        ("no demand", "the region asked for nothing in this window".to_string())
    } else if p.pool.available == 0 || p.empty_grant_seq.is_some() {
        let asked =
            p.empty_grant_seq.map(|seq| format!(", its grant seq {seq} got 0 tokens")).unwrap_or_default();
        (
            "exhausted",
            format!(
                "the pool had {} of {} tokens available{asked}; requests are answered 429 quota_exhausted",
                p.pool.available, p.pool.limit
            ),
        )
    } else {
        ("idle", "the region holds no live lease; its agent renews on its next demand".to_string())
    }
}

#[cfg(test)]
mod verdict_tests {
    use super::*;

    fn pool(available: i64) -> ExplainPool {
        ExplainPool { exists: true, limit: 100, granted: 100 - available, returned: 0, available }
    }

    fn fallback(admitted: i64) -> ExplainFallback {
        ExplainFallback { allowance: 10, admitted, left: 10 - admitted, in_fallback: admitted > 0 }
    }

    /// Live tokens, fallback admitted, demand, leases in the window,
    /// available, empty grant's seq, and the verdict wanted.
    type Case = (i64, i64, f64, usize, i64, Option<i64>, &'static str);

    #[test]
    fn the_verdict_is_the_first_case_that_holds() {
        let cases: &[Case] = &[
            (40, 0, 4.0, 1, 60, None, "leased"),
            // Live leases win over fallback reported earlier in the window and an empty pool.
            (40, 3, 4.0, 2, 0, Some(2), "leased"),
            (0, 3, 4.0, 1, 60, None, "fallback"),
            // Fallback wins over an exhausted pool: the region was cut off.
            (0, 3, 4.0, 1, 0, Some(1), "fallback"),
            (0, 0, 0.0, 0, 100, None, "no demand"),
            // No demand measured but a lease in the window: not "no demand".
            (0, 0, 0.0, 1, 100, None, "idle"),
            (0, 0, 4.0, 1, 0, None, "exhausted"),
            (0, 0, 4.0, 2, 30, Some(2), "exhausted"),
            // An empty pool with no demand and no lease is still "no demand".
            (0, 0, 0.0, 0, 0, None, "no demand"),
            (0, 0, 4.0, 1, 30, None, "idle"),
        ];
        for &(live, admitted, demand, leases, available, empty, want) in cases {
            let (f, p) = (fallback(admitted), pool(available));
            let position = Position {
                live_lease_tokens: live,
                fallback: &f,
                demand_per_sec: demand,
                leases_in_window: leases,
                pool: &p,
                empty_grant_seq: empty,
            };
            assert_eq!(verdict(&position).0, want, "{position:?}");
        }
    }

    #[test]
    fn reasons_carry_the_numbers_an_operator_checks() {
        let (f, p) = (fallback(3), pool(0));
        let position = Position {
            live_lease_tokens: 0,
            fallback: &f,
            demand_per_sec: 1.0,
            leases_in_window: 1,
            pool: &p,
            empty_grant_seq: None,
        };
        assert_eq!(
            verdict(&position).1,
            "no live lease; the region admitted 3 of its 10 fallback allowance (7 left) in this window"
        );
        let f = fallback(0);
        let position = Position { fallback: &f, empty_grant_seq: Some(7), ..position };
        assert_eq!(
            verdict(&position).1,
            "the pool had 0 of 100 tokens available, its grant seq 7 got 0 tokens; requests are answered 429 quota_exhausted"
        );
    }
}

#[cfg(test)]
mod assemble_tests {
    use super::*;
    use crate::ledger::Event;
    use crate::policies::PolicyRow;
    use uuid::Uuid;

    /// Seconds after 2026-01-01T00:00:00Z; the explained instant is `t(90)`,
    /// 30 s into the window `[t(60), t(120))` of a 60-s policy.
    fn t(secs: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_767_225_600 + secs, 0).unwrap()
    }

    fn policy(fail_mode: &str) -> PolicyRow {
        PolicyRow {
            tenant: "atlas".into(),
            resource: "read".into(),
            limit_tokens: 100,
            window_secs: 60,
            chunk_min: 10,
            chunk_max: 50,
            lease_ttl_secs: 30,
            fallback_per_region: 10,
            fail_mode: fail_mode.into(),
            per_key_rate_milli: None,
            per_key_burst: None,
            enforce: true,
            on_stale: "keep".into(),
            reserve: serde_json::json!([]),
            kind: "rate".into(),
            permit_ttl_secs: None,
            version: 3,
            updated_at: t(0),
        }
    }

    /// A lease of `eu-1`; `released`: (instant, unspent, returned).
    fn lease(
        seq: i64,
        tokens: i64,
        issued: i64,
        expires: i64,
        released: Option<(i64, i64, i64)>,
    ) -> LeaseRow {
        LeaseRow {
            lease_id: Uuid::from_u128(seq as u128),
            tenant: "atlas".into(),
            resource: "read".into(),
            region: "eu".into(),
            agent: "eu-1".into(),
            epoch: 1,
            seq,
            window_start: t(60).timestamp(),
            window_secs: 60,
            want: 40,
            demand_per_sec: 4.0,
            window_sel: "current".into(),
            tokens,
            issued_at: t(issued),
            expires_at: t(expires),
            policy_version: 3,
            fallback_allowance: 10,
            fail_mode: "bounded".into(),
            pool_limit: 100,
            pool_granted: 40,
            pool_available: 60,
            retry_after_ms: None,
            unspent: released.map(|r| r.1),
            returned: released.map(|r| r.2),
            released_at: released.map(|r| t(r.0)),
            per_key_rate_milli: None,
            per_key_burst: None,
            enforce: true,
        }
    }

    /// The stored pool: granted and returned of the pool, then of the
    /// region with its consumption and fallback admits.
    fn stored(granted: i64, returned: i64, region: (i64, i64, i64, i64)) -> PoolRow {
        PoolRow {
            limit_tokens: 100,
            fallback_per_region: 10,
            granted,
            returned,
            fallback_owed: 0,
            r_granted: Some(region.0),
            r_returned: Some(region.1),
            r_consumed: Some(region.2),
            r_fallback: Some(region.3),
            r_demand: Some(4.0),
            r_last_want: Some(40),
            r_demand_at: Some(t(85)),
        }
    }

    /// The pool rebuilt at `at` from complete lease history: stored totals
    /// equal the leases' sums, and `granted`, `returned` (of the pool and
    /// the region) count what happened up to `at`.
    fn rebuilt_at(
        stored: &PoolRow,
        granted: i64,
        returned: i64,
        r_granted: i64,
        r_returned: i64,
    ) -> PoolAtRow {
        PoolAtRow {
            created_at: t(61),
            stored_granted: stored.granted,
            stored_returned: stored.returned,
            lease_granted: stored.granted,
            lease_returned: stored.returned,
            granted,
            returned,
            r_lease_granted: stored.r_granted.unwrap_or(0),
            r_lease_returned: stored.r_returned.unwrap_or(0),
            r_granted,
            r_returned,
            r_demand: Some(4.0),
            r_last_want: Some(40),
            r_demand_at: Some(t(85)),
        }
    }

    fn reports(consumed: i64, fallback: i64, all_consumed: i64, all_fallback: i64) -> ReportsAtRow {
        ReportsAtRow {
            consumed,
            fallback_admitted: fallback,
            all_consumed,
            all_fallback_admitted: all_fallback,
        }
    }

    /// The region `eu` holds one live lease of 40 (issued at 70, expiring
    /// at 100) and reported 15 consumed; everything is still stored.
    fn steady() -> Snapshot {
        let pool = stored(40, 0, (40, 0, 15, 0));
        let pool_at = rebuilt_at(&pool, 40, 0, 40, 0);
        Snapshot {
            tenant: "atlas".into(),
            resource: "read".into(),
            region: "eu".into(),
            policy: policy("bounded"),
            now: t(95),
            pool: Some(pool),
            pool_at: Some(pool_at),
            reports_at: reports(15, 0, 15, 0),
            owed_at: 0,
            leases: vec![lease(1, 40, 70, 100, None)],
            refusals: Vec::new(),
        }
    }

    /// What a case expects of the answer.
    struct Want {
        verdict: &'static str,
        /// In `reason`.
        reason_has: &'static str,
        /// exists, granted, returned, available.
        pool: (bool, i64, i64, i64),
        /// The region's granted, returned, consumed.
        region: (i64, i64, i64),
        /// allowance, admitted, left.
        fallback: (i64, i64, i64),
        live: i64,
        /// `spent` of each listed lease.
        spent: Vec<Option<i64>>,
        /// The parts of `as_of` that are `now` (the rest are `at`).
        from_now: &'static [&'static str],
        /// The beginning of each note.
        notes: &'static [&'static str],
    }

    const POOL_GONE: &str = "retention removed leases of this window";
    const REGION_GONE: &str = "retention removed leases or reports of this region";
    const REPORTED_BY_AT: &str = "consumption and fallback admits are those reported by `at`";
    const TOO_MANY: &str = "the region had more than 200 leases";

    fn cases() -> Vec<(&'static str, Snapshot, Want)> {
        let mut out = vec![("steady: a live lease", steady(), base_like())];

        let s = Snapshot {
            pool: None,
            pool_at: None,
            reports_at: reports(0, 0, 0, 0),
            leases: Vec::new(),
            ..steady()
        };
        out.push(("no pool yet", s, nothing_at_at()));

        // The pool was opened by a grant after `at`: nothing of it counts at `at`.
        let mut s = steady();
        let p = stored(40, 0, (40, 0, 0, 0));
        s.pool_at = Some(PoolAtRow { created_at: t(92), r_demand: None, ..rebuilt_at(&p, 0, 0, 0, 0) });
        s.pool = Some(p);
        s.reports_at = reports(0, 0, 0, 0);
        s.leases = Vec::new();
        out.push(("the pool opened after at", s, nothing_at_at()));

        // Released at 92 with 10 unspent: at 90 it was still live and unspent.
        let mut s = steady();
        let p = stored(40, 10, (40, 10, 15, 0));
        s.pool_at = Some(rebuilt_at(&p, 40, 0, 40, 0));
        s.pool = Some(p);
        s.leases = vec![lease(1, 40, 70, 100, Some((92, 10, 10)))];
        out.push(("a release after at had not happened at at", s, base_like()));

        // One lease expired at 80, one released at 85 with 5 unspent: none live.
        let mut s = steady();
        let p = stored(60, 5, (60, 5, 50, 0));
        s.pool_at = Some(rebuilt_at(&p, 60, 5, 60, 5));
        s.pool = Some(p);
        s.reports_at = reports(50, 0, 50, 0);
        s.leases = vec![lease(1, 40, 62, 80, None), lease(2, 20, 81, 110, Some((85, 5, 5)))];
        let want = Want {
            verdict: "idle",
            reason_has: "renews on its next demand",
            pool: (true, 60, 5, 45),
            region: (60, 5, 50),
            live: 0,
            spent: vec![None, Some(15)],
            ..base_like()
        };
        out.push(("an expired and a released lease", s, want));

        // Other regions hold the whole pool; the region's grant got 0 tokens.
        let mut s = steady();
        let p = stored(100, 0, (0, 0, 0, 0));
        s.pool_at = Some(rebuilt_at(&p, 100, 0, 0, 0));
        s.pool = Some(p);
        s.reports_at = reports(0, 0, 0, 0);
        s.leases = vec![lease(1, 0, 80, 110, None)];
        let want = Want {
            verdict: "exhausted",
            reason_has: "the pool had 0 of 100 tokens available, its grant seq 1 got 0 tokens",
            pool: (true, 100, 0, 0),
            region: (0, 0, 0),
            live: 0,
            spent: vec![None],
            ..base_like()
        };
        out.push(("an empty grant", s, want));

        // The region lost the allocator and admitted 3 from its allowance.
        let mut s = steady();
        let p = stored(40, 0, (40, 0, 15, 3));
        s.pool_at = Some(rebuilt_at(&p, 40, 0, 40, 0));
        s.pool = Some(p);
        s.reports_at = reports(15, 3, 15, 3);
        s.leases = vec![lease(1, 40, 62, 80, None)];
        let want = Want {
            verdict: "fallback",
            reason_has: "admitted 3 of its 10 fallback allowance (7 left)",
            fallback: (10, 3, 7),
            live: 0,
            ..base_like()
        };
        out.push(("fallback admits in the window", s, want));

        // Strict mode: no allowance, whatever `fallback_per_region` says.
        let s = Snapshot {
            policy: policy("strict"),
            pool: None,
            pool_at: None,
            reports_at: reports(0, 0, 0, 0),
            ..steady()
        };
        let want = Want { pool: (false, 0, 0, 100), region: (0, 0, 0), fallback: (0, 0, 0), ..base_like() };
        out.push(("strict mode, no pool stored", s, want));

        // 5 of the 15 consumed were reported after `at`.
        let s = Snapshot { reports_at: reports(10, 0, 15, 0), ..steady() };
        let want = Want { region: (40, 0, 10), notes: &[REPORTED_BY_AT], ..base_like() };
        out.push(("reports received after at", s, want));

        // Leases of other regions are gone: the pool is the stored total.
        let mut s = steady();
        let p = stored(70, 0, (40, 0, 15, 0));
        s.pool_at = Some(PoolAtRow { lease_granted: 50, ..rebuilt_at(&p, 50, 0, 40, 0) });
        s.pool = Some(p);
        let want = Want { pool: (true, 70, 0, 30), from_now: &["pool"], notes: &[POOL_GONE], ..base_like() };
        out.push(("retention removed leases of the pool", s, want));

        // The region's reports are gone: its account is the stored total.
        let s = Snapshot { reports_at: reports(5, 0, 5, 0), ..steady() };
        let want = Want { from_now: &["region_account", "fallback"], notes: &[REGION_GONE], ..base_like() };
        out.push(("retention removed reports of the region", s, want));

        // The region's leases are gone, so some of the pool's too.
        let mut s = steady();
        let p = stored(40, 0, (40, 0, 15, 0));
        s.pool_at =
            Some(PoolAtRow { lease_granted: 30, r_lease_granted: 30, ..rebuilt_at(&p, 30, 0, 30, 0) });
        s.pool = Some(p);
        let want = Want {
            from_now: &["pool", "region_account", "fallback"],
            notes: &[POOL_GONE, REGION_GONE],
            ..base_like()
        };
        out.push(("retention removed leases of the region", s, want));

        // As many leases as one answer lists: the answer says it may miss some.
        let mut s = steady();
        s.leases = (1..=MAX_LEASES).map(|seq| lease(seq, 1, 70, 100, None)).collect();
        let want = Want {
            reason_has: "held 200 tokens in live leases",
            live: 200,
            spent: vec![None; MAX_LEASES as usize],
            notes: &[TOO_MANY],
            ..base_like()
        };
        out.push(("the lease list is cut", s, want));
        out
    }

    /// The steady case's answer, for cases that change only a part of it.
    fn base_like() -> Want {
        Want {
            verdict: "leased",
            reason_has: "held 40 tokens in live leases",
            pool: (true, 40, 0, 60),
            region: (40, 0, 15),
            fallback: (10, 0, 10),
            live: 40,
            spent: vec![None],
            from_now: &[],
            notes: &[],
        }
    }

    /// No pool, no lease and no demand as of `at`.
    fn nothing_at_at() -> Want {
        Want {
            verdict: "no demand",
            reason_has: "asked for nothing",
            pool: (false, 0, 0, 100),
            region: (0, 0, 0),
            live: 0,
            spent: vec![],
            ..base_like()
        }
    }

    #[test]
    fn snapshots_assemble_into_the_expected_answers() {
        let at = t(90);
        for (name, snapshot, want) in cases() {
            let now = snapshot.now;
            let e = assemble(snapshot, at);
            assert_eq!(e.verdict, want.verdict, "{name}: {}", e.reason);
            assert!(e.reason.contains(want.reason_has), "{name}: {}", e.reason);
            let p = &e.pool;
            assert_eq!((p.exists, p.granted, p.returned, p.available), want.pool, "{name}: pool");
            assert_eq!(p.limit, 100, "{name}: the limit in force at `at`");
            let r = &e.region_account;
            assert_eq!((r.granted, r.returned, r.consumed), want.region, "{name}: region");
            let f = &e.fallback;
            assert_eq!((f.allowance, f.admitted, f.left), want.fallback, "{name}: fallback");
            assert_eq!(e.live_lease_tokens, want.live, "{name}: live tokens");
            let spent: Vec<_> = e.leases.iter().map(|l| l.spent).collect();
            assert_eq!(spent, want.spent, "{name}: spent");
            let i = &e.as_of;
            for (part, instant) in [
                ("policy", i.policy),
                ("pool", i.pool),
                ("region_account", i.region_account),
                ("leases", i.leases),
                ("fallback", i.fallback),
                ("refusals", i.refusals),
            ] {
                let wanted = if want.from_now.contains(&part) { now } else { at };
                assert_eq!(instant, wanted, "{name}: as_of.{part}");
            }
            assert_eq!(e.notes.len(), want.notes.len(), "{name}: {:?}", e.notes);
            for (note, start) in e.notes.iter().zip(want.notes) {
                assert!(note.starts_with(start), "{name}: {note}");
            }
        }
    }

    #[test]
    fn the_answer_names_the_window_policy_and_current_totals() {
        let mut s = steady();
        s.refusals = vec![Event {
            id: 7,
            at: t(80),
            kind: "refused".into(),
            tenant: Some("atlas".into()),
            resource: Some("read".into()),
            region: Some("eu".into()),
            agent: Some("eu-1".into()),
            epoch: Some(0),
            seq: Some(3),
            lease_id: None,
            tokens: None,
            reason: Some("stale_epoch".into()),
            detail: None,
            txid: "1".into(),
        }];
        // 5 reported after `at`, and the lease was released after it.
        let p = stored(40, 10, (40, 10, 20, 0));
        s.pool_at = Some(rebuilt_at(&p, 40, 0, 40, 0));
        s.pool = Some(p);
        s.reports_at = reports(15, 0, 20, 0);
        s.leases = vec![lease(1, 40, 70, 100, Some((92, 10, 10)))];
        let e = assemble(s, t(90));
        assert_eq!((e.tenant.as_str(), e.resource.as_str(), e.region.as_str()), ("atlas", "read", "eu"));
        assert_eq!((e.window_start, e.window_end), (t(60), t(120)));
        assert_eq!(e.policy.version, 3);
        assert_eq!(e.refusals.len(), 1);
        assert_eq!(e.current.as_of, t(95));
        assert_eq!((e.current.pool.granted, e.current.pool.returned, e.current.pool.available), (40, 10, 70));
        assert_eq!((e.current.region_account.consumed, e.region_account.consumed), (20, 15));
        let l = &e.leases[0];
        assert_eq!((l.expired, l.returned, l.released_at), (false, None, None), "not yet released at `at`");
    }
}
