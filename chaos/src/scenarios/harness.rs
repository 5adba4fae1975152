//! What every scenario does around its faults: a stack, a policy, traffic,
//! timed phases, and the closing checks that turn ground truth into a
//! verdict.

use crate::accounts;
use crate::bins::Bins;
use crate::report::{self, ScenarioReport, Verdict};
use crate::stack::{Stack, StackSpec};
use crate::traffic::{RegionLoad, Tally, Traffic};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// Window length, pool size and phase length of a run.
#[derive(Debug, Clone)]
pub struct Profile {
    pub name: &'static str,
    pub window_secs: i64,
    /// G per window.
    pub limit: i64,
    /// Fallback allowance per region and window.
    pub fallback: i64,
}

impl Profile {
    /// `short` or `long` (anything else is `short`).
    pub fn named(name: &str) -> Profile {
        match name {
            "long" => Profile { name: "long", window_secs: 30, limit: 3000, fallback: 300 },
            _ => Profile { name: "short", window_secs: 4, limit: 1000, fallback: 100 },
        }
    }

    /// A rate that offers `share` of G per window.
    pub fn rate(&self, share: f64) -> f64 {
        self.limit as f64 * share / self.window_secs as f64
    }

    /// `n` windows.
    pub fn windows(&self, n: f64) -> Duration {
        Duration::from_secs_f64(self.window_secs as f64 * n)
    }
}

/// The quota every scenario uses.
pub const TENANT: &str = "chaos";
pub const RESOURCE: &str = "calls";

/// One scenario run in progress.
pub struct Run {
    pub name: &'static str,
    pub p: Profile,
    pub stack: Stack,
    pub strict: bool,
    pub traffic: Option<Traffic>,
    pub notes: Vec<String>,
    pub failed: Vec<String>,
    /// Database of the stack, for checks on the ledger and the pools.
    pub db: sqlx::PgPool,
    pub started_at: chrono::DateTime<chrono::Utc>,
    /// Windows (first and last start, RFC 3339) in which the allocator may
    /// count up to this many admits fewer than the clients: their records
    /// were in a Redis that lost its data before the outbox sent them.
    pub lost_allowance: Option<(String, String, i64)>,
    /// The same per window (start, RFC 3339), where the loss is known
    /// exactly (reports a PostgreSQL failover lost).
    pub lost_by_window: BTreeMap<String, i64>,
    /// Tokens the bound of a window grows by beyond the policy's (start,
    /// RFC 3339): `lost grants × chunk_max` of an asynchronous PostgreSQL
    /// failover (DESIGN I6).
    pub bound_extra: BTreeMap<String, i64>,
    /// Figures of the scenario's own (see [`Run::figure`]).
    pub figures: BTreeMap<String, f64>,
    started: Instant,
}

impl Run {
    /// Starts a stack (`eu` with two agents, `us` with one unless `spec`
    /// says otherwise) and puts the policy.
    pub async fn start(
        name: &'static str,
        p: &Profile,
        bins: Bins,
        spec: Option<StackSpec>,
        strict: bool,
    ) -> Result<Run, String> {
        let spec = spec.unwrap_or(StackSpec {
            regions: vec![("eu".into(), 2), ("us".into(), 1)],
            allocators: 1,
            agent_env: Vec::new(),
            sentinel_regions: Vec::new(),
            patroni: None,
        });
        let stack = Stack::start(bins, &spec, &|m| eprintln!("chaos:   {m}")).await?;
        let policy = serde_json::json!({
            "limit": p.limit, "window_secs": p.window_secs,
            "fallback_per_region": if strict { 0 } else { p.fallback },
            "fail_mode": if strict { "strict" } else { "bounded" },
        });
        crate::pools::put_policy(&stack.admin, TENANT, RESOURCE, &policy).await?;
        let db = crate::pg_conn::connect(&stack.database_url(), 2, "connect to the stack's database").await?;
        Ok(Run {
            name,
            p: p.clone(),
            stack,
            strict,
            traffic: None,
            notes: Vec::new(),
            failed: Vec::new(),
            db,
            started_at: chrono::Utc::now(),
            lost_allowance: None,
            lost_by_window: BTreeMap::new(),
            bound_extra: BTreeMap::new(),
            figures: BTreeMap::new(),
            started: Instant::now(),
        })
    }

