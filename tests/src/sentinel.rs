//! An ephemeral Redis Sentinel group for one test: a primary, one replica
//! (`--replicaof`) and one Sentinel (quorum 1, `down-after-milliseconds`
//! 500, `failover-timeout` 2000), each a local process on a free loopback
//! port in a temp dir of its own, no persistence, killed with the test.
//! Commands go through `redis-cli`.
//!
//! [`TestSentinel::start_tls`] runs the same group over TLS: every server
//! and the Sentinel also serve a TLS port, replication and Sentinel's own
//! links use it (`tls-replication yes`), client certificates are required,
//! and the Sentinel announces the TLS ports. The plain ports stay open on
//! loopback for the harness's checks.

use crate::procs::{self, Child};
use crate::redis::wait_ping;
use crate::wait;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// The name the Sentinel monitors the primary under.
pub const MASTER_NAME: &str = "quota-primary";
/// Sentinel's `down-after-milliseconds`.
pub const DOWN_AFTER_MS: u64 = 500;
/// Sentinel's `failover-timeout`.
pub const FAILOVER_TIMEOUT_MS: u64 = 2000;

/// A primary, a replica and a Sentinel.
pub struct TestSentinel {
    /// `127.0.0.1:PORT` of the Sentinel, as `--redis-sentinel` takes it.
    pub sentinel_addr: String,
    /// The port of the server started as primary.
    pub primary_port: u16,
    /// The port of the server started as replica.
    pub replica_port: u16,
    /// `rediss://127.0.0.1:PORT` of the Sentinel's TLS port, for a group
    /// started with [`TestSentinel::start_tls`].
    pub tls_sentinel_addr: Option<String>,
    sentinel_port: u16,
    cli: PathBuf,
    primary: Option<Child>,
    _replica: Child,
    _sentinel: Child,
    dir: tempfile::TempDir,
}

fn server(bin: &Path, dir: &Path, name: &str, port: u16, extra: &[String]) -> Child {
    let d = dir.join(name);
    std::fs::create_dir_all(&d).expect("server dir");
    let mut cmd = Command::new(bin);
    cmd.args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
        .arg("--dir")
        .arg(&d)
        .args(extra);
    let mut child = Child::spawn(name, cmd, &d.join("redis.log"), None).expect("spawn redis-server");
    wait_ping(port, Some(&mut child), &d);
    child
}

impl TestSentinel {
    /// Starts the group and waits until the replica is in sync and the
    /// Sentinel knows it; panics with the reason when a binary is missing
    /// or the group never forms.
    pub fn start() -> TestSentinel {
        Self::start_with(None)
    }

    /// The group over TLS with `files` (a certificate naming 127.0.0.1,
    /// used by every server and the Sentinel, and the CA they trust).
    pub fn start_tls(files: &crate::tls::ServerFiles) -> TestSentinel {
        Self::start_with(Some(files))
    }

    fn start_with(tls: Option<&crate::tls::ServerFiles>) -> TestSentinel {
        let bin = procs::find_binary("redis-server", &[])
            .expect("no redis-server binary (apt-get install redis-server)");
        let cli =
            procs::find_binary("redis-cli", &[]).expect("no redis-cli binary (apt-get install redis-tools)");
        let dir = tempfile::tempdir().expect("temp dir");
        let primary_port = crate::free_port();
        let mut replica_port = crate::free_port();
        while replica_port == primary_port {
            replica_port = crate::free_port();
        }
        let mut taken = vec![primary_port, replica_port];
        let mut another = || loop {
            let p = crate::free_port();
            if !taken.contains(&p) {
                taken.push(p);
                return p;
            }
        };
        // With TLS: the TLS ports the servers announce and replicate over.
        let tls_ports = tls.map(|_| (another(), another(), another()));
        let tls_args = |port: u16| -> Vec<String> {
            match tls {
                Some(f) => {
                    let mut a = f.redis_args(port, true);
                    a.extend(["--tls-replication".into(), "yes".into()]);
                    a
                }
                None => Vec::new(),
            }
        };
        let (primary_link, replica_link) = match tls_ports {
            Some((p, r, _)) => (p, r),
            None => (primary_port, replica_port),
        };
        let primary = server(&bin, dir.path(), "primary", primary_port, &tls_args(primary_link));
        let mut replica_args = vec!["--replicaof".into(), "127.0.0.1".into(), primary_link.to_string()];
        replica_args.extend(tls_args(replica_link));
        let replica = server(&bin, dir.path(), "replica", replica_port, &replica_args);
        let sentinel_port = another();
        let sd = dir.path().join("sentinel");
        std::fs::create_dir_all(&sd).expect("sentinel dir");
        // Sentinel rewrites its configuration file: it must be its own and writable.
        let conf = sd.join("sentinel.conf");
        std::fs::write(
            &conf,
            format!(
                "port {sentinel_port}\nbind 127.0.0.1\ndir {}\n{}\
                 sentinel monitor {MASTER_NAME} 127.0.0.1 {primary_link} 1\n\
                 sentinel down-after-milliseconds {MASTER_NAME} {DOWN_AFTER_MS}\n\
                 sentinel failover-timeout {MASTER_NAME} {FAILOVER_TIMEOUT_MS}\n\
                 sentinel parallel-syncs {MASTER_NAME} 1\n",
                sd.display(),
                match (tls, tls_ports) {
                    (Some(f), Some((_, _, st))) => format!(
                        "tls-port {st}\ntls-cert-file {}\ntls-key-file {}\ntls-ca-cert-file {}\n\
                         tls-replication yes\n",
                        f.cert.display(),
                        f.key.display(),
                        f.ca.display()
                    ),
                    _ => String::new(),
                }
            ),
        )
        .expect("sentinel.conf");
        let mut cmd = match procs::find_binary("redis-sentinel", &[]) {
            Some(s) => {
                let mut c = Command::new(s);
                c.arg(&conf);
                c
            }
            None => {
                let mut c = Command::new(&bin);
                c.arg(&conf).arg("--sentinel");
                c
            }
        };
        cmd.current_dir(&sd);
        let mut sentinel =
            Child::spawn("redis-sentinel", cmd, &sd.join("redis.log"), None).expect("spawn sentinel");
        wait_ping(sentinel_port, Some(&mut sentinel), &sd);
        let g = TestSentinel {
            sentinel_addr: format!("127.0.0.1:{sentinel_port}"),
            primary_port,
            replica_port,
            tls_sentinel_addr: tls_ports.map(|(_, _, st)| format!("rediss://127.0.0.1:{st}")),
            sentinel_port,
            cli,
            primary: Some(primary),
            _replica: replica,
            _sentinel: sentinel,
            dir,
        };
        let formed = wait::poll_blocking(Duration::from_secs(30), Duration::from_millis(50), || {
            let linked = g.info(replica_port).is_ok_and(|i| i.contains("master_link_status:up"));
            let known = g
                .cli(sentinel_port, &["SENTINEL", "replicas", MASTER_NAME])
                .is_ok_and(|o| o.contains(&replica_link.to_string()) && !o.contains("s_down"));
            (linked && known).then_some(()).ok_or(())
        });
        assert!(formed.is_ok(), "Sentinel group never formed:\n{}", g.logs());
        g
    }

