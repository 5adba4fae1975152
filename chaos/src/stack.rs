//! The local stack every lab command runs: an ephemeral PostgreSQL,
//! allocator replicas (real processes), and per region an ephemeral Redis and
//! agent replicas (real processes), with a [`FaultProxy`] on every link.
//!
//! ```text
//!  clients ─▶ agent ─┬─ alloc link (LB over replicas) ─▶ allocator ─ pg link ─▶ PostgreSQL
//!                    └─ redis link ─▶ Redis (one per region)
//! ```
//!
//! With [`StackSpec::patroni`] the database is a Patroni cluster (etcd,
//! two PostgreSQL nodes, HAProxy checking Patroni's `/primary`) generated
//! from `deploy/patroni/`, and the allocators reach it through HAProxy
//! only (no fault proxy on that link):
//!
//! ```text
//!  allocator ─▶ HAProxy ─┬─▶ node1 (Patroni) ─┐
//!                        └─▶ node2 (Patroni) ─┴─ etcd
//! ```
//!
//! A region named in [`StackSpec::sentinel_regions`] gets a Redis Sentinel
//! group (primary, replica, Sentinel) of its own instead, and its agents find
//! the primary through the Sentinel (no fault proxy on that link: the
//! Sentinel hands out the servers' real addresses).
//!
//! With [`Stack::start_tls`] every agent link runs over TLS with a
//! throwaway CA ([`crate::tls`]): agent → allocator over HTTPS with client
//! certificates (mTLS, the allocator requires them), agent → Redis over
//! `rediss://` (Redis requires client certificates too). The fault proxies
//! forward TCP, so they carry the TLS bytes unchanged. Sentinel regions
//! stay plain.
//!
//! With `rls` ([`Stack::start_with`]) every agent also serves Envoy's rate
//! limit service (`--grpc-listen`) on a free loopback port ([`rls_addr`]),
//! for the Envoys of `cargo lab demo --envoy`.
//!
//! Everything started here stops when the [`Stack`] is dropped: processes
//! are killed, data directories removed.

use crate::bins::Bins;
use crate::tls::LabTls;
use quota_tests::agent::{AgentOpts, AgentProc};
use quota_tests::allocator_proc::AllocatorProc;
use quota_tests::http::Http;
use quota_tests::patroni::PatroniCluster;
use quota_tests::pg::TestDb;
use quota_tests::proxy::FaultProxy;
use quota_tests::redis::TestRedis;
use quota_tests::sentinel::{TestSentinel, MASTER_NAME};
use std::time::Duration;

/// What to start.
#[derive(Debug, Clone)]
pub struct StackSpec {
    /// Region names with their number of agent replicas.
    pub regions: Vec<(String, usize)>,
    /// Allocator replicas behind one load balancer.
    pub allocators: usize,
    /// Extra environment for every agent (flags by their env names).
    pub agent_env: Vec<(String, String)>,
    /// Regions whose agents reach Redis through a Sentinel group.
    pub sentinel_regions: Vec<String>,
    /// `Some(synchronous)`: the database is a Patroni cluster behind
    /// HAProxy ([`PatroniCluster`], `synchronous_mode` as given) and the
    /// allocators connect through HAProxy only; `None`: one PostgreSQL
    /// behind the `pg_link` fault proxy.
    pub patroni: Option<bool>,
}

impl StackSpec {
    /// Regions `eu` and `us` with one agent each, one allocator.
    pub fn two_regions() -> StackSpec {
        StackSpec {
            regions: vec![("eu".into(), 1), ("us".into(), 1)],
            allocators: 1,
            agent_env: Vec::new(),
            sentinel_regions: Vec::new(),
            patroni: None,
        }
    }
}

/// One region: its Redis and agents, and the links they use.
pub struct Region {
    pub name: String,
    pub redis: TestRedis,
    /// Agents → this region's Redis.
    pub redis_link: FaultProxy,
    /// Agents → the allocator replicas.
    pub alloc_link: FaultProxy,
    pub agents: Vec<AgentProc>,
    /// The region's Sentinel group when its agents use one (then `redis`
    /// and `redis_link` carry none of their traffic).
    pub sentinel: Option<TestSentinel>,
}

/// The running stack.
pub struct Stack {
    pub bins: Bins,
    /// The one PostgreSQL (`None` with a Patroni cluster).
    pub db: Option<TestDb>,
    /// The highly available database, when the spec asks for it.
    pub patroni: Option<PatroniCluster>,
    /// Allocators → PostgreSQL (`None` with a Patroni cluster: HAProxy is
    /// the allocators' only way in).
    pub pg_link: Option<FaultProxy>,
    pub allocators: Vec<AllocatorProc>,
    /// Operator reads and policy writes go here (never faulted).
    pub api_link: FaultProxy,
    pub admin: Http,
    pub regions: Vec<Region>,
    /// The throwaway PKI when every link runs over TLS.
    pub tls: Option<LabTls>,
    dir: tempfile::TempDir,
}