    /// Starts traffic: `(region, share of G per window)`.
    pub fn traffic(&mut self, shares: &[(&str, f64)]) {
        let loads: Vec<RegionLoad> = self
            .stack
            .agent_urls()
            .into_iter()
            .filter_map(|(region, agents)| {
                let share = shares.iter().find(|(r, _)| *r == region)?.1;
                Some(RegionLoad { region, agents, rate_per_sec: self.p.rate(share) })
            })
            .collect();
        self.traffic = Some(Traffic::start(TENANT, RESOURCE, &loads));
    }

    /// Changes a region's offered share of G.
    pub fn set_share(&self, region: &str, share: f64) {
        if let Some(t) = &self.traffic {
            t.set_rate(region, self.p.rate(share));
        }
    }

    /// Lets `n` windows of traffic pass.
    pub async fn pass(&self, n: f64) {
        tokio::time::sleep(self.p.windows(n)).await;
    }

    /// Answers of `region`'s clients sent at or after `since_ms` (Unix ms).
    pub fn answers(&self, region: &str, since_ms: i64) -> Vec<crate::traffic::Answer> {
        self.traffic.as_ref().map(|t| t.answers(region, since_ms)).unwrap_or_default()
    }

    /// The row key (start, RFC 3339) of the window holding Unix second `t`.
    pub fn window_key(&self, t: i64) -> String {
        let ws = t.div_euclid(self.p.window_secs) * self.p.window_secs;
        chrono::DateTime::from_timestamp(ws, 0)
            .unwrap_or_default()
            .to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
    }

    /// Waits until `phase` (0..1) of a window has passed, so a fault lands
    /// at a known point of the window (e.g. before the pool runs dry).
    pub async fn at_phase(&self, phase: f64) {
        let w = self.p.window_secs * 1000;
        let into = chrono::Utc::now().timestamp_millis().rem_euclid(w);
        let wait = ((phase * w as f64) as i64 - into).rem_euclid(w);
        tokio::time::sleep(Duration::from_millis(wait as u64)).await;
    }

    /// The clients' counts so far.
    pub fn tally(&self) -> Tally {
        self.traffic.as_ref().map(|t| t.tally()).unwrap_or_default()
    }

    /// Records a check: a failure fails the scenario; both are noted.
    pub fn check(&mut self, ok: bool, what: impl Into<String>) {
        let what = what.into();
        if ok {
            self.notes.push(format!("ok: {what}"));
        } else {
            self.failed.push(what);
        }
    }

    /// A named figure the scenario measured (seconds, counts, ratios): in
    /// its report's `figures`, which `cargo lab gameday` judges.
    /// A value that is not finite (a ratio over 0) is left out, with a
    /// note: JSON has no NaN, and the report must read back.
    pub fn figure(&mut self, name: &str, value: f64) {
        if value.is_finite() {
            self.figures.insert(name.to_string(), value);
        } else {
            self.notes.push(format!("{name}: not measurable ({value})"));
        }
    }

    /// A note on what the scenario did.
    pub fn note(&mut self, what: impl Into<String>) {
        self.notes.push(what.into());
    }

    /// Allows the allocator to count up to `n` admits fewer than the clients
    /// in the windows from the one holding `from` to the one holding `to`
    /// (Unix s): a documented data loss happened between them.
    pub fn allow_loss_between(&mut self, from: i64, to: i64, n: i64) {
        let w = self.p.window_secs;
        let fmt = |t: i64| {
            chrono::DateTime::from_timestamp(t.div_euclid(w) * w, 0)
                .unwrap_or_default()
                .to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
        };
        self.lost_allowance = Some((fmt(from), fmt(to), n));
    }

    /// The bound the policy documents for a window (I6).
    pub fn bound(&self) -> i64 {
        if self.strict {
            self.p.limit
        } else {
            self.p.limit + self.p.fallback * self.stack.regions.len() as i64
        }
    }

    /// Ledger events of the quota since the run started, by `kind` or
    /// `kind/reason`.
    pub async fn ledger_count(&self, kind: &str) -> Result<i64, String> {
        let rows = sqlx::query_file!("src/sql/ledger_kinds.sql", TENANT, RESOURCE, self.started_at)
            .fetch_all(&self.db)
            .await
            .map_err(|e| format!("ledger query: {e}"))?;
        Ok(rows
            .iter()
            .filter(|r| r.kind == kind || format!("{}/{}", r.kind, r.reason) == kind)
            .map(|r| r.n)
            .sum())
    }

    /// [`Run::finish_with`] without checks of the scenario's own.
    pub async fn finish(self) -> Result<ScenarioReport, String> {
        self.finish_with(|_, _| Vec::new()).await
    }

