//! The `allocator` binary as a real process (the in-process allocator is
//! [`crate::app`]): started on a fixed loopback port, so a restart keeps its
//! address, waited for until `/readyz` answers, stopped with a chosen
//! signal, and killed when dropped. The binary's own tests, the lab's stack
//! and the bench's rig all start their allocators through it.

use crate::http::Http;
use crate::procs::Child;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus};
use std::time::Duration;

/// Configuration the process would otherwise inherit from the environment
/// of whoever runs the tests; the harness sets what it means explicitly.
const INHERITED: [&str; 5] =
    ["DATABASE_URL", "ALLOCATOR_LISTEN", "QUOTA_AGENT_TOKEN", "QUOTA_ADMIN_TOKEN", "LOG_FORMAT"];

/// How often [`AllocatorProc::ready`] asks `/readyz`.
const READY_POLL: Duration = Duration::from_millis(50);

/// One allocator process (configured by the builder methods, then started).
pub struct AllocatorProc {
    /// `127.0.0.1:PORT`, the same for every start.
    pub addr: String,
    bin: PathBuf,
    database_url: String,
    /// Start `n` writes `<log>.<n>.log`.
    log: PathBuf,
    env: Vec<(String, String)>,
    args: Vec<String>,
    /// The client [`AllocatorProc::ready`] probes with (HTTPS with a client
    /// certificate when the allocator serves TLS).
    probe: Http,
    child: Option<Child>,
    starts: u32,
}

impl AllocatorProc {
    /// `bin` over `database_url` on a free loopback port, logging next to
    /// `log` (a path without extension); not started yet.
    pub fn new(bin: &Path, database_url: &str, log: PathBuf) -> AllocatorProc {
        let addr = format!("127.0.0.1:{}", crate::free_port());
        AllocatorProc {
            probe: Http::new(&format!("http://{addr}")),
            addr,
            bin: bin.to_path_buf(),
            database_url: database_url.to_string(),
            log,
            env: Vec::new(),
            args: Vec::new(),
            child: None,
            starts: 0,
        }
    }

    /// Extra environment for every start (e.g. the TLS files).
    pub fn envs(mut self, env: impl IntoIterator<Item = (String, String)>) -> AllocatorProc {
        self.env.extend(env);
        self
    }

    /// Logs at `warn` (or `ALLOCATOR_LOG`): per-request lines of a busy
    /// allocator would fill the disk and cost the benchmark time.
    pub fn quiet(self) -> AllocatorProc {
        let level = std::env::var("ALLOCATOR_LOG").unwrap_or_else(|_| "warn".into());
        self.envs([("RUST_LOG".to_string(), level)])
    }

    /// The client that probes readiness, made for [`AllocatorProc::addr`]
    /// (for an allocator serving HTTPS).
    pub fn probe(mut self, make: impl FnOnce(&str) -> Http) -> AllocatorProc {
        self.probe = make(&self.addr);
        self
    }

    /// Command-line flags of the next starts.
    pub fn set_args(&mut self, args: &[&str]) {
        self.args = args.iter().map(|a| a.to_string()).collect();
    }

    /// The probing client: `http://127.0.0.1:PORT` unless told otherwise.
    pub fn http(&self) -> Http {
        self.probe.clone()
    }

    /// Spawns the process (it is not ready yet; see [`AllocatorProc::ready`]).
    pub fn start(&mut self) -> Result<(), String> {
        self.starts += 1;
        let mut cmd = Command::new(&self.bin);
        for var in INHERITED {
            cmd.env_remove(var);
        }
        cmd.env("DATABASE_URL", &self.database_url)
            .args(["--listen", &self.addr])
            .args(&self.args)
            .envs(self.env.iter().map(|(k, v)| (k, v)));
        self.child = Some(
            Child::spawn("allocator", cmd, &self.log_path(), None)
                .map_err(|e| format!("spawn allocator: {e}"))?,
        );
        Ok(())
    }

    /// Waits until `/readyz` answers 200.
    pub async fn ready(&self, timeout: Duration) -> Result<(), String> {
        let http = &self.probe;
        crate::wait::poll(timeout, READY_POLL, || async move {
            (http.get_status("/readyz").await == Some(200)).then_some(()).ok_or(())
        })
        .await
        .map_err(|()| {
            format!(
                "allocator on {} not ready after {timeout:?}; see {}",
                self.addr,
                self.log_path().display()
            )
        })
    }

    /// [`AllocatorProc::start`], then [`AllocatorProc::ready`].
    pub async fn start_ready(&mut self, timeout: Duration) -> Result<(), String> {
        self.start()?;
        self.ready(timeout).await
    }

    /// Sends `sig` and waits up to `timeout` for the exit (SIGKILL after);
    /// `None` when it was not running.
    pub fn stop(&mut self, sig: i32, timeout: Duration) -> Option<ExitStatus> {
        self.child.take().and_then(|mut c| c.stop(sig, timeout))
    }

    /// Stops with `sig`, giving it 10 s to exit.
    pub fn kill(&mut self, sig: i32) {
        self.stop(sig, Duration::from_secs(10));
    }

    /// Sends `sig` without waiting (SIGSTOP / SIGCONT, a SIGTERM whose
    /// exit the caller times).
    pub fn signal(&self, sig: i32) {
        if let Some(c) = &self.child {
            c.signal(sig);
        }
    }

    /// Whether the process has exited, with its status.
    pub fn try_wait(&mut self) -> Option<ExitStatus> {
        self.child.as_mut().and_then(|c| c.try_wait())
    }

    /// The process id while it runs (for its RSS).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.pid())
    }

    /// Kills it and starts it again on the same port, waiting until ready.
    pub async fn restart(&mut self) -> Result<(), String> {
        self.kill(libc::SIGKILL);
        self.start_ready(Duration::from_secs(30)).await
    }

    /// The log file of the latest start.
    pub fn log_path(&self) -> PathBuf {
        self.log.with_extension(format!("{}.log", self.starts))
    }

    /// The log of the latest start.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }
}
