//! An ephemeral Redis for one test: `REDIS_URL` with a key prefix of the
//! test's own, or a local `redis-server` (no persistence, free loopback
//! port), or a `redis` container when a Docker engine answers.

use crate::procs::{self, Child, Container};
use crate::wait;
use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

/// One test's Redis.
pub struct TestRedis {
    /// `redis://127.0.0.1:PORT`.
    pub url: String,
    /// A prefix unique to the test, for tests sharing a server.
    pub prefix: String,
    port: u16,
    child: Option<Child>,
    dir: Option<tempfile::TempDir>,
    _container: Option<Container>,
    /// Extra `redis-server` arguments, kept for a restart.
    args: Vec<String>,
    /// The TLS port of a server started with [`TestRedis::start_tls`].
    tls_port: Option<u16>,
}

fn ping(port: u16) -> bool {
    let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) else { return false };
    let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
    let mut buf = [0u8; 7];
    s.write_all(b"PING\r\n").is_ok() && s.read_exact(&mut buf).is_ok() && &buf == b"+PONG\r\n"
}

/// Waits until the server on `port` answers PING; panics with its log if
/// `child` exits first or after 20 s.
pub(crate) fn wait_ping(port: u16, mut child: Option<&mut Child>, dir: &std::path::Path) {
    let what = format!("redis-server on port {port} to answer PING");
    wait::until_blocking(&what, Duration::from_secs(20), Duration::from_millis(10), || {
        if ping(port) {
            return Some(());
        }
        if let Some(s) = child.as_mut().and_then(|c| c.try_wait()) {
            panic!(
                "redis-server exited: {s}: {}",
                std::fs::read_to_string(dir.join("redis.log")).unwrap_or_default()
            );
        }
        None
    });
}

impl TestRedis {
    /// Starts (or names) a Redis for one test; panics with the reason when
    /// none can be had.
    pub fn start() -> TestRedis {
        let prefix = format!("t{}", uuid::Uuid::new_v4().simple());
        if let Ok(url) = std::env::var("REDIS_URL") {
            return TestRedis {
                url,
                prefix,
                port: 0,
                child: None,
                dir: None,
                _container: None,
                args: Vec::new(),
                tls_port: None,
            };
        }
        if let Some(bin) = procs::find_binary("redis-server", &[]) {
            let dir = tempfile::tempdir().expect("temp dir");
            let mut r = TestRedis {
                url: String::new(),
                prefix,
                port: crate::free_port(),
                child: None,
                dir: Some(dir),
                _container: None,
                args: Vec::new(),
                tls_port: None,
            };
            r.spawn(&bin);
            return r;
        }
        if procs::docker_available() {
            let (c, port) = Container::run("redis:7-alpine", 6379, &[]).expect("redis container");
            wait::until_blocking(
                "the redis container",
                Duration::from_secs(30),
                Duration::from_millis(25),
                || ping(port).then_some(()),
            );
            return TestRedis {
                url: format!("redis://127.0.0.1:{port}"),
                prefix,
                port,
                child: None,
                dir: None,
                _container: Some(c),
                args: Vec::new(),
                tls_port: None,
            };
        }
        panic!("no REDIS_URL, no redis-server binary (apt-get install redis-server) and no Docker engine");
    }

    /// Starts a local `redis-server` of the test's own with extra
    /// arguments (e.g. `--maxmemory-policy allkeys-lru`), even when
    /// `REDIS_URL` names a shared server: the test changes the server's
    /// configuration.
    pub fn start_local(args: &[&str]) -> TestRedis {
        let bin = procs::find_binary("redis-server", &[])
            .expect("no redis-server binary (apt-get install redis-server)");
        let mut r = TestRedis {
            url: String::new(),
            prefix: format!("t{}", uuid::Uuid::new_v4().simple()),
            port: crate::free_port(),
            child: None,
            dir: Some(tempfile::tempdir().expect("temp dir")),
            _container: None,
            args: args.iter().map(|a| a.to_string()).collect(),
            tls_port: None,
        };
        r.spawn(&bin);
        r
    }

    fn spawn(&mut self, bin: &PathBuf) {
        let dir = self.dir.as_ref().expect("local redis has a dir").path().to_path_buf();
        let mut cmd = Command::new(bin);
        cmd.args([
            "--port",
            &self.port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .arg("--dir")
        .arg(&dir)
        .args(&self.args);
        self.child = Some(
            Child::spawn("redis-server", cmd, &dir.join("redis.log"), None).expect("spawn redis-server"),
        );
        wait_ping(self.port, self.child.as_mut(), &dir);
        self.url = format!("redis://127.0.0.1:{}", self.port);
    }

    /// Starts a local `redis-server` that also serves TLS (`--tls-port`)
    /// with `files`, requiring client certificates when `auth_clients`.
    /// The plain port stays open on loopback for the harness's own checks
    /// (PING, `redis-cli`); the agent is given [`TestRedis::tls_url`].
    pub fn start_tls(files: &crate::tls::ServerFiles, auth_clients: bool, extra: &[&str]) -> TestRedis {
        let bin = procs::find_binary("redis-server", &[])
            .expect("no redis-server binary (apt-get install redis-server)");
        let port = crate::free_port();
        let mut tls_port = crate::free_port();
        while tls_port == port {
            tls_port = crate::free_port();
        }
        let mut args = files.redis_args(tls_port, auth_clients);
        args.extend(extra.iter().map(|a| a.to_string()));
        let mut r = TestRedis {
            url: String::new(),
            prefix: format!("t{}", uuid::Uuid::new_v4().simple()),
            port,
            child: None,
            dir: Some(tempfile::tempdir().expect("temp dir")),
            _container: None,
            args,
            tls_port: Some(tls_port),
        };
        r.spawn(&bin);
        r
    }

    /// `rediss://127.0.0.1:TLS_PORT` of a server started with [`TestRedis::start_tls`].
    pub fn tls_url(&self) -> String {
        format!("rediss://127.0.0.1:{}", self.tls_port.expect("a TLS redis-server"))
    }

    /// Kills the local server and starts an empty one on the same port
    /// (Redis state loss).
    pub fn restart_empty(&mut self) {
        if let Some(mut c) = self.child.take() {
            c.stop(libc::SIGKILL, Duration::from_secs(5));
        }
        if let Some(dir) = &self.dir {
            let _ = std::fs::remove_file(dir.path().join("dump.rdb"));
        }
        let bin = procs::find_binary("redis-server", &[]).expect("redis-server");
        self.spawn(&bin);
    }

    /// Kills the local server (SIGKILL) and starts it again on the same
    /// port from the last snapshot a `SAVE` wrote into its directory: the
    /// region's Redis going back in time, as a default `redis.conf` (with
    /// `save` lines) does after a crash.
    pub fn restart_from_snapshot(&mut self) {
        let dir = self.dir.as_ref().expect("a local redis-server").path().to_path_buf();
        assert!(dir.join("dump.rdb").exists(), "no snapshot: send SAVE first");
        if let Some(mut c) = self.child.take() {
            c.stop(libc::SIGKILL, Duration::from_secs(5));
        }
        let bin = procs::find_binary("redis-server", &[]).expect("redis-server");
        self.spawn(&bin);
    }

    /// Sends `sig` to a local server (SIGSTOP: a Redis that accepts
    /// connections and never answers; SIGCONT: back).
    pub fn signal(&self, sig: i32) {
        self.child.as_ref().expect("a local redis-server").signal(sig);
    }

    /// The port of a local server.
    pub fn port(&self) -> u16 {
        self.port
    }
}