    /// Runs `redis-cli -p port args...` and returns its output.
    pub fn cli(&self, port: u16, args: &[&str]) -> Result<String, String> {
        let mut cmd = Command::new(&self.cli);
        cmd.args(["-h", "127.0.0.1", "-p", &port.to_string()]).args(args);
        procs::run(cmd)
    }

    /// `INFO replication` of the server on `port`.
    pub fn info(&self, port: u16) -> Result<String, String> {
        self.cli(port, &["INFO", "replication"])
    }

    /// `field` of the server's `INFO replication`, as a number.
    fn repl_field(&self, port: u16, field: &str) -> Option<i64> {
        let info = self.info(port).ok()?;
        info.lines().find_map(|l| l.strip_prefix(&format!("{field}:"))).and_then(|v| v.trim().parse().ok())
    }

    /// Whether the replica has applied everything the primary wrote so far.
    pub fn replica_caught_up(&self) -> bool {
        match (
            self.repl_field(self.primary_port, "master_repl_offset"),
            self.repl_field(self.replica_port, "master_repl_offset"),
        ) {
            (Some(p), Some(r)) => p > 0 && p == r,
            _ => false,
        }
    }

    /// The primary's replication offset (bytes of write stream so far).
    pub fn primary_offset(&self) -> i64 {
        self.repl_field(self.primary_port, "master_repl_offset").unwrap_or(0)
    }

    /// The replica's replication offset.
    pub fn replica_offset(&self) -> i64 {
        self.repl_field(self.replica_port, "master_repl_offset").unwrap_or(0)
    }

    /// Makes the replica miss every later write while it stays a replica
    /// Sentinel may promote: it is pointed at a port nobody listens on
    /// (`REPLICAOF`), so it keeps its data and its role but receives
    /// nothing more. (SIGSTOP would not do: on loopback the kernel buffers
    /// the replication stream and the replica applies it once resumed.)
    pub fn cut_replica_link(&self) {
        let nowhere = crate::free_port();
        self.cli(self.replica_port, &["REPLICAOF", "127.0.0.1", &nowhere.to_string()]).expect("REPLICAOF");
    }

    /// Kills the server started as primary (SIGKILL: no goodbye to anyone).
    pub fn kill_primary(&mut self) {
        if let Some(mut c) = self.primary.take() {
            c.stop(libc::SIGKILL, Duration::from_secs(5));
        }
    }

    /// The primary's port as the Sentinel names it now.
    pub fn primary_by_sentinel(&self) -> Option<u16> {
        let out = self.cli(self.sentinel_port, &["SENTINEL", "get-master-addr-by-name", MASTER_NAME]).ok()?;
        out.lines().nth(1).and_then(|p| p.trim().parse().ok())
    }

    /// The servers' and the Sentinel's logs, for a failure message.
    pub fn logs(&self) -> String {
        ["primary", "replica", "sentinel"]
            .iter()
            .map(|n| {
                let log =
                    std::fs::read_to_string(self.dir.path().join(n).join("redis.log")).unwrap_or_default();
                let tail: Vec<&str> = log.lines().rev().take(30).collect();
                format!("--- {n}\n{}", tail.into_iter().rev().collect::<Vec<_>>().join("\n"))
            })
            .collect::<Vec<_>>()
            .join("\n")
    }
}
