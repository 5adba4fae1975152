//! The services' Prometheus registry: a small facade (`describe`, `inc`,
//! `inc_by`, `set`, `set_family`, `observe`, `render`) over the `metrics`
//! crate's Prometheus exporter, which stores the series and renders the
//! text exposition format 0.0.4 (what Prometheus scrapes and what
//! `promtool check metrics` lints: a `# HELP` and `# TYPE` line per family
//! under the family's own name, counters included).
//!
//! Each registry owns its recorders (no global recorder), so several
//! services can run in one test process. Two recorders:
//!
//! * `kept`: counters, histograms and gauges set one by one; a series lives
//!   as long as the process;
//! * `scraped`: families rebuilt at each scrape ([`Registry::set_family`]);
//!   a series not set again for [`FAMILY_IDLE`] is dropped at the next
//!   render (the exporter's idle timeout on gauges), so a quota that leaves
//!   a top-N list leaves its series instead of keeping stale values.

use metrics::{Key, Label, Level, Metadata, Recorder, SharedString};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle, PrometheusRecorder};
use metrics_util::MetricKindMask;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

/// Latency buckets in seconds, from 100 µs to 10 s.
pub const LATENCY_BUCKETS: &[f64] =
    &[0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0];

/// The most label combinations one family keeps; beyond it new combinations
/// fold into `other` so a stream of distinct labels cannot grow memory.
pub const MAX_SERIES_PER_FAMILY: usize = 1024;

/// Histogram observations between two upkeeps of the exporter (which moves
/// recorded samples into the buckets; a render does it too, so a process
/// that is never scraped still holds a bounded number of samples).
const UPKEEP_EVERY: u64 = 4096;

/// How long a series of a [`Registry::set_family`] family outlives its last
/// setting. Not zero: two scrapes close together (two Prometheus servers)
/// must both see the families the first one set; short against any scrape
/// interval, so a series that left the family is gone at the next scrape.
pub const FAMILY_IDLE: Duration = Duration::from_secs(5);

static METADATA: Metadata<'static> = Metadata::new(module_path!(), Level::INFO, Some(module_path!()));

