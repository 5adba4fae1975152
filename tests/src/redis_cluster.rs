//! An ephemeral 3-master Redis Cluster for one test: three local
//! `redis-server` processes in cluster mode on free loopback ports (no
//! persistence), joined with `redis-cli --cluster create`, ready once
//! `CLUSTER INFO` reports `cluster_state:ok` on every node.
//!
//! [`TestRedisCluster::start_tls`] runs the nodes with a TLS port each as
//! well (`tls-cluster yes`: the cluster bus speaks TLS, and a TLS client is
//! told the TLS ports); the cluster is formed and checked through the plain
//! loopback ports, the agents get the `rediss://` list.

use crate::procs::{self, Child};
use crate::wait;
use std::process::Command;
use std::time::{Duration, Instant};

/// One test's Redis Cluster; the servers die with it.
pub struct TestRedisCluster {
    /// The node URLs, comma-separated (`redis://127.0.0.1:P1,redis://...`),
    /// as the agent's `--redis` takes them.
    pub url: String,
    /// The node ports.
    pub ports: Vec<u16>,
    /// The nodes' TLS ports, `rediss://127.0.0.1:T1,...`, for a cluster
    /// started with [`TestRedisCluster::start_tls`].
    pub tls_url: Option<String>,
    _children: Vec<Child>,
    _dir: tempfile::TempDir,
}

fn cli(bin: &std::path::Path, args: &[&str]) -> Result<String, String> {
    let mut cmd = Command::new(bin);
    cmd.args(args);
    procs::run(cmd)
}

impl TestRedisCluster {
    /// Starts a 3-master cluster (no replicas); panics with the reason when
    /// `redis-server` or `redis-cli` is missing or the cluster never forms.
    pub fn start() -> TestRedisCluster {
        Self::start_with(3)
    }

    /// Starts a cluster of `masters` masters (at least 3, as Redis requires).
    pub fn start_with(masters: usize) -> TestRedisCluster {
        Self::start_inner(masters, None)
    }

    /// A 3-master cluster whose nodes also serve TLS with `files` (client
    /// certificates not required).
    pub fn start_tls(files: &crate::tls::ServerFiles) -> TestRedisCluster {
        Self::start_inner(3, Some(files))
    }

    fn start_inner(masters: usize, tls: Option<&crate::tls::ServerFiles>) -> TestRedisCluster {
        assert!(masters >= 3, "a Redis Cluster needs at least 3 masters");
        let server = procs::find_binary("redis-server", &[])
            .expect("no redis-server binary (apt-get install redis-server)");
        let cli_bin =
            procs::find_binary("redis-cli", &[]).expect("no redis-cli binary (apt-get install redis-tools)");
        let dir = tempfile::tempdir().expect("temp dir");
        let mut ports = Vec::new();
        let mut children = Vec::new();
        let mut tls_ports: Vec<u16> = Vec::new();
        while ports.len() < masters {
            let port = crate::free_port();
            // The cluster bus listens on port + 10000; both must be free and distinct.
            if port > 55535
                || ports.contains(&port)
                || tls_ports.contains(&port)
                || ports.iter().any(|p| p + 10000 == port || port + 10000 == *p)
            {
                continue;
            }
            if std::net::TcpListener::bind(("127.0.0.1", port + 10000)).is_err() {
                continue;
            }
            let tls_args = match tls {
                Some(f) => {
                    let tls_port = loop {
                        let t = crate::free_port();
                        let clash = |p: u16| t == p || t == p + 10000;
                        if !clash(port) && !ports.iter().any(|p| clash(*p)) && !tls_ports.contains(&t) {
                            break t;
                        }
                    };
                    tls_ports.push(tls_port);
                    let mut a = f.redis_args(tls_port, false);
                    a.extend(["--tls-cluster", "yes", "--tls-replication", "yes"].map(String::from));
                    a
                }
                None => Vec::new(),
            };
            let mut cmd = Command::new(&server);
            cmd.args(&tls_args);
            cmd.args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
                .args(["--cluster-enabled", "yes"])
                .arg("--cluster-config-file")
                .arg(dir.path().join(format!("nodes-{port}.conf")))
                .args(["--save", "", "--appendonly", "no", "--cluster-node-timeout", "2000"])
                .arg("--dir")
                .arg(dir.path());
            let log = dir.path().join(format!("redis-{port}.log"));
            children.push(Child::spawn("redis-server", cmd, &log, None).expect("spawn redis-server"));
            ports.push(port);
        }
        let mut c = TestRedisCluster {
            url: ports.iter().map(|p| format!("redis://127.0.0.1:{p}")).collect::<Vec<_>>().join(","),
            tls_url: tls.map(|_| {
                tls_ports.iter().map(|p| format!("rediss://127.0.0.1:{p}")).collect::<Vec<_>>().join(",")
            }),
            ports,
            _children: children,
            _dir: dir,
        };
        c.wait_pong(&cli_bin);
        let mut args = vec!["--cluster".to_string(), "create".to_string()];
        args.extend(c.ports.iter().map(|p| format!("127.0.0.1:{p}")));
        args.extend(["--cluster-replicas", "0", "--cluster-yes"].map(String::from));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        if let Err(e) = cli(&cli_bin, &args) {
            panic!("redis-cli --cluster create failed: {e}\n{}", c.logs());
        }
        c.wait_ok(&cli_bin);
        c
    }

