//! Per-window gauges for alerts and dashboards: for the busiest quotas, the
//! open window's and the previous (just closed) window's limit, bound,
//! grants, admits by region and source, stranded tokens and whether the
//! bound held (I6), read from the same accounting as `GET /v1/windows`.
//!
//! Cardinality is bounded: at most `--window-metrics-quotas` quotas (the
//! ones with the most tokens granted in those two windows, 20 by default,
//! 0 turns the gauges off) × 2 windows × the regions seen. The families are
//! recomputed at every scrape and replaced whole, so a quota that drops out
//! of the top N loses its series instead of keeping stale values.
//!
//! `admitted` of a window grows as the agents' reports arrive (each agent
//! flushes its outbox every few hundred milliseconds, later after a
//! partition), so the previous window's numbers settle some time after it
//! closed; an alert on `bound_held` should wait (`for:`) for that.

use crate::error::Result;
use crate::state::AppState;
use crate::windows;
use chrono::{DateTime, Duration, Utc};
use quota_shared::prom::Registry;

/// `--window-metrics-quotas` by default.
pub const DEFAULT_QUOTAS: i64 = 20;

/// The gauge families of this module and their help texts.
const FAMILIES: &[(&str, &str)] = &[
    (
        "allocator_window_limit_tokens",
        "The window's limit G (top quotas by recent grants; window=open|previous)",
    ),
    (
        "allocator_window_bound_tokens",
        "The window's overshoot bound of I6: limit plus the fallback allowances of the regions seen",
    ),
    ("allocator_window_granted_tokens", "Tokens put into leases of the window"),
    (
        "allocator_window_admitted_tokens",
        "Tokens admitted in the window as reported by the agents, by region and source (lease|fallback)",
    ),
    (
        "allocator_window_stranded_tokens",
        "Granted tokens neither consumed nor returned (final once the window closed; 0 while open)",
    ),
    ("allocator_window_bound_held", "1 while the window's admitted tokens are within its bound, else 0"),
];

/// Declares the families.
pub fn describe(r: &Registry) {
    for (name, help) in FAMILIES {
        r.describe(name, "gauge", help);
    }
}

type Series = Vec<(Vec<(&'static str, String)>, f64)>;

/// Recomputes every family (called by `GET /metrics`).
#[tracing::instrument(level = "debug", skip_all)]
pub async fn refresh(state: &AppState) -> Result<()> {
    let mut out: [Series; 6] = Default::default();
    if state.window_metrics_quotas > 0 {
        let mut conn = state.db.acquire().await?;
        let now = state.db_clock.now(&mut conn).await?;
        let quotas = sqlx::query_file!(
            "src/sql/window_metrics_quotas.sql",
            now.timestamp(),
            state.window_metrics_quotas
        )
        .fetch_all(&mut *conn)
        .await?;
        for q in quotas {
            let (tenant, resource, window_secs) = (q.tenant, q.resource, q.window_secs);
            let (from, to) = two_windows(now, window_secs);
            let (accounts, _) = windows::accounts(&mut conn, &tenant, &resource, from, to, 2, now).await?;
            for w in accounts {
                let which = if w.closed { "previous" } else { "open" };
                let base = || {
                    vec![
                        ("tenant", tenant.clone()),
                        ("resource", resource.clone()),
                        ("window", which.to_string()),
                    ]
                };
                out[0].push((base(), w.limit as f64));
                out[1].push((base(), w.bound as f64));
                out[2].push((base(), w.granted as f64));
                for (region, r) in &w.regions {
                    for (source, v) in [("lease", r.consumed), ("fallback", r.fallback_admitted)] {
                        let mut l = base();
                        l.push(("region", region.clone()));
                        l.push(("source", source.to_string()));
                        out[3].push((l, v as f64));
                    }
                }
                out[4].push((base(), w.stranded as f64));
                out[5].push((base(), if w.bound_held { 1.0 } else { 0.0 }));
            }
        }
    }
    for ((name, _), series) in FAMILIES.iter().zip(out) {
        state.metrics.set_family(name, series);
    }
    Ok(())
}

/// `[from, to)` covering the previous and the open window of `window_secs`.
fn two_windows(now: DateTime<Utc>, window_secs: i64) -> (DateTime<Utc>, DateTime<Utc>) {
    let t = now.timestamp();
    let open = t - t.rem_euclid(window_secs);
    let at = |s: i64| DateTime::<Utc>::from_timestamp(s, 0).unwrap_or(now);
    (at(open - window_secs), at(open) + Duration::seconds(window_secs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_windows_cover_the_previous_and_the_open_one() {
        let now = DateTime::<Utc>::from_timestamp(1_000_007, 0).unwrap();
        let (from, to) = two_windows(now, 10);
        assert_eq!((from.timestamp(), to.timestamp()), (999_990, 1_000_010));
    }
}
