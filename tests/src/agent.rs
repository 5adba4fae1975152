//! Regional agents for tests: the `regional-agent` binary started as a real
//! process on a free port (killed when dropped), and a switchable TCP proxy
//! that stands for the network between an agent and the allocator: it
//! forwards, or it accepts connections and never answers (a partition that
//! looks like timeouts, not refusals).

use crate::http::Http;
use crate::procs::Child;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

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
        let port = crate::free_port();
        let base = format!("http://{}:{port}", opts.host);
        let mut a = AgentProc {
            http: Http::new(&base),
            base,
            opts,
            port,
            bin: bin.to_path_buf(),
            dir: tempfile::tempdir().expect("temp dir"),
            child: None,
            starts: 0,
        };
        a.start().await;
        a
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
        let port = crate::free_port();
        let base = format!("http://{}:{port}", opts.host);
        let mut a = AgentProc {
            http: Http::new(&base),
            base,
            opts,
            port,
            bin: bin.to_path_buf(),
            dir: tempfile::tempdir().expect("temp dir"),
            child: None,
            starts: 0,
        };
        a.start_process();
        let http = a.http.clone();
        crate::wait::until("agent /healthz", Duration::from_secs(20), || {
            let http = http.clone();
            async move { (http.get_status("/healthz").await == Some(200)).then_some(()) }
        })
        .await;
        a
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

fn host_port(url: &str) -> String {
    url.trim_start_matches("http://").trim_end_matches('/').to_string()
}

/// A TCP proxy to `upstream` that can be switched to a black hole.
pub struct Switch {
    /// `http://127.0.0.1:PORT`, to give to an agent as its allocator.
    pub url: String,
    up: Arc<AtomicBool>,
    target: Arc<std::sync::Mutex<String>>,
    gen: watch::Sender<u64>,
    task: tokio::task::JoinHandle<()>,
}

impl Switch {
    /// A proxy forwarding to `upstream` (`http://host:port`).
    pub async fn start(upstream: &str) -> Switch {
        let target = Arc::new(std::sync::Mutex::new(host_port(upstream)));
        let target2 = target.clone();
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let url = format!("http://{}", listener.local_addr().expect("addr"));
        let up = Arc::new(AtomicBool::new(true));
        let (gen, _) = watch::channel(0u64);
        let up2 = up.clone();
        let gen2 = gen.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((mut inbound, _)) = listener.accept().await else { continue };
                let mut rx = gen2.subscribe();
                let target = target2.lock().unwrap().clone();
                let forward = up2.load(Ordering::SeqCst);
                tokio::spawn(async move {
                    if !forward {
                        // Hold the connection open and never answer.
                        let _ = rx.changed().await;
                        drop(inbound);
                        return;
                    }
                    let Ok(mut out) = TcpStream::connect(&target).await else { return };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut inbound, &mut out) => {},
                        _ = rx.changed() => {},
                    }
                });
            }
        });
        Switch { url, up, target, gen, task }
    }

    /// Forwards new connections to `upstream` from now on (open ones are
    /// dropped): a service replaced behind a stable address.
    pub fn set_upstream(&self, upstream: &str) {
        *self.target.lock().unwrap() = host_port(upstream);
        self.gen.send_modify(|g| *g += 1);
    }

    /// Cuts the network: open connections stall, new ones are never answered.
    pub fn partition(&self) {
        self.up.store(false, Ordering::SeqCst);
        self.gen.send_modify(|g| *g += 1);
    }

    /// Restores forwarding (stalled connections are dropped).
    pub fn heal(&self) {
        self.up.store(true, Ordering::SeqCst);
        self.gen.send_modify(|g| *g += 1);
    }
}

impl Drop for Switch {
    fn drop(&mut self) {
        self.task.abort();
    }
}
