//! Regional agents for tests: the `regional-agent` binary started as a real
//! process on a free port (killed when dropped). The network between an
//! agent and its allocator is a [`crate::proxy::FaultProxy`].

use crate::http::Http;
use crate::procs::Child;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// How to start an agent.
#[derive(Debug, Clone)]
pub struct AgentOpts {
    pub region: String,
    pub agent: String,
    pub allocator: String,
    pub redis: String,
    /// Extra environment variables (e.g. `AGENT_ALLOCATOR_TIMEOUT_MS`).
    pub env: Vec<(String, String)>,
    /// Address the agent listens on (loopback unless it runs in a network
    /// namespace of its own).
    pub host: String,
}

impl AgentOpts {
    /// Options with short timeouts suited to tests.
    pub fn new(region: &str, agent: &str, allocator: &str, redis: &str) -> AgentOpts {
        AgentOpts {
            region: region.into(),
            agent: agent.into(),
            allocator: allocator.into(),
            redis: redis.into(),
            env: vec![("AGENT_ALLOCATOR_TIMEOUT_MS".into(), "400".into())],
            host: "127.0.0.1".into(),
        }
    }
}

/// A running agent process.
pub struct AgentProc {
    /// `http://HOST:PORT`.
    pub base: String,
    /// A client for it.
    pub http: Http,
    pub opts: AgentOpts,
    port: u16,
    bin: PathBuf,
    dir: tempfile::TempDir,
    child: Option<Child>,
    starts: u32,
}

impl AgentProc {
    /// Starts `bin` with `opts` and waits until it has registered.
    pub async fn spawn(bin: &Path, opts: AgentOpts) -> AgentProc {
        let mut a = AgentProc::new(bin, opts);
        a.start().await;
        a
    }

    /// An agent of `bin` with `opts` on a free port, not started yet.
    fn new(bin: &Path, opts: AgentOpts) -> AgentProc {
        let port = crate::free_port();
        let base = format!("http://{}:{port}", opts.host);
        AgentProc {
            http: Http::new(&base),
            base,
            opts,
            port,
            bin: bin.to_path_buf(),
            dir: tempfile::tempdir().expect("temp dir"),
            child: None,
            starts: 0,
        }
    }

    fn start_process(&mut self) {
        let mut cmd = Command::new(&self.bin);
        cmd.env("AGENT_REGION", &self.opts.region)
            .env("AGENT_ID", &self.opts.agent)
            .env("ALLOCATOR_URL", &self.opts.allocator)
            .env("REDIS_URL", &self.opts.redis)
            .env("AGENT_LISTEN", format!("{}:{}", self.opts.host, self.port))
            .env("RUST_LOG", std::env::var("AGENT_LOG").unwrap_or_else(|_| "info".into()));
        for (k, v) in &self.opts.env {
            cmd.env(k, v);
        }
        self.starts += 1;
        let log = self.dir.path().join(format!("agent-{}.log", self.starts));
        self.child = Some(Child::spawn("regional-agent", cmd, &log, None).expect("spawn regional-agent"));
    }

    /// Starts `bin` with `opts` and waits only until it serves `/healthz`
    /// (for agents that cannot reach their allocator, so never register).
    pub async fn spawn_unregistered(bin: &Path, opts: AgentOpts) -> AgentProc {
        let mut a = AgentProc::new(bin, opts);
        a.start_unregistered().await;
        a
    }

    /// Starts the process again and waits only until it serves `/healthz`
    /// (a restart while the allocator cannot be reached).
    pub async fn start_unregistered(&mut self) {
        self.start_process();
        let http = self.http.clone();
        crate::wait::until("agent /healthz", Duration::from_secs(20), || {
            let http = http.clone();
            async move { (http.get_status("/healthz").await == Some(200)).then_some(()) }
        })
        .await;
    }

    /// Starts the process (again) and waits until `/v1/status` shows an epoch.
    pub async fn start(&mut self) -> i64 {
        self.start_process();
        let url = format!("{}/v1/status", self.base);
        let client =
            crate::http::client_builder().timeout(Duration::from_millis(500)).build().expect("client");
        crate::wait::until("agent registered", Duration::from_secs(20), || {
            let (client, url) = (client.clone(), url.clone());
            async move {
                let body: serde_json::Value = client.get(&url).send().await.ok()?.json().await.ok()?;
                body["epoch"].as_i64().filter(|e| *e > 0)
            }
        })
        .await
    }

    /// The current epoch from `/v1/status`.
    pub async fn epoch(&self) -> i64 {
        self.http.get("/v1/status").await.body["epoch"].as_i64().unwrap_or(0)
    }

    /// Sends `sig` and waits for the exit (SIGKILL after 10 s).
    pub fn stop(&mut self, sig: i32) -> Option<std::process::ExitStatus> {
        self.child.take().and_then(|mut c| c.stop(sig, Duration::from_secs(10)))
    }

    /// The process id of the running agent (for its RSS), if it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.pid())
    }

    /// Sends `sig` without waiting (SIGSTOP / SIGCONT of a paused agent).
    pub fn signal(&self, sig: i32) {
        if let Some(c) = &self.child {
            c.signal(sig);
        }
    }

    /// The log of the latest start.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join(format!("agent-{}.log", self.starts)))
            .unwrap_or_default()
    }
}
