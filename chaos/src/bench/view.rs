//! Typed views of a report's results. `report.json` keeps its results as
//! flat dotted keys (`acquire.c16.p99_ms`: the contract other tools read);
//! a part of the bench reads back what it wrote as a struct of its own
//! ([`part`]: the keys under one prefix, split at their dots into nested
//! fields), so a table is rendered from named fields, and a key renamed on
//! one side is a compile error or an empty cell on the page, not a silent
//! mismatch between two strings.

use super::report::BenchReport;
use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

/// The results under `prefix` (`acquire.c16`) as `T`. A key that is both a
/// value and the prefix of others (`utilization.skew` beside
/// `utilization.skew.stranded_pct`) is the field `value` of its node.
/// Fields of `T` not measured stay `None` (`T`'s fields are `Option`s or
/// structs of them, all `#[serde(default)]`).
pub fn part<T: DeserializeOwned + Default>(r: &BenchReport, prefix: &str) -> T {
    let lead = format!("{prefix}.");
    let mut root = Map::new();
    for (key, v) in r.results.range(lead.clone()..) {
        let Some(rest) = key.strip_prefix(&lead) else { break };
        insert(&mut root, rest, *v);
    }
    if let Some(v) = r.get(prefix) {
        root.entry("value").or_insert(Value::from(v));
    }
    serde_json::from_value(Value::Object(root)).unwrap_or_default()
}

fn insert(node: &mut Map<String, Value>, path: &str, v: f64) {
    match path.split_once('.') {
        None => match node.get_mut(path) {
            Some(Value::Object(child)) => {
                child.insert("value".into(), Value::from(v));
            }
            _ => {
                node.insert(path.to_string(), Value::from(v));
            }
        },
        Some((head, rest)) => {
            let child = node.entry(head.to_string()).or_insert_with(|| Value::Object(Map::new()));
            if !child.is_object() {
                let leaf = child.take();
                *child = Value::Object(Map::from_iter([("value".to_string(), leaf)]));
            }
            if let Value::Object(m) = child {
                insert(m, rest, v);
            }
        }
    }
}

/// One figure as the tables show it: three significant places at most,
/// `–` when not measured.
pub fn cell(x: Option<f64>) -> String {
    match x {
        Some(x) if x.abs() >= 100.0 => format!("{x:.0}"),
        Some(x) if x.abs() >= 10.0 => format!("{x:.1}"),
        Some(x) => format!("{x:.3}"),
        None => "–".into(),
    }
}

/// A rate and latencies of one measured path.
#[derive(Debug, Clone, Copy, Default, serde::Deserialize)]
#[serde(default)]
pub struct Rate {
    pub decisions_per_s: Option<f64>,
    pub p50_ms: Option<f64>,
    pub p99_ms: Option<f64>,
}

/// The scaling figures the parts leave under `scaling.*` (the per-count
/// rows are [`super::grants::AtQuotas`]; several parts write them).
#[derive(Debug, Clone, Copy, Default, serde::Deserialize)]
#[serde(default)]
pub struct Scaling {
    pub redis_bytes_per_quota: Option<f64>,
    pub agent_quotas_held: Option<f64>,
    pub agent_kib_per_quota: Option<f64>,
    pub ledger_rows_per_s: Option<f64>,
    pub ledger_rows_per_hour: Option<f64>,
    pub ledger_rows_per_grant: Option<f64>,
}

impl Scaling {
    pub fn of(r: &BenchReport) -> Scaling {
        part(r, "scaling")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    #[derive(Debug, Default, serde::Deserialize, PartialEq)]
    #[serde(default)]
    struct Node {
        value: Option<f64>,
        stranded_pct: Option<f64>,
        eu: Leaf,
    }

    #[derive(Debug, Default, serde::Deserialize, PartialEq)]
    #[serde(default)]
    struct Leaf {
        served_pct: Option<f64>,
    }

    fn report(values: &[(&str, f64)]) -> BenchReport {
        let mut r: BenchReport = serde_json::from_value(serde_json::json!({
            "command": "", "argv": [], "mode": "quick", "repetitions": 1, "seconds": 0.0,
            "machine": {"date_utc": "", "nproc": 2, "cpu_model": "", "mem_total_mb": 0, "kernel": "",
                        "load_avg_at_start": ""},
            "results": {}, "targets": [], "notes": []
        }))
        .unwrap();
        r.results = values.iter().map(|(k, v)| (k.to_string(), *v)).collect::<BTreeMap<_, _>>();
        r
    }

    #[test]
    fn a_prefix_reads_back_as_nested_fields_and_a_leaf_that_is_also_a_node_as_value() {
        let r = report(&[
            ("utilization.skew", 99.5),
            ("utilization.skew.stranded_pct", 0.4),
            ("utilization.skew.eu.served_pct", 98.0),
            ("utilization.skewed.stranded_pct", 7.0),
        ]);
        let n: Node = part(&r, "utilization.skew");
        assert_eq!(
            n,
            Node { value: Some(99.5), stranded_pct: Some(0.4), eu: Leaf { served_pct: Some(98.0) } }
        );
        let none: Node = part(&r, "utilization.contention");
        assert_eq!(none, Node::default());
    }

    #[test]
    fn cells_show_three_significant_places_or_a_dash() {
        assert_eq!(
            [cell(Some(1234.56)), cell(Some(12.345)), cell(Some(0.12345)), cell(None)],
            ["1235", "12.3", "0.123", "–"]
        );
    }
}