    /// Stops traffic, heals every link, waits for the outboxes to drain,
    /// makes the common checks, the I1 check and `extra` (on the rows and
    /// the raw tally), and stops the stack.
    pub async fn finish_with(
        mut self,
        extra: impl FnOnce(&[report::WindowRow], &Tally) -> Vec<(bool, String)>,
    ) -> Result<ScenarioReport, String> {
        let tally = match self.traffic.take() {
            Some(t) => t.stop().await,
            None => Tally::new(),
        };
        if let Some(l) = &self.stack.pg_link {
            l.set(quota_tests::proxy::Fault::Pass);
        }
        for r in &self.stack.regions {
            r.alloc_link.set(quota_tests::proxy::Fault::Pass);
            r.redis_link.set(quota_tests::proxy::Fault::Pass);
        }
        let secs = self.p.window_secs;
        let settle = Duration::from_secs(secs as u64 + 20);
        let agrees = |acc: &_| report::ledger_agrees(&tally, acc, secs);
        let acc =
            accounts::settled(&self.stack.admin, TENANT, RESOURCE, &tally, secs, settle, agrees).await?;
        let rows = report::rows(&tally, &acc, secs);
        let bound = self.bound();
        let lost = self.lost_allowance.clone();
        let lost_exact = std::mem::take(&mut self.lost_by_window);
        let lost_of = |r: &report::WindowRow| {
            let ranged = match &lost {
                Some((from, to, n)) if from.as_str() <= r.window_start.as_str() && r.window_start <= *to => {
                    *n
                }
                _ => 0,
            };
            ranged + lost_exact.get(&r.window_start).copied().unwrap_or(0)
        };
        let extra_bound = std::mem::take(&mut self.bound_extra);
        let bound_of = |r: &report::WindowRow| bound + extra_bound.get(&r.window_start).copied().unwrap_or(0);
        self.failed.extend(report::check_windows(&rows, bound_of, lost_of));
        for r in &rows {
            if r.ledger_admitted < r.admitted as i64 {
                self.notes.push(format!(
                    "window {}: the allocator counts {} fewer admits than the clients saw",
                    r.window_start,
                    r.admitted as i64 - r.ledger_admitted
                ));
            }
        }
        let bad_pools = sqlx::query_file!("src/sql/pools_oversubscribed.sql", TENANT, RESOURCE)
            .fetch_all(&self.db)
            .await
            .map_err(|e| format!("pool query: {e}"))?;
        for p in &bad_pools {
            let (ws, limit, granted, returned, leases) =
                (p.window_start, p.limit_tokens, p.granted, p.returned, p.lease_tokens);
            self.failed.push(format!(
                "pool {ws}: limit {limit}, granted {granted}, returned {returned}, leases hold {leases} (I1)"
            ));
        }
        for (ok, what) in extra(&rows, &tally) {
            self.check(ok, what);
        }
        let admitted: u64 = rows.iter().map(|r| r.admitted).sum();
        if admitted == 0 {
            self.failed.push("no request was admitted at all: the scenario exercised nothing".into());
        }
        let windows = rows.len();
        self.notes.push(format!("{windows} windows, {admitted} admitted, bound per window {bound}"));
        let worst = rows.iter().map(|r| r.admitted).max().unwrap_or(0);
        self.figure("admitted_max_per_window", worst as f64);
        self.figure("bound_per_window", bound as f64);
        // Each window against its own bound (the policy's plus a
        // documented loss's extra): the most any went over (≤ 0 holds).
        let over = rows.iter().map(|r| r.admitted as i64 - bound_of(r)).max().unwrap_or(0);
        self.figure("admitted_over_bound_max", over as f64);
        self.figure("windows", windows as f64);
        if !self.failed.is_empty() {
            let dir = report::target_dir().join("chaos").join("logs").join(self.name);
            match self.stack.save_logs(&dir) {
                Ok(()) => self.notes.push(format!("logs kept in {}", dir.display())),
                Err(e) => self.notes.push(format!("logs could not be kept: {e}")),
            }
        }
        let verdict = if self.failed.is_empty() { Verdict::Pass } else { Verdict::Fail };
        let mut notes: Vec<String> = self.failed.iter().map(|f| format!("FAILED: {f}")).collect();
        notes.append(&mut self.notes);
        let seconds = self.started.elapsed().as_secs_f64();
        self.db.close().await;
        self.stack.shutdown().await;
        let figures = std::mem::take(&mut self.figures);
        Ok(ScenarioReport {
            scenario: self.name.to_string(),
            verdict,
            windows: rows,
            notes,
            seconds,
            figures,
        })
    }
}