    /// The number of keys on each node (`DBSIZE`), in the order of `ports`.
    pub fn dbsizes(&self) -> Vec<u64> {
        let cli_bin = procs::find_binary("redis-cli", &[]).expect("redis-cli");
        self.ports
            .iter()
            .map(|p| {
                let out = cli(&cli_bin, &["-p", &p.to_string(), "dbsize"]).expect("redis-cli dbsize");
                out.trim().parse().expect("dbsize is a number")
            })
            .collect()
    }

    fn logs(&self) -> String {
        self.ports
            .iter()
            .map(|p| {
                let f = self._dir.path().join(format!("redis-{p}.log"));
                format!("--- {p}\n{}", std::fs::read_to_string(f).unwrap_or_default())
            })
            .collect()
    }

    fn check_alive(&mut self) {
        for (ch, p) in self._children.iter_mut().zip(&self.ports) {
            if let Some(s) = ch.try_wait() {
                panic!("redis-server on {p} exited: {s}\n{}", self.logs_of(*p));
            }
        }
    }

    fn logs_of(&self, port: u16) -> String {
        std::fs::read_to_string(self._dir.path().join(format!("redis-{port}.log"))).unwrap_or_default()
    }

    fn wait_pong(&mut self, cli_bin: &std::path::Path) {
        self.each_node(Duration::from_secs(20), Duration::from_millis(10), "not ready", |port| {
            let pong = cli(cli_bin, &["-p", port, "ping"])?;
            if pong.trim() == "PONG" {
                Ok(())
            } else {
                Err(pong)
            }
        });
    }

    /// Polls every node until it reports `cluster_state:ok` and all slots assigned.
    fn wait_ok(&mut self, cli_bin: &std::path::Path) {
        self.each_node(
            Duration::from_secs(30),
            Duration::from_millis(20),
            "never reached cluster_state:ok",
            |port| {
                let info = cli(cli_bin, &["-p", port, "cluster", "info"]).unwrap_or_default();
                if info.lines().any(|l| l.trim() == "cluster_state:ok")
                    && info.lines().any(|l| l.trim() == "cluster_slots_ok:16384")
                {
                    Ok(())
                } else {
                    Err(info)
                }
            },
        );
    }

    /// Polls `ready` on every node's port every `every`, all within one
    /// deadline `within`; a node that exits or is not ready by then fails
    /// the test with `what`, its last answer and the logs.
    fn each_node(
        &mut self,
        within: Duration,
        every: Duration,
        what: &str,
        ready: impl Fn(&str) -> Result<(), String>,
    ) {
        let deadline = Instant::now() + within;
        for p in self.ports.clone() {
            let port = p.to_string();
            let left = deadline.saturating_duration_since(Instant::now());
            let r = wait::poll_blocking(left, every, || {
                let r = ready(&port);
                if r.is_err() {
                    self.check_alive();
                }
                r
            });
            if let Err(last) = r {
                panic!("redis-server on {p} {what}: {last}\n{}", self.logs());
            }
        }
    }
}
