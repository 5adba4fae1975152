//! The bench's own small stack: PostgreSQL, allocator replicas and one
//! agent over one Redis, wired directly with no fault proxy in between.
//! The proxies of [`crate::stack`] cost a copy per byte on every link; a
//! ceiling (pgbench, a bare EVALSHA loop) talks to the servers directly, so
//! the system measured against it must too, or the ratio would charge the
//! harness to the product.

use crate::bins::Bins;
use quota_tests::agent::{AgentOpts, AgentProc};
use quota_tests::allocator_proc::AllocatorProc;
use quota_tests::http::Http;
use quota_tests::pg::TestDb;
use quota_tests::redis::TestRedis;
use std::time::Duration;

/// PostgreSQL plus allocator replicas; agents are added by [`Rig::agent`].
pub struct Rig {
    pub bins: Bins,
    pub db: TestDb,
    pub allocators: Vec<AllocatorProc>,
    pub admin: Http,
    dir: tempfile::TempDir,
}

impl Rig {
    /// Starts PostgreSQL and `replicas` allocators, each ready.
    pub async fn start(bins: Bins, replicas: usize) -> Result<Rig, String> {
        let dir = tempfile::Builder::new().prefix("quota-bench-").tempdir().map_err(|e| e.to_string())?;
        let db = TestDb::start().await;
        let mut rig = Rig { admin: Http::new("http://127.0.0.1:1"), bins, db, allocators: Vec::new(), dir };
        for _ in 0..replicas.max(1) {
            rig.add_allocator().await?;
        }
        rig.admin = rig.allocators[0].http();
        Ok(rig)
    }

    /// Starts one more allocator replica on the same database.
    pub async fn add_allocator(&mut self) -> Result<(), String> {
        let i = self.allocators.len();
        let log = self.dir.path().join(format!("allocator-{i}"));
        let mut a = AllocatorProc::new(&self.bins.allocator, &self.db.url, log).quiet();
        a.start_ready(Duration::from_secs(60)).await?;
        self.allocators.push(a);
        Ok(())
    }

    /// Stops allocator replicas beyond the first `keep`.
    pub fn truncate_allocators(&mut self, keep: usize) {
        self.allocators.truncate(keep.max(1));
    }

    /// One agent (region `eu`, id `eu-1`) on `redis`, talking to the first allocator.
    pub async fn agent(&self, redis: &TestRedis) -> AgentProc {
        self.agent_as("eu", &redis.url, Vec::new()).await
    }

    /// One agent of `region` (id `<region>-1`) on the Redis at `redis_url`
    /// with extra environment, talking to the first allocator.
    pub async fn agent_as(&self, region: &str, redis_url: &str, env: Vec<(String, String)>) -> AgentProc {
        let mut opts =
            AgentOpts::new(region, &format!("{region}-1"), &self.allocators[0].http().base, redis_url);
        // Per-request log lines would be charged to the agent's latency.
        opts.env.push(("RUST_LOG".into(), "warn".into()));
        opts.env.extend(env);
        AgentProc::spawn(&self.bins.agent, opts).await
    }
}
