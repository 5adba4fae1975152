//! A small Prometheus text-format registry: counters and histograms keyed by
//! a fixed label set. Both services expose a handful of series, so a full
//! metrics stack would be more code than it saves.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Mutex;

/// Latency buckets in seconds, from 100 µs to 10 s.
pub const LATENCY_BUCKETS: &[f64] =
    &[0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0];

/// The most label combinations one family keeps; beyond it new combinations
/// fold into `other` so a stream of distinct labels cannot grow memory.
pub const MAX_SERIES_PER_FAMILY: usize = 1024;

type Labels = Vec<(&'static str, String)>;

#[derive(Default)]
struct Histogram {
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

#[derive(Default)]
struct Families {
    help: BTreeMap<&'static str, (&'static str, &'static str)>,
    counters: BTreeMap<&'static str, BTreeMap<Labels, f64>>,
    gauges: BTreeMap<&'static str, BTreeMap<Labels, f64>>,
    histograms: BTreeMap<&'static str, BTreeMap<Labels, Histogram>>,
}

/// A registry of metric families. A std `Mutex` is enough: every update is a
/// few map operations and is never held across an await.
#[derive(Default)]
pub struct Registry {
    inner: Mutex<Families>,
}

fn bounded_key<V>(map: &BTreeMap<Labels, V>, labels: &[(&'static str, &str)]) -> Labels {
    let key: Labels = labels.iter().map(|(k, v)| (*k, v.to_string())).collect();
    if map.len() >= MAX_SERIES_PER_FAMILY && !map.contains_key(&key) {
        return labels.iter().map(|(k, _)| (*k, "other".to_string())).collect();
    }
    key
}

impl Registry {
    /// Declares a family's help text and type (`counter`, `gauge`, `histogram`).
    pub fn describe(&self, name: &'static str, kind: &'static str, help: &'static str) {
        self.inner.lock().unwrap().help.insert(name, (kind, help));
    }

    /// Adds `v` to a counter.
    pub fn inc_by(&self, name: &'static str, labels: &[(&'static str, &str)], v: f64) {
        let mut g = self.inner.lock().unwrap();
        let fam = g.counters.entry(name).or_default();
        let key = bounded_key(fam, labels);
        *fam.entry(key).or_default() += v;
    }

    /// Adds 1 to a counter.
    pub fn inc(&self, name: &'static str, labels: &[(&'static str, &str)]) {
        self.inc_by(name, labels, 1.0);
    }

    /// Sets a gauge.
    pub fn set(&self, name: &'static str, labels: &[(&'static str, &str)], v: f64) {
        let mut g = self.inner.lock().unwrap();
        let fam = g.gauges.entry(name).or_default();
        let key = bounded_key(fam, labels);
        fam.insert(key, v);
    }

    /// Replaces every series of a gauge family at once: a family computed
    /// afresh at each scrape (per-window or per-quota state) loses the
    /// series of what it no longer covers instead of keeping their last
    /// values forever. At most [`MAX_SERIES_PER_FAMILY`] series are kept.
    pub fn set_family(&self, name: &'static str, series: Vec<(Vec<(&'static str, String)>, f64)>) {
        let fam: BTreeMap<Labels, f64> = series.into_iter().take(MAX_SERIES_PER_FAMILY).collect();
        self.inner.lock().unwrap().gauges.insert(name, fam);
    }

    /// Records one observation (seconds) in a latency histogram.
    pub fn observe(&self, name: &'static str, labels: &[(&'static str, &str)], secs: f64) {
        let mut g = self.inner.lock().unwrap();
        let fam = g.histograms.entry(name).or_default();
        let key = bounded_key(fam, labels);
        let h = fam.entry(key).or_default();
        if h.counts.is_empty() {
            h.counts = vec![0; LATENCY_BUCKETS.len()];
        }
        if let Some(i) = LATENCY_BUCKETS.iter().position(|b| secs <= *b) {
            h.counts[i] += 1;
        }
        h.sum += secs;
        h.count += 1;
    }

    /// The whole registry in Prometheus text exposition format 0.0.4.
    pub fn render(&self) -> String {
        let g = self.inner.lock().unwrap();
        let mut out = String::new();
        let header = |out: &mut String, name: &str, default_kind: &str| {
            let (kind, help) = g.help.get(name).copied().unwrap_or((default_kind, ""));
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        };
        for (name, series) in &g.counters {
            header(&mut out, name, "counter");
            for (labels, v) in series {
                let _ = writeln!(out, "{name}{} {v}", fmt_labels(labels, None));
            }
        }
        for (name, series) in g.gauges.iter().filter(|(_, s)| !s.is_empty()) {
            header(&mut out, name, "gauge");
            for (labels, v) in series {
                let _ = writeln!(out, "{name}{} {v}", fmt_labels(labels, None));
            }
        }
        for (name, series) in &g.histograms {
            header(&mut out, name, "histogram");
            for (labels, h) in series {
                let mut cum = 0;
                for (b, c) in LATENCY_BUCKETS.iter().zip(&h.counts) {
                    cum += c;
                    let _ = writeln!(out, "{name}_bucket{} {cum}", fmt_labels(labels, Some(&b.to_string())));
                }
                let _ = writeln!(out, "{name}_bucket{} {}", fmt_labels(labels, Some("+Inf")), h.count);
                let _ = writeln!(out, "{name}_sum{} {}", fmt_labels(labels, None), h.sum);
                let _ = writeln!(out, "{name}_count{} {}", fmt_labels(labels, None), h.count);
            }
        }
        out
    }
}

fn fmt_labels(labels: &Labels, le: Option<&str>) -> String {
    let mut parts: Vec<String> = labels
        .iter()
        .map(|(k, v)| {
            format!("{k}=\"{}\"", v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n"))
        })
        .collect();
    if let Some(le) = le {
        parts.push(format!("le=\"{le}\""));
    }
    if parts.is_empty() {
        String::new()
    } else {
        format!("{{{}}}", parts.join(","))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counters_and_histograms() {
        let r = Registry::default();
        r.describe("grants_total", "counter", "Grants by outcome");
        r.inc("grants_total", &[("outcome", "granted")]);
        r.inc("grants_total", &[("outcome", "granted")]);
        r.observe("lat_seconds", &[], 0.0003);
        let text = r.render();
        assert!(text.contains("# TYPE grants_total counter"), "{text}");
        assert!(text.contains("grants_total{outcome=\"granted\"} 2"), "{text}");
        assert!(text.contains("lat_seconds_bucket{le=\"0.0005\"} 1"), "{text}");
        assert!(text.contains("lat_seconds_bucket{le=\"0.0001\"} 0"), "{text}");
        assert!(text.contains("lat_seconds_count 1"), "{text}");
    }

    #[test]
    fn set_family_replaces_every_series() {
        let r = Registry::default();
        r.set_family("g", vec![(vec![("q", "a".to_string())], 1.0), (vec![("q", "b".to_string())], 2.0)]);
        r.set_family("g", vec![(vec![("q", "b".to_string())], 3.0)]);
        let text = r.render();
        assert!(!text.contains("g{q=\"a\"}"), "{text}");
        assert!(text.contains("g{q=\"b\"} 3"), "{text}");
    }

    #[test]
    fn label_cardinality_is_bounded() {
        let r = Registry::default();
        for i in 0..(MAX_SERIES_PER_FAMILY + 10) {
            r.inc("c", &[("k", &i.to_string())]);
        }
        let text = r.render();
        assert!(text.contains("c{k=\"other\"} 10"), "{}", &text[text.len() - 200..]);
    }
}
