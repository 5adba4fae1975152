//! The services' Prometheus registry: a small facade (`describe`, `inc`,
//! `inc_by`, `set`, `set_family`, `observe`, `render`) over the `metrics`
//! crate's Prometheus exporter, which stores the series and renders the
//! text exposition format 0.0.4 (what Prometheus scrapes and what
//! `promtool check metrics` lints: a `# HELP` and `# TYPE` line per family
//! under the family's own name, counters included).
//!
//! Each registry owns its recorders (no global recorder), so several
//! services can run in one test process. A series recorded one by one is
//! looked up once in its recorder; its handle is kept ([`Series`]), so that
//! recording it again (each decision records a few) allocates nothing and
//! hashes its name and labels once. Two recorders:
//!
//! * `kept`: counters, histograms and gauges set one by one; a series lives
//!   as long as the process;
//! * `scraped`: families rebuilt at each scrape ([`Registry::set_family`]);
//!   a series not set again for [`FAMILY_IDLE`] is dropped at the next
//!   render (the exporter's idle timeout on gauges), so a quota that leaves
//!   a top-N list leaves its series instead of keeping stale values.

use metrics::{Counter, Gauge, Histogram, Key, Label, Level, Metadata, Recorder, SharedString};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle, PrometheusRecorder};
use metrics_util::MetricKindMask;
use std::collections::hash_map::RandomState;
use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
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

/// Which kind of series a handle records.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Counter,
    Gauge,
    Histogram,
}

/// A kept series' handle in the `kept` recorder.
#[derive(Clone)]
enum Handle {
    Counter(Counter),
    Gauge(Gauge),
    Histogram(Histogram),
}

impl Handle {
    fn kind(&self) -> Kind {
        match self {
            Handle::Counter(_) => Kind::Counter,
            Handle::Gauge(_) => Kind::Gauge,
            Handle::Histogram(_) => Kind::Histogram,
        }
    }
}

/// One series recorded one by one: its name and labels as asked (before a
/// fold into `other`) and the handle they resolved to. The labels are kept
/// as one run of bytes ([`encode`]), one allocation per series: one series
/// is kept per quota in the per-quota families.
struct Series {
    name: &'static str,
    labels: Box<[u8]>,
    handle: Handle,
}

/// Each key and value of `labels` in turn: what [`encode`], [`Series::is`]
/// and the registry's hash read, each part preceded by its length.
fn parts<'a>(labels: &'a [(&'static str, &'a str)]) -> impl Iterator<Item = &'a str> {
    labels.iter().flat_map(|(k, v)| [*k, *v])
}