impl Stack {
    /// Starts everything in `spec`; `progress` is told about each step.
    pub async fn start(bins: Bins, spec: &StackSpec, progress: &dyn Fn(&str)) -> Result<Stack, String> {
        Self::start_with(bins, spec, None, false, progress).await
    }

    /// Starts everything in `spec` with every agent link over TLS (see the
    /// module doc) with the certificates of `tls`.
    pub async fn start_tls(
        bins: Bins,
        spec: &StackSpec,
        tls: LabTls,
        progress: &dyn Fn(&str),
    ) -> Result<Stack, String> {
        Self::start_with(bins, spec, Some(tls), false, progress).await
    }

    /// Starts everything in `spec`, every agent link over TLS when `tls`
    /// is given, and with `rls` every agent also serving Envoy's rate limit
    /// service on a free loopback port of its own ([`rls_addr`]).
    pub async fn start_with(
        bins: Bins,
        spec: &StackSpec,
        tls: Option<LabTls>,
        rls: bool,
        progress: &dyn Fn(&str),
    ) -> Result<Stack, String> {
        let scheme = if tls.is_some() { "https" } else { "http" };
        // An HTTP client for `addr` on the allocator side: with TLS, the
        // operator's certificate (the allocator requires one).
        let http_for = |addr: &str| match &tls {
            Some(t) => t.operator(&format!("https://{addr}")),
            None => Http::new(&format!("http://{addr}")),
        };
        let dir = tempfile::Builder::new().prefix("quota-lab-").tempdir().map_err(|e| e.to_string())?;
        let (db, patroni, pg_link, database_url) = match spec.patroni {
            Some(synchronous) => {
                progress(&format!(
                    "starting etcd, two PostgreSQL nodes under Patroni (synchronous_mode: {synchronous}) and HAProxy"
                ));
                let cluster = PatroniCluster::start(synchronous).await?;
                let url = cluster.url.clone();
                (None, Some(cluster), None, url)
            }
            None => {
                progress("starting PostgreSQL");
                let db = TestDb::start().await;
                let pg_addr = pg_link_target(&db.url);
                let pg_link = FaultProxy::start(vec![pg_addr.clone()]).await.map_err(|e| e.to_string())?;
                let database_url = db.url.replacen(&pg_addr, &pg_link.addr, 1);
                (Some(db), None, Some(pg_link), database_url)
            }
        };
        let mut allocators = Vec::new();
        for i in 0..spec.allocators.max(1) {
            let log = dir.path().join(format!("allocator-{i}"));
            let mut a = AllocatorProc::new(&bins.allocator, &database_url, log)
                .quiet()
                .envs(tls.as_ref().map(LabTls::allocator_env).unwrap_or_default())
                .probe(http_for);
            progress(&format!("starting allocator {} on {}", i + 1, a.addr));
            a.start_ready(Duration::from_secs(60)).await?;
            allocators.push(a);
        }
        let upstreams: Vec<String> = allocators.iter().map(|a| a.addr.clone()).collect();
        let api_link = FaultProxy::start(upstreams.clone()).await.map_err(|e| e.to_string())?;
        let admin = http_for(&api_link.addr);
        let mut regions = Vec::new();
        for (name, replicas) in &spec.regions {
            progress(&format!("starting Redis and {replicas} agent(s) of region {name}"));
            let redis = match &tls {
                // Client certificates required, as the agents present theirs.
                Some(t) => TestRedis::start_tls(&t.server, true, &[]),
                None => TestRedis::start(),
            };
            let redis_addr = match &tls {
                Some(_) => redis.tls_url().trim_start_matches("rediss://").to_string(),
                None => redis.url.trim_start_matches("redis://").to_string(),
            };
            let redis_link = FaultProxy::start(vec![redis_addr]).await.map_err(|e| e.to_string())?;
            let alloc_link = FaultProxy::start(upstreams.clone()).await.map_err(|e| e.to_string())?;
            let sentinel = if spec.sentinel_regions.contains(name) {
                progress(&format!("starting a Redis Sentinel group for region {name}"));
                // Started on this thread like `TestRedis::start`, not in
                // `spawn_blocking`: the servers die with the thread that
                // forked them (PR_SET_PDEATHSIG), and a blocking-pool thread
                // exits after a few idle seconds. It blocks the runtime for
                // the group's first sync (a few seconds) before any traffic.
                Some(TestSentinel::start())
            } else {
                None
            };
            let mut agents = Vec::new();
            for r in 0..*replicas {
                let redis_scheme = if tls.is_some() { "rediss" } else { "redis" };
                let redis_url = if sentinel.is_some() {
                    String::new()
                } else {
                    format!("{redis_scheme}://{}", redis_link.addr)
                };
                let alloc_url = format!("{scheme}://{}", alloc_link.addr);
                let mut opts = AgentOpts::new(name, &format!("{name}-{}", r + 1), &alloc_url, &redis_url);
                if let Some(t) = &tls {
                    let mut env = t.agent_env(name);
                    if sentinel.is_some() {
                        // Sentinel groups stay plain: only the allocator link's files.
                        env.retain(|(k, _)| k.starts_with("AGENT_ALLOCATOR_"));
                    }
                    opts.env.extend(env);
                }
                if let Some(g) = &sentinel {
                    opts.env.push(("AGENT_REDIS_SENTINEL".into(), g.sentinel_addr.clone()));
                    opts.env.push(("AGENT_REDIS_MASTER".into(), MASTER_NAME.into()));
                }
                opts.env.push(("AGENT_REDIS_PREFIX".into(), redis.prefix.clone()));
                opts.env.extend(spec.agent_env.iter().cloned());
                if rls {
                    let addr = format!("127.0.0.1:{}", quota_tests::free_port());
                    opts.env.push((RLS_LISTEN_ENV.into(), addr));
                }
                agents.push(AgentProc::spawn(&bins.agent, opts).await);
            }
            regions.push(Region { name: name.clone(), redis, redis_link, alloc_link, agents, sentinel });
        }
        Ok(Stack { bins, db, patroni, pg_link, allocators, api_link, admin, regions, tls, dir })
    }

