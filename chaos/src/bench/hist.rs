//! The closed-loop driver every throughput measurement shares: `clients`
//! tasks each issue one operation at a time for a fixed duration, and every
//! latency goes into an HDR histogram (microseconds, 3 significant digits),
//! so p99.9 is exact to 0.1 % whatever the sample count and memory stays
//! fixed however long a run is.

use futures::future::BoxFuture;
use hdrhistogram::Histogram;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Highest latency a histogram holds (60 s, far above every call timeout).
const MAX_US: u64 = 60_000_000;

/// One operation of a closed loop: `(client, n)` → done or why not.
pub type Op = Arc<dyn Fn(usize, u64) -> BoxFuture<'static, Result<(), String>> + Send + Sync>;

/// What one closed-loop run measured (JSON between `quota-lab` and the
/// `limitador-peer` process).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Sample {
    /// Successful operations per second over the run.
    pub per_s: f64,
    pub mean_ms: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub p999_ms: f64,
    pub ok: u64,
    pub errors: u64,
    /// The first error seen, to name in the report.
    pub first_error: Option<String>,
}

fn new_hist() -> Histogram<u64> {
    Histogram::new_with_bounds(1, MAX_US, 3).expect("static histogram bounds are valid")
}

/// A client stops after this many failed operations in a row: a broken
/// target must end the run with an error, not spin for its whole duration.
const MAX_CONSECUTIVE_ERRORS: u64 = 1_000;

/// Runs `op` from `clients` concurrent tasks for `dur`.
pub async fn closed_loop(clients: usize, dur: Duration, op: Op) -> Result<Sample, String> {
    let started = Instant::now();
    let deadline = started + dur;
    let mut tasks = tokio::task::JoinSet::new();
    for c in 0..clients.max(1) {
        let op = op.clone();
        tasks.spawn(async move {
            let mut h = new_hist();
            let (mut ok, mut errors, mut streak) = (0u64, 0u64, 0u64);
            let mut first_error = None;
            let mut n = 0u64;
            while Instant::now() < deadline && streak < MAX_CONSECUTIVE_ERRORS {
                n += 1;
                let t = Instant::now();
                match op(c, n).await {
                    Ok(()) => {
                        let us = (t.elapsed().as_micros() as u64).clamp(1, MAX_US);
                        let _ = h.record(us);
                        ok += 1;
                        streak = 0;
                    }
                    Err(e) => {
                        errors += 1;
                        streak += 1;
                        first_error.get_or_insert(e);
                    }
                }
            }
            (h, ok, errors, first_error)
        });
    }
    let mut all = new_hist();
    let (mut ok, mut errors, mut first_error) = (0u64, 0u64, None);
    while let Some(r) = tasks.join_next().await {
        let (h, o, e, f) = r.map_err(|e| format!("bench client panicked: {e}"))?;
        all.add(&h).map_err(|e| format!("merging histograms: {e}"))?;
        ok += o;
        errors += e;
        if first_error.is_none() {
            first_error = f;
        }
    }
    let secs = started.elapsed().as_secs_f64();
    let ms = |q: f64| all.value_at_quantile(q) as f64 / 1000.0;
    Ok(Sample {
        per_s: ok as f64 / secs,
        mean_ms: all.mean() / 1000.0,
        p50_ms: ms(0.50),
        p99_ms: ms(0.99),
        p999_ms: ms(0.999),
        ok,
        errors,
        first_error,
    })
}

/// The median of `v` (mean of the middle two for an even count; 0 when empty).
pub fn median(v: &[f64]) -> f64 {
    let mut s: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    if s.is_empty() {
        return 0.0;
    }
    s.sort_by(|a, b| a.total_cmp(b));
    let m = s.len() / 2;
    if s.len() % 2 == 1 {
        s[m]
    } else {
        (s[m - 1] + s[m]) / 2.0
    }
}

/// Medians over repetitions of the same measurement.
#[derive(Debug, Clone, Default)]
pub struct Medians {
    pub per_s: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub p999_ms: f64,
    pub errors: u64,
    pub first_error: Option<String>,
}

impl Medians {
    /// Medians of each figure of `samples` (figures taken independently).
    pub fn of(samples: &[Sample]) -> Medians {
        let f = |g: fn(&Sample) -> f64| median(&samples.iter().map(g).collect::<Vec<_>>());
        Medians {
            per_s: f(|s| s.per_s),
            p50_ms: f(|s| s.p50_ms),
            p99_ms: f(|s| s.p99_ms),
            p999_ms: f(|s| s.p999_ms),
            errors: samples.iter().map(|s| s.errors).sum(),
            first_error: samples.iter().find_map(|s| s.first_error.clone()),
        }
    }

    /// Sets `{prefix}.{per_s}` (the throughput's key), `{prefix}.p50_ms`
    /// and `{prefix}.p99_ms`, and notes errors as `{label}: N errors,
    /// first: ...`.
    pub fn put(&self, out: &mut super::Results, prefix: &str, per_s: &str, label: &str) {
        out.set(&format!("{prefix}.{per_s}"), self.per_s);
        out.set(&format!("{prefix}.p50_ms"), self.p50_ms);
        out.set(&format!("{prefix}.p99_ms"), self.p99_ms);
        if self.errors > 0 {
            out.note(format!("{label}: {} errors, first: {:?}", self.errors, self.first_error));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::median;

    #[test]
    fn median_of_odd_and_even_counts() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert_eq!(median(&[]), 0.0);
    }
}
