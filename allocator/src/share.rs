//! Pool arithmetic the read paths share (explain, windows). The
//! demand-weighted share itself (DESIGN §4) is decided where the pool row
//! is locked, inside PostgreSQL: `quota_share_tokens` in
//! `migrations/20261220000001_grant_in_one_statement.sql`, with its table
//! tests run against a real PostgreSQL in `allocator/tests/share_sql.rs`.
//! The grant statement uses the SQL twin of [`available`]
//! (`quota_available`); that test checks the two agree.

/// What a pool can still grant: its limit less the tokens out in leases
/// (`granted − returned`) and the fallback admits reported while the window
/// was open (`fallback_owed`), which were spent from the same limit. Never
/// below 0 (a lowered limit, or a pool spent before the fallback report).
pub fn available(limit: i64, granted: i64, returned: i64, fallback_owed: i64) -> i64 {
    (limit - (granted - returned) - fallback_owed).max(0)
}

/// How much of `fallback_owed` the pool covered: what was left of the limit
/// besides the tokens out in leases. The rest is the overshoot that fallback
/// caused, which I6 bounds by the regions' allowances.
pub fn fallback_repaid(limit: i64, granted: i64, returned: i64, fallback_owed: i64) -> i64 {
    fallback_owed.min((limit - (granted - returned)).max(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fallback_reported_while_open_is_taken_from_the_pool() {
        // 1000, 300 out in leases, 200 admitted from fallback: 500 left.
        assert_eq!(available(1000, 400, 100, 200), 500);
        assert_eq!(fallback_repaid(1000, 400, 100, 200), 200);
        // The pool was spent before the report: nothing left, nothing repaid.
        assert_eq!(available(1000, 1000, 0, 200), 0);
        assert_eq!(fallback_repaid(1000, 1000, 0, 200), 0);
        // Partly spent: the pool covers what it had left.
        assert_eq!(available(1000, 900, 0, 200), 0);
        assert_eq!(fallback_repaid(1000, 900, 0, 200), 100);
        // A lowered limit below what is out: never negative.
        assert_eq!(available(500, 800, 0, 0), 0);
        assert_eq!(fallback_repaid(500, 800, 0, 50), 0);
    }
}
