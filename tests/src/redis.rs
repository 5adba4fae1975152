//! An ephemeral Redis for one test: `REDIS_URL` with a key prefix of the
//! test's own, or a local `redis-server` (no persistence, free loopback
//! port), or a `redis` container when a Docker engine answers.

use crate::procs::{self, Child, Container};
use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

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
}

fn ping(port: u16) -> bool {
    let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) else { return false };
    let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
    let mut buf = [0u8; 7];
    s.write_all(b"PING\r\n").is_ok() && s.read_exact(&mut buf).is_ok() && &buf == b"+PONG\r\n"
}

impl TestRedis {
    /// Starts (or names) a Redis for one test; panics with the reason when
    /// none can be had.
    pub fn start() -> TestRedis {
        let prefix = format!("t{}", uuid::Uuid::new_v4().simple());
        if let Ok(url) = std::env::var("REDIS_URL") {
            return TestRedis { url, prefix, port: 0, child: None, dir: None, _container: None };
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
            };
            r.spawn(&bin);
            return r;
        }
        if procs::docker_available() {
            let (c, port) = Container::run("redis:7-alpine", 6379, &[]).expect("redis container");
            let deadline = Instant::now() + Duration::from_secs(30);
            while !ping(port) {
                assert!(Instant::now() < deadline, "redis container not ready");
                std::thread::sleep(Duration::from_millis(25));
            }
            return TestRedis {
                url: format!("redis://127.0.0.1:{port}"),
                prefix,
                port,
                child: None,
                dir: None,
                _container: Some(c),
            };
        }
        panic!("no REDIS_URL, no redis-server binary (apt-get install redis-server) and no Docker engine");
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
        .arg(&dir);
        self.child = Some(
            Child::spawn("redis-server", cmd, &dir.join("redis.log"), None).expect("spawn redis-server"),
        );
        let deadline = Instant::now() + Duration::from_secs(20);
        while !ping(self.port) {
            if let Some(s) = self.child.as_mut().and_then(|c| c.try_wait()) {
                panic!(
                    "redis-server exited: {s}: {}",
                    std::fs::read_to_string(dir.join("redis.log")).unwrap_or_default()
                );
            }
            assert!(Instant::now() < deadline, "redis-server not ready");
            std::thread::sleep(Duration::from_millis(10));
        }
        self.url = format!("redis://127.0.0.1:{}", self.port);
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

    /// The port of a local server.
    pub fn port(&self) -> u16 {
        self.port
    }
}
