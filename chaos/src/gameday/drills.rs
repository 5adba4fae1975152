//! Seed 002's ten game days as drills: what each runs, the incidents it
//! rehearses and the numeric criteria of its verdict. Data and a pure
//! judge, so the table and the rules are tested without a stack.

use std::collections::BTreeMap;

/// Where a drill's run comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// A chaos scenario (`cargo lab chaos --scenario NAME`), judged on its
    /// verdict and its figures.
    Scenario(&'static str),
    /// The bench's hot-tenant flood row (`chaos::bench::flood`), on a rig
    /// of its own.
    Flood,
}

/// What a criterion compares a figure with.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Limit {
    Value(f64),
    /// Another figure of the same run (e.g. the window's bound).
    Figure(&'static str),
}

/// `figure <= limit` (`at_most`) or `figure >= limit`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Criterion {
    pub figure: &'static str,
    pub at_most: bool,
    pub limit: Limit,
}

const fn at_most(figure: &'static str, v: f64) -> Criterion {
    Criterion { figure, at_most: true, limit: Limit::Value(v) }
}

const fn at_least(figure: &'static str, v: f64) -> Criterion {
    Criterion { figure, at_most: false, limit: Limit::Value(v) }
}

/// Every window admitted at most the bound the policy documents (I6; the
/// scenario's own verdict checks the same per window): the most any window
/// admitted beyond its bound, at most 0.
const WITHIN_BOUND: Criterion = at_most("admitted_over_bound_max", 0.0);

/// One game day.
#[derive(Debug, Clone, Copy)]
pub struct Drill {
    pub n: u8,
    pub name: &'static str,
    pub incidents: &'static [&'static str],
    /// What the seed asks the day to do.
    pub what: &'static str,
    pub source: Source,
    /// Built for the game day (the others reuse a scenario or a bench row
    /// that already did the drill).
    pub new: bool,
    pub criteria: &'static [Criterion],
}

/// The ten game days of seed 002, in its order.
pub const DRILLS: [Drill; 10] = [
    Drill {
        n: 1,
        name: "redis-primary-killed-at-peak",
        incidents: &["F10", "F20"],
        what: "kill the Redis primary at peak; the over-admission tail against the replication lag; fail modes followed",
        source: Source::Scenario("redis-failover"),
        new: false,
        criteria: &[WITHIN_BOUND],
    },
    Drill {
        n: 2,
        name: "hot-tenant-flood",
        incidents: &["F13"],
        what: "one tenant's spent quota flooded by 64 clients: store calls cut, the other tenant's p99",
        source: Source::Flood,
        new: false,
        criteria: &[at_most("flood.runs_per_attempt", 0.01), at_most("flood.other_p99_ratio", 2.0)],
    },
    Drill {
        n: 3,
        name: "synchronized-retry-wave",
        incidents: &["F26"],
        what: "a wave of refused clients retrying after Retry-After, with and without server jitter: peak retries per 100 ms",
        source: Source::Scenario("retry-wave"),
        new: true,
        criteria: &[at_most("peak_ratio", 0.6)],
    },
    Drill {
        n: 4,
        name: "bogus-principals",
        incidents: &["F14", "F15", "F35"],
        what: "a flood of distinct bogus keys: memory, evictions, key lifetimes, script rate",
        source: Source::Scenario("bogus-principals"),
        new: true,
        criteria: &[
            at_most("evicted_keys", 0.0),
            at_most("redis_keys_without_ttl", 0.0),
            at_most("principal_keys_left_after_refill", 0.0),
        ],
    },
    Drill {
        n: 5,
        name: "eu-us-partition",
        incidents: &["F21", "F22", "F23"],
        what: "a region cut off from the allocator for 2+ windows: admitted <= the documented bound",
        source: Source::Scenario("partition-bounded"),
        new: false,
        criteria: &[WITHIN_BOUND],
    },
    Drill {
        n: 6,
        name: "bad-policy-to-canary",
        incidents: &["F24", "F25"],
        what: "a version 100x too tight to the canary: auto-halt time, refusals outside the canary, roll forward",
        source: Source::Scenario("policy-rollout"),
        new: false,
        criteria: &[
            at_most("refusals_outside_canary", 0.0),
            Criterion { figure: "halt_s", at_most: true, limit: Limit::Figure("soak_s") },
            at_least("rolled_forward", 1.0),
        ],
    },
    Drill {
        n: 7,
        name: "key-namespace-change-in-shadow",
        incidents: &["F34"],
        what: "a rolling change of the Redis key layout with the policy in shadow mode, decisions diffed",
        source: Source::Scenario("key-namespace-shadow"),
        new: true,
        criteria: &[at_most("errors_5xx", 0.0), Criterion {
                figure: "per_key_admits_max_ratio_mixed",
                at_most: true,
                limit: Limit::Figure("per_key_admits_max_ratio_bound"),
            }],
    },
    Drill {
        n: 8,
        name: "corrupted-telemetry",
        incidents: &["F30"],
        what: "fleet statuses and metrics broken or duplicated: enforcement and ledger totals unchanged",
        source: Source::Scenario("corrupted-telemetry"),
        new: true,
        criteria: &[
            at_most("status_5xx", 0.0),
            // The ledger may count a request whose answer was lost (the
            // client cannot know it was admitted), never one fewer.
            Criterion { figure: "ledger_minus_clients", at_most: true, limit: Limit::Figure("unanswered") },
            at_least("ledger_minus_clients", 0.0),
            WITHIN_BOUND,
        ],
    },
    Drill {
        n: 9,
        name: "snapshot-restore",
        incidents: &["F33"],
        what: "a region's Redis restored from an older snapshot under demand above G: which limits notice",
        source: Source::Scenario("redis-rollback"),
        new: false,
        criteria: &[WITHIN_BOUND],
    },
    Drill {
        n: 10,
        name: "retried-debit-without-idempotency-key",
        incidents: &["F11"],
        what: "debits retried after a timeout, with and without a request_id: double debits",
        source: Source::Scenario("retried-debit"),
        new: true,
        criteria: &[at_most("extra_debits_with_id", 0.0), at_least("extra_debits_without_id", 1.0)],
    },
];