type Labels = Vec<(&'static str, String)>;

/// A registry of metric families (see the module doc).
pub struct Registry {
    kept: PrometheusRecorder,
    kept_handle: PrometheusHandle,
    scraped: PrometheusRecorder,
    scraped_handle: PrometheusHandle,
    /// Label sets seen per family, for [`MAX_SERIES_PER_FAMILY`]. A std
    /// `Mutex` is enough: a few set operations, never held across an await.
    seen: Mutex<HashMap<&'static str, HashSet<Labels>>>,
    observations: AtomicU64,
}

impl Default for Registry {
    fn default() -> Self {
        Registry::new(FAMILY_IDLE)
    }
}

impl Registry {
    fn new(family_idle: Duration) -> Self {
        let builder = || PrometheusBuilder::new().set_buckets(LATENCY_BUCKETS).expect("non-empty buckets");
        let kept = builder().build_recorder();
        let scraped = builder().idle_timeout(MetricKindMask::GAUGE, Some(family_idle)).build_recorder();
        Registry {
            kept_handle: kept.handle(),
            kept,
            scraped_handle: scraped.handle(),
            scraped,
            seen: Mutex::new(HashMap::new()),
            observations: AtomicU64::new(0),
        }
    }

    /// Declares a family's help text and type (`counter`, `gauge`, `histogram`).
    pub fn describe(&self, name: &'static str, kind: &'static str, help: &'static str) {
        let help = SharedString::const_str(help);
        for r in [&self.kept, &self.scraped] {
            match kind {
                "counter" => r.describe_counter(name.into(), None, help.clone()),
                "histogram" => r.describe_histogram(name.into(), None, help.clone()),
                _ => r.describe_gauge(name.into(), None, help.clone()),
            }
        }
    }

    /// The exporter's key of a series, with labels folded into `other` once
    /// the family has [`MAX_SERIES_PER_FAMILY`] label sets.
    fn key(&self, name: &'static str, labels: &[(&'static str, &str)]) -> Key {
        let set: Labels = labels.iter().map(|(k, v)| (*k, v.to_string())).collect();
        let mut seen = self.seen.lock().unwrap();
        let fam = seen.entry(name).or_default();
        let set = if fam.contains(&set) || fam.len() < MAX_SERIES_PER_FAMILY {
            fam.insert(set.clone());
            set
        } else {
            labels.iter().map(|(k, _)| (*k, "other".to_string())).collect()
        };
        Key::from_parts(name, set.into_iter().map(|(k, v)| Label::new(k, v)).collect::<Vec<_>>())
    }

    /// Declares a counter family with one label and starts the series of
    /// each of `values` at 0, so that `increase()` sees their first event.
    pub fn counter_from_zero(
        &self,
        name: &'static str,
        help: &'static str,
        label: &'static str,
        values: &[&str],
    ) {
        self.describe(name, "counter", help);
        for v in values {
            self.inc_by(name, &[(label, v)], 0.0);
        }
    }

    /// Adds `v` (a whole, non-negative number) to a counter; 0 makes the
    /// series appear at 0.
    pub fn inc_by(&self, name: &'static str, labels: &[(&'static str, &str)], v: f64) {
        let counter = self.kept.register_counter(&self.key(name, labels), &METADATA);
        counter.increment(v.max(0.0).round() as u64);
    }

    /// Adds 1 to a counter.
    pub fn inc(&self, name: &'static str, labels: &[(&'static str, &str)]) {
        self.inc_by(name, labels, 1.0);
    }

    /// Sets a gauge.
    pub fn set(&self, name: &'static str, labels: &[(&'static str, &str)], v: f64) {
        self.kept.register_gauge(&self.key(name, labels), &METADATA).set(v);
    }

    /// Replaces every series of a gauge family at once: a family computed
    /// afresh at each scrape (per-window or per-quota state) loses the
    /// series of what it no longer covers at the next render instead of
    /// keeping their last values forever. At most [`MAX_SERIES_PER_FAMILY`]
    /// series are kept.
    pub fn set_family(&self, name: &'static str, series: Vec<(Vec<(&'static str, String)>, f64)>) {
        for (labels, v) in series.into_iter().take(MAX_SERIES_PER_FAMILY) {
            let key =
                Key::from_parts(name, labels.into_iter().map(|(k, v)| Label::new(k, v)).collect::<Vec<_>>());
            self.scraped.register_gauge(&key, &METADATA).set(v);
        }
    }

    /// Records one observation (seconds) in a latency histogram.
    pub fn observe(&self, name: &'static str, labels: &[(&'static str, &str)], secs: f64) {
        self.kept.register_histogram(&self.key(name, labels), &METADATA).record(secs);
        if self.observations.fetch_add(1, Ordering::Relaxed) % UPKEEP_EVERY == UPKEEP_EVERY - 1 {
            self.kept_handle.run_upkeep();
        }
    }

    /// The whole registry in Prometheus text exposition format 0.0.4.
    pub fn render(&self) -> String {
        let mut out = self.kept_handle.render();
        out.push_str(&self.scraped_handle.render());
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counters_and_histograms() {
        let r = Registry::default();
        r.describe("grants_total", "counter", "Grants by outcome");
        r.describe("lat_seconds", "histogram", "Latency");
        r.inc("grants_total", &[("outcome", "granted")]);
        r.inc("grants_total", &[("outcome", "granted")]);
        r.observe("lat_seconds", &[], 0.0003);
        let text = r.render();
        assert!(text.contains("# HELP grants_total Grants by outcome"), "{text}");
        assert!(text.contains("# TYPE grants_total counter"), "{text}");
        assert!(text.contains("grants_total{outcome=\"granted\"} 2"), "{text}");
        assert!(text.contains("# TYPE lat_seconds histogram"), "{text}");
        assert!(text.contains("lat_seconds_bucket{le=\"0.0005\"} 1"), "{text}");
        assert!(text.contains("lat_seconds_bucket{le=\"0.0001\"} 0"), "{text}");
        assert!(text.contains("lat_seconds_count 1"), "{text}");
    }

    #[test]
    fn set_family_replaces_every_series() {
        // No grace period: the series left out is gone at the very next render.
        let r = Registry::new(Duration::ZERO);
        r.describe("g", "gauge", "A family");
        r.set_family("g", vec![(vec![("q", "a".to_string())], 1.0), (vec![("q", "b".to_string())], 2.0)]);
        let first = r.render();
        assert!(first.contains("g{q=\"a\"} 1"), "{first}");
        r.set_family("g", vec![(vec![("q", "b".to_string())], 3.0)]);
        let text = r.render();
        assert!(!text.contains("g{q=\"a\"}"), "{text}");
        assert!(text.contains("g{q=\"b\"} 3"), "{text}");
    }

    #[test]
    fn a_family_survives_two_scrapes_close_together() {
        let r = Registry::default();
        r.describe("g", "gauge", "A family");
        r.set_family("g", vec![(vec![("q", "a".to_string())], 1.0)]);
        let first = r.render();
        let second = r.render();
        assert!(first.contains("g{q=\"a\"} 1") && second.contains("g{q=\"a\"} 1"), "{first}\n{second}");
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