    /// URL of the stack's database for the lab's own checks: the one
    /// PostgreSQL directly, or a Patroni cluster through HAProxy (so it
    /// follows the primary).
    pub fn database_url(&self) -> String {
        match (&self.db, &self.patroni) {
            (Some(db), _) => db.url.clone(),
            (None, Some(c)) => c.url.clone(),
            (None, None) => unreachable!("a stack has one database or the other"),
        }
    }

    /// The one PostgreSQL, for scenarios that kill or restart it.
    pub fn local_db(&mut self) -> Result<&mut TestDb, String> {
        self.db.as_mut().ok_or_else(|| "the stack's database is a Patroni cluster".to_string())
    }

    /// The region named `name`.
    pub fn region(&self, name: &str) -> &Region {
        self.regions.iter().find(|r| r.name == name).expect("known region")
    }

    /// The region named `name`, mutably.
    pub fn region_mut(&mut self, name: &str) -> &mut Region {
        self.regions.iter_mut().find(|r| r.name == name).expect("known region")
    }

    /// Every agent's base URL by region.
    pub fn agent_urls(&self) -> Vec<(String, Vec<String>)> {
        self.regions
            .iter()
            .map(|r| (r.name.clone(), r.agents.iter().map(|a| a.base.clone()).collect()))
            .collect()
    }

    /// Where logs of this stack are written.
    pub fn log_dir(&self) -> &std::path::Path {
        self.dir.path()
    }

    /// Stops agents first (SIGTERM: they drain their outboxes), then the
    /// allocators; servers and directories go when the stack is dropped.
    pub async fn shutdown(mut self) {
        for r in &mut self.regions {
            for a in &mut r.agents {
                a.stop(libc::SIGTERM);
            }
        }
        for a in &mut self.allocators {
            a.kill(libc::SIGTERM);
        }
    }
}

/// The agent's flag of Envoy's rate limit service (`--grpc-listen`).
const RLS_LISTEN_ENV: &str = "AGENT_GRPC_LISTEN";

/// Where `agent` serves Envoy's rate limit service, when it was started
/// with it ([`Stack::start_with`]).
pub fn rls_addr(agent: &AgentProc) -> Option<&str> {
    agent.opts.env.iter().rev().find(|(k, _)| k == RLS_LISTEN_ENV).map(|(_, v)| v.as_str())
}

/// `host:port` of a `postgres://user@host:port/db` URL.
fn pg_link_target(url: &str) -> String {
    url.split('@').nth(1).and_then(|r| r.split('/').next()).unwrap_or_default().to_string()
}

impl Stack {
    /// Copies every process's log into `dir` (kept after the stack is gone).
    pub fn save_logs(&self, dir: &std::path::Path) -> Result<(), String> {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let entries = std::fs::read_dir(self.dir.path()).map_err(|e| e.to_string())?;
        for e in entries.flatten() {
            let _ = std::fs::copy(e.path(), dir.join(e.file_name()));
        }
        for r in &self.regions {
            for a in &r.agents {
                let _ = std::fs::write(dir.join(format!("agent-{}.log", a.opts.agent)), a.log());
            }
            if let Some(g) = &r.sentinel {
                let _ = std::fs::write(dir.join(format!("sentinel-{}.log", r.name)), g.logs());
            }
        }
        if let Some(c) = &self.patroni {
            c.save_logs(dir);
        }
        Ok(())
    }
}