/// The drill numbered `n`.
pub fn drill(n: u8) -> Option<&'static Drill> {
    DRILLS.iter().find(|d| d.n == n)
}

/// A criterion as text: `peak_ratio <= 0.6`.
pub fn describe(c: &Criterion) -> String {
    let limit = match c.limit {
        Limit::Value(v) => format!("{v}"),
        Limit::Figure(f) => f.to_string(),
    };
    format!("{} {} {limit}", c.figure, if c.at_most { "<=" } else { ">=" })
}

/// The criteria `figures` fail, each named with what was measured; a
/// figure the run did not record fails its criterion.
pub fn failed_criteria(criteria: &[Criterion], figures: &BTreeMap<String, f64>) -> Vec<String> {
    criteria
        .iter()
        .filter_map(|c| {
            let Some(&v) = figures.get(c.figure) else {
                return Some(format!("{}: not measured", describe(c)));
            };
            let limit = match c.limit {
                Limit::Value(l) => l,
                Limit::Figure(f) => match figures.get(f) {
                    Some(&l) => l,
                    None => return Some(format!("{}: {f} not measured", describe(c))),
                },
            };
            let holds = if c.at_most { v <= limit } else { v >= limit };
            (!holds).then(|| format!("{}: measured {v}", describe(c)))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn figures(pairs: &[(&str, f64)]) -> BTreeMap<String, f64> {
        pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect()
    }

    #[test]
    fn the_ten_drills_are_numbered_in_order_and_name_their_incidents() {
        for (i, d) in DRILLS.iter().enumerate() {
            assert_eq!(d.n as usize, i + 1);
            assert!(!d.incidents.is_empty() && !d.criteria.is_empty(), "drill {}", d.n);
        }
        assert_eq!(DRILLS.iter().filter(|d| d.new).map(|d| d.n).collect::<Vec<_>>(), vec![3, 4, 7, 8, 10]);
    }

    #[test]
    fn every_scenario_a_drill_runs_is_in_the_chaos_catalogue() {
        for d in &DRILLS {
            if let Source::Scenario(s) = d.source {
                assert!(crate::scenarios::SCENARIOS.iter().any(|(n, _)| *n == s), "drill {}: {s}", d.n);
            }
        }
    }

    #[test]
    fn a_criterion_holds_at_its_limit_and_fails_past_it() {
        let c = [at_most("peak_ratio", 0.6), at_least("rolled_forward", 1.0)];
        assert!(failed_criteria(&c, &figures(&[("peak_ratio", 0.6), ("rolled_forward", 1.0)])).is_empty());
        let failed = failed_criteria(&c, &figures(&[("peak_ratio", 0.61), ("rolled_forward", 0.0)]));
        assert_eq!(failed, vec!["peak_ratio <= 0.6: measured 0.61", "rolled_forward >= 1: measured 0"]);
    }

    #[test]
    fn a_missing_figure_fails_and_a_limit_may_be_another_figure() {
        let c = [Criterion { figure: "ratio", at_most: true, limit: Limit::Figure("ratio_bound") }];
        assert!(failed_criteria(&c, &figures(&[("ratio", 2.1), ("ratio_bound", 2.15)])).is_empty());
        assert_eq!(
            failed_criteria(&c, &figures(&[("ratio", 2.2), ("ratio_bound", 2.15)])),
            vec!["ratio <= ratio_bound: measured 2.2"]
        );
        assert_eq!(failed_criteria(&c, &figures(&[])), vec!["ratio <= ratio_bound: not measured"]);
        assert_eq!(
            failed_criteria(&c, &figures(&[("ratio", 5.0)])),
            vec!["ratio <= ratio_bound: ratio_bound not measured"]
        );
        assert_eq!(
            failed_criteria(&[WITHIN_BOUND], &figures(&[("admitted_over_bound_max", 1.0)])),
            vec!["admitted_over_bound_max <= 0: measured 1"]
        );
    }
}