/// `labels` as each key and value preceded by its length, so that no two
/// label lists encode alike whatever bytes their values hold.
fn encode(labels: &[(&'static str, &str)]) -> Box<[u8]> {
    let mut out = Vec::with_capacity(labels.iter().map(|(k, v)| 8 + k.len() + v.len()).sum());
    for part in parts(labels) {
        out.extend_from_slice(&(part.len() as u32).to_le_bytes());
        out.extend_from_slice(part.as_bytes());
    }
    out.into_boxed_slice()
}

impl Series {
    /// Whether this is the series of `kind`, `name` and `labels` (compared
    /// with the kept bytes as [`encode`] wrote them, without allocating).
    fn is(&self, kind: Kind, name: &str, labels: &[(&'static str, &str)]) -> bool {
        if self.handle.kind() != kind || self.name != name {
            return false;
        }
        let mut rest: &[u8] = &self.labels;
        for part in parts(labels) {
            let Some((len, r)) = rest.split_first_chunk::<4>() else { return false };
            let len = u32::from_le_bytes(*len) as usize;
            if r.len() < len || r[..len] != *part.as_bytes() {
                return false;
            }
            rest = &r[len..];
        }
        rest.is_empty()
    }
}

/// The kept series by the hash of their name and labels (a second series
/// of the same hash, another kind of the same name or a true collision,
/// goes to `collided`), and how many distinct label sets each family holds.
#[derive(Default)]
struct Known {
    by_hash: HashMap<u64, Series>,
    collided: Vec<Series>,
    per_family: HashMap<&'static str, usize>,
}

impl Known {
    fn find(&self, hash: u64, kind: Kind, name: &str, labels: &[(&'static str, &str)]) -> Option<Handle> {
        let first = self.by_hash.get(&hash).into_iter();
        let mut all = first.chain(self.collided.iter());
        all.find(|s| s.is(kind, name, labels)).map(|s| s.handle.clone())
    }

    fn add(
        &mut self,
        hash: u64,
        name: &'static str,
        labels: &[(&'static str, &str)],
        recorder: &PrometheusRecorder,
        register: &impl Fn(&PrometheusRecorder, &Key) -> Handle,
    ) -> Handle {
        let key = Key::from_parts(
            name,
            labels.iter().map(|(k, v)| Label::new(*k, v.to_string())).collect::<Vec<_>>(),
        );
        let handle = register(recorder, &key);
        let series = Series { name, labels: encode(labels), handle: handle.clone() };
        match self.by_hash.entry(hash) {
            std::collections::hash_map::Entry::Vacant(e) => {
                e.insert(series);
            }
            std::collections::hash_map::Entry::Occupied(_) => self.collided.push(series),
        }
        handle
    }
}

/// A registry of metric families (see the module doc).
pub struct Registry {
    kept: PrometheusRecorder,
    kept_handle: PrometheusHandle,
    scraped: PrometheusRecorder,
    scraped_handle: PrometheusHandle,
    /// The series recorded so far, for their handles and for
    /// [`MAX_SERIES_PER_FAMILY`]. A std `Mutex` is enough: one lookup,
    /// never held across an await nor while a value is recorded.
    known: Mutex<Known>,
    hasher: RandomState,
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
            known: Mutex::new(Known::default()),
            hasher: RandomState::new(),
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

    /// The handle of a kept series: the one resolved before, else
    /// `register`'s for its key. Once the family has
    /// [`MAX_SERIES_PER_FAMILY`] label sets, a new set is recorded as the
    /// family's `other` series (every label `other`), which is kept once
    /// and not counted, so what is remembered stays bounded too.
    fn handle(
        &self,
        kind: Kind,
        name: &'static str,
        labels: &[(&'static str, &str)],
        register: impl Fn(&PrometheusRecorder, &Key) -> Handle,
    ) -> Handle {
        let mut known = self.known.lock().unwrap();
        let hash = self.hash(name, labels);
        if let Some(s) = known.find(hash, kind, name, labels) {
            return s;
        }
        let family = known.per_family.entry(name).or_default();
        if *family < MAX_SERIES_PER_FAMILY {
            *family += 1;
            return known.add(hash, name, labels, &self.kept, &register);
        }
        let other: Vec<(&'static str, &str)> = labels.iter().map(|(k, _)| (*k, "other")).collect();
        let hash = self.hash(name, &other);
        match known.find(hash, kind, name, &other) {
            Some(s) => s,
            None => known.add(hash, name, &other, &self.kept, &register),
        }
    }

    fn hash(&self, name: &str, labels: &[(&'static str, &str)]) -> u64 {
        let mut h = self.hasher.build_hasher();
        h.write(name.as_bytes());
        for part in parts(labels) {
            h.write_u32(part.len() as u32);
            h.write(part.as_bytes());
        }
        h.finish()
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
        let h = self
            .handle(Kind::Counter, name, labels, |r, k| Handle::Counter(r.register_counter(k, &METADATA)));
        if let Handle::Counter(c) = h {
            c.increment(v.max(0.0).round() as u64);
        }
    }

    /// Adds 1 to a counter.
    pub fn inc(&self, name: &'static str, labels: &[(&'static str, &str)]) {
        self.inc_by(name, labels, 1.0);
    }

    /// Sets a gauge.
    pub fn set(&self, name: &'static str, labels: &[(&'static str, &str)], v: f64) {
        if let Handle::Gauge(g) =
            self.handle(Kind::Gauge, name, labels, |r, k| Handle::Gauge(r.register_gauge(k, &METADATA)))
        {
            g.set(v);
        }
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
        let h = self.handle(Kind::Histogram, name, labels, |r, k| {
            Handle::Histogram(r.register_histogram(k, &METADATA))
        });
        if let Handle::Histogram(h) = h {
            h.record(secs);
        }
        if self.observations.fetch_add(1, Ordering::Relaxed) % UPKEEP_EVERY == UPKEEP_EVERY - 1 {
            self.kept_handle.run_upkeep();
        }
    }

    /// How many series the registry keeps handles of.
    #[cfg(test)]
    fn series(&self) -> usize {
        let known = self.known.lock().unwrap();
        known.by_hash.len() + known.collided.len()
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
        // What the registry remembers is bounded too: the family's sets and
        // its one `other` series, however many sets were asked for.
        assert_eq!(r.series(), MAX_SERIES_PER_FAMILY + 1);
        r.inc("c", &[("k", "0")]);
        assert!(r.render().contains("c{k=\"0\"} 2"));
    }

    #[test]
    fn a_series_is_resolved_once_and_each_kind_apart() {
        let r = Registry::default();
        for _ in 0..100 {
            r.inc("hits_total", &[("code", "ok"), ("region", "eu")]);
            r.observe("lat_seconds", &[("code", "ok")], 0.001);
        }
        r.inc("hits_total", &[("code", "ok"), ("region", "us")]);
        // The same labels in another family, and another value of a
        // label, are other series.
        r.set("hits_total_g", &[("code", "ok"), ("region", "eu")], 5.0);
        r.inc("hits_total", &[("code", "okregion"), ("region", "eu")]);
        assert_eq!(r.series(), 5);
        // Keys count as much as values, and where one value ends.
        r.inc("pairs_total", &[("a", "1")]);
        r.inc("pairs_total", &[("b", "1")]);
        r.inc("pairs_total", &[("a", "1"), ("b", "")]);
        r.inc("pairs_total", &[("a", "1b"), ("", "")]);
        assert_eq!(r.series(), 9);
        let text = r.render();
        assert!(text.contains("hits_total{code=\"ok\",region=\"eu\"} 100"), "{text}");
        assert!(text.contains("hits_total{code=\"ok\",region=\"us\"} 1"), "{text}");
        assert!(text.contains("hits_total_g{code=\"ok\",region=\"eu\"} 5"), "{text}");
        assert!(text.contains("lat_seconds_count{code=\"ok\"} 100"), "{text}");
        assert!(text.contains("pairs_total{b=\"1\"} 1"), "{text}");
    }
}
