//! A highly available PostgreSQL the way operators run it (issue 34): one
//! etcd, two PostgreSQL nodes under Patroni, and HAProxy in front routing
//! to whichever node Patroni's REST API reports as the primary
//! (`GET /primary`). Clients connect through HAProxy and nothing else.
//!
//! ```text
//!  client ─▶ HAProxy ─┬─▶ node1 postgres ◀─ patroni ─┐
//!            (/primary)└─▶ node2 postgres ◀─ patroni ─┴─▶ etcd
//!  node2 streams from node1 (and the other way after a failover)
//! ```
//!
//! The configuration files are generated from `deploy/patroni/` (the
//! operator's example): the harness only substitutes ports, directories
//! and the lab's short timings, so the example is what the tests run.
//! A scenario starves the replica by freezing the primary's WAL senders
//! ([`PatroniCluster::freeze_replication`]): the replication connection
//! stays up, as on a congested link, so Patroni keeps the replica as its
//! synchronous standby (a closed connection would make Patroni withdraw
//! it, and then refuse to promote it).
//!
//! Everything runs on free loopback ports in a temporary directory;
//! processes are killed and the directory removed when the
//! [`PatroniCluster`] drops (PostgreSQL too, which Patroni forks and which
//! would otherwise outlive a killed Patroni).

use crate::pg::{make_dir, pg_bin, scratch_root};
use crate::procs::{self, Child, NOBODY};
use crate::wait;
use sqlx::{Connection, PgConnection};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// The operator's example node configuration (template).
pub const PATRONI_TEMPLATE: &str = include_str!("../../deploy/patroni/patroni.yml");
/// The operator's example HAProxy configuration (template).
pub const HAPROXY_TEMPLATE: &str = include_str!("../../deploy/patroni/haproxy.cfg");

/// The lab's Patroni timings (seconds): a dead primary's leader key
/// expires after `TTL`, so a failover takes about that long. Production
/// values are Patroni's defaults, 30/10/10 (see deploy/patroni/).
pub const TTL: u64 = 10;
/// Patroni's `loop_wait`.
pub const LOOP_WAIT: u64 = 1;
/// Patroni's `retry_timeout`.
pub const RETRY_TIMEOUT: u64 = 4;

/// How long the cluster may take to elect, bootstrap, and stream.
const START_TIMEOUT: Duration = Duration::from_secs(90);
/// Bound on one call to a Patroni REST API, HAProxy's runtime API, or one
/// connection attempt.
const CALL_TIMEOUT: Duration = Duration::from_secs(2);
/// Longest `patronictl` may take.
const CTL_TIMEOUT: Duration = Duration::from_secs(60);

/// Replaces every `{{KEY}}` of `template`; a placeholder left over is an
/// error (the template and the harness disagree).
pub fn render(template: &str, vars: &[(&str, String)]) -> Result<String, String> {
    let mut out = template.to_string();
    for (k, v) in vars {
        out = out.replace(&format!("{{{{{k}}}}}"), v);
    }
    match out.find("{{") {
        Some(i) => Err(format!("placeholder left in the template: {}", &out[i..out.len().min(i + 40)])),
        None => Ok(out),
    }
}

/// One Patroni node and its PostgreSQL.
pub struct PatroniNode {
    /// Patroni member name (`node1`, `node2`).
    pub name: String,
    /// PostgreSQL's port.
    pub pg_port: u16,
    /// Patroni's REST API port.
    pub rest_port: u16,
    patroni: Option<Child>,
    dir: PathBuf,
    config: PathBuf,
}

impl PatroniNode {
    /// URL of the `postgres` database on this node, bypassing HAProxy.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.pg_port)
    }

    fn data_dir(&self) -> PathBuf {
        self.dir.join("data")
    }

    /// The postmaster's pid, from its pid file.
    fn postmaster_pid(&self) -> Option<i32> {
        let s = std::fs::read_to_string(self.data_dir().join("postmaster.pid")).ok()?;
        s.lines().next()?.trim().parse().ok()
    }

    /// SIGKILLs Patroni, then PostgreSQL's postmaster and every process of
    /// its group (backends, WAL sender): a host that crashed.
    fn kill(&mut self) {
        if let Some(mut c) = self.patroni.take() {
            c.stop(libc::SIGKILL, Duration::from_secs(5));
        }
        if let Some(pid) = self.postmaster_pid() {
            // Each child of the postmaster leads a session of its own
            // (PostgreSQL calls setsid in every child), so they are found
            // by parent, not by group.
            let mut pids = procs::children_of(pid);
            pids.push(pid);
            for p in pids {
                // SAFETY: kill of processes this harness's Patroni started.
                unsafe {
                    libc::kill(p, libc::SIGKILL);
                }
            }
        }
    }

    /// The node's WAL sender processes (one per replica streaming from it).
    fn wal_senders(&self) -> Vec<i32> {
        let Some(postmaster) = self.postmaster_pid() else { return Vec::new() };
        procs::children_of(postmaster)
            .into_iter()
            .filter(|pid| {
                std::fs::read(format!("/proc/{pid}/cmdline"))
                    .is_ok_and(|c| String::from_utf8_lossy(&c).contains("walsender"))
            })
            .collect()
    }

    /// Patroni's log.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("patroni.log")).unwrap_or_default()
    }
}

/// etcd, two Patroni nodes, HAProxy.
pub struct PatroniCluster {
    /// URL of the `postgres` database through HAProxy: the only address
    /// clients use.
    pub url: String,
    /// `127.0.0.1:PORT` of HAProxy's listener.
    pub addr: String,
    /// Whether Patroni runs `synchronous_mode`.
    pub synchronous: bool,
    pub nodes: Vec<PatroniNode>,
    etcd: Option<Child>,
    etcd_client_port: u16,
    etcd_peer_port: u16,
    /// `None` only while the nodes start (its configuration needs their ports).
    haproxy: Option<Child>,
    dir: PathBuf,
}

/// Directory of PostgreSQL's server binaries (Patroni's `bin_dir`).
fn pg_bin_dir() -> Result<PathBuf, String> {
    // Resolved: a `postgres` on PATH may be a symlink into the version's
    // directory, where Patroni finds the other tools (pg_controldata, ...).
    let postgres = pg_bin("postgres")?;
    let postgres = postgres.canonicalize().map_err(|e| format!("{}: {e}", postgres.display()))?;
    postgres.parent().map(Path::to_path_buf).ok_or_else(|| "postgres has no directory".into())
}

fn tool(name: &str) -> Result<PathBuf, String> {
    procs::find_binary(name, &[]).ok_or_else(|| {
        format!("{name} not found on PATH (apt-get install patroni etcd-server etcd-client haproxy)")
    })
}

/// Whether the Patroni stack's programs are installed.
pub fn available() -> Result<(), String> {
    for name in ["patroni", "patronictl", "etcd", "haproxy"] {
        tool(name)?;
    }
    pg_bin_dir().map(|_| ())
}

/// `GET http://127.0.0.1:{port}{path}`'s status, `None` when nothing answers.
async fn rest_status(port: u16, path: &str) -> Option<u16> {
    static CLIENT: std::sync::OnceLock<Option<reqwest::Client>> = std::sync::OnceLock::new();
    let client =
        CLIENT.get_or_init(|| crate::http::client_builder().timeout(CALL_TIMEOUT).build().ok()).as_ref()?;
    client.get(format!("http://127.0.0.1:{port}{path}")).send().await.ok().map(|r| r.status().as_u16())
}

impl PatroniCluster {
    /// Starts etcd, two Patroni nodes (`node1` bootstraps and becomes the
    /// primary, `node2` its replica) and HAProxy; waits until the primary
    /// answers through HAProxy and the replica streams (as the synchronous
    /// standby with `synchronous`).
    pub async fn start(synchronous: bool) -> Result<PatroniCluster, String> {
        available()?;
        let dir = scratch_root().join(format!("patroni-{}", uuid::Uuid::new_v4().simple()));
        make_dir(&dir)?;
        let etcd_client_port = crate::free_port();
        let etcd_peer_port = crate::free_port();
        let mut cluster = PatroniCluster {
            url: String::new(),
            addr: String::new(),
            synchronous,
            nodes: Vec::new(),
            etcd: None,
            etcd_client_port,
            etcd_peer_port,
            haproxy: None,
            dir: dir.clone(),
        };
        cluster.start_etcd().await?;
        let bin_dir = pg_bin_dir()?;
        for i in 1..=2 {
            let name = format!("node{i}");
            let node_dir = dir.join(&name);
            make_dir(&node_dir)?;
            let pg_port = crate::free_port();
            let rest_port = crate::free_port();
            let yml = render(
                PATRONI_TEMPLATE,
                &[
                    ("NAME", name.clone()),
                    ("REST_PORT", rest_port.to_string()),
                    ("ETCD_HOSTS", format!("127.0.0.1:{etcd_client_port}")),
                    ("TTL", TTL.to_string()),
                    ("LOOP_WAIT", LOOP_WAIT.to_string()),
                    ("RETRY_TIMEOUT", RETRY_TIMEOUT.to_string()),
                    ("SYNCHRONOUS_MODE", synchronous.to_string()),
                    ("PG_PORT", pg_port.to_string()),
                    ("CONNECT_ADDRESS", format!("127.0.0.1:{pg_port}")),
                    ("DATA_DIR", node_dir.join("data").display().to_string()),
                    ("BIN_DIR", bin_dir.display().to_string()),
                    ("DIR", node_dir.display().to_string()),
                ],
            )?;
            let config = node_dir.join("patroni.yml");
            std::fs::write(&config, yml).map_err(|e| format!("{}: {e}", config.display()))?;
            let mut node = PatroniNode { name, pg_port, rest_port, patroni: None, dir: node_dir, config };
            cluster.spawn_patroni(&mut node)?;
            cluster.nodes.push(node);
            if i == 1 {
                // node1 bootstraps alone, so it is the first primary.
                cluster.wait_primary(START_TIMEOUT).await?;
            }
        }
        let listen_port = crate::free_port();
        let cfg = render(
            HAPROXY_TEMPLATE,
            &[
                ("DIR", dir.display().to_string()),
                ("LISTEN_PORT", listen_port.to_string()),
                ("NODE1_PG_PORT", cluster.nodes[0].pg_port.to_string()),
                ("NODE1_REST_PORT", cluster.nodes[0].rest_port.to_string()),
                ("NODE2_PG_PORT", cluster.nodes[1].pg_port.to_string()),
                ("NODE2_REST_PORT", cluster.nodes[1].rest_port.to_string()),
            ],
        )?;
        let cfg_path = dir.join("haproxy.cfg");
        std::fs::write(&cfg_path, cfg).map_err(|e| format!("{}: {e}", cfg_path.display()))?;
        let mut cmd = Command::new(tool("haproxy")?);
        // -db: foreground, no daemon, so the harness owns the process.
        cmd.arg("-db").arg("-f").arg(&cfg_path);
        cluster.haproxy =
            Some(Child::spawn("haproxy", cmd, &dir.join("haproxy.log"), None).map_err(|e| e.to_string())?);
        cluster.addr = format!("127.0.0.1:{listen_port}");
        cluster.url = format!("postgres://postgres@{}/postgres", cluster.addr);
        cluster.wait_writable(START_TIMEOUT).await?;
        cluster.wait_streaming(0, START_TIMEOUT).await?;
        Ok(cluster)
    }

    fn spawn_patroni(&self, node: &mut PatroniNode) -> Result<(), String> {
        let mut cmd = Command::new(tool("patroni")?);
        cmd.arg(&node.config).current_dir(&node.dir).env("HOME", &node.dir);
        let user = procs::is_root().then_some(NOBODY);
        let log = node.dir.join("patroni.log");
        node.patroni = Some(Child::spawn(&node.name, cmd, &log, user).map_err(|e| e.to_string())?);
        Ok(())
    }

    /// Starts etcd (again, on the same ports and data after
    /// [`PatroniCluster::stop_etcd`]) and waits until it answers.
    pub async fn start_etcd(&mut self) -> Result<(), String> {
        let data = self.dir.join("etcd");
        let (c, p) = (self.etcd_client_port, self.etcd_peer_port);
        let mut cmd = Command::new(tool("etcd")?);
        cmd.args(["--name", "etcd1"])
            .arg("--data-dir")
            .arg(&data)
            .arg(format!("--listen-client-urls=http://127.0.0.1:{c}"))
            .arg(format!("--advertise-client-urls=http://127.0.0.1:{c}"))
            .arg(format!("--listen-peer-urls=http://127.0.0.1:{p}"))
            .arg(format!("--initial-advertise-peer-urls=http://127.0.0.1:{p}"))
            .arg(format!("--initial-cluster=etcd1=http://127.0.0.1:{p}"));
        let log = self.dir.join(format!("etcd-{}.log", uuid::Uuid::new_v4().simple()));
        self.etcd = Some(Child::spawn("etcd", cmd, &log, None).map_err(|e| e.to_string())?);
        let up = wait::poll(START_TIMEOUT, Duration::from_millis(50), || async move {
            match rest_status(c, "/health").await {
                Some(200) => Ok(()),
                s => Err(s),
            }
        })
        .await;
        up.map_err(|s| {
            let log = std::fs::read_to_string(&log).unwrap_or_default();
            format!("etcd does not answer /health ({s:?}) after {START_TIMEOUT:?}: {log}")
        })
    }

    /// Stops etcd (SIGKILL: the store is gone at once, as when its host
    /// dies); the data directory stays for [`PatroniCluster::start_etcd`].
    pub fn stop_etcd(&mut self) {
        if let Some(mut c) = self.etcd.take() {
            c.stop(libc::SIGKILL, Duration::from_secs(5));
        }
    }

    /// The index of the node whose Patroni answers 200 on `/primary`.
    pub async fn primary(&self) -> Option<usize> {
        for (i, n) in self.nodes.iter().enumerate() {
            if n.patroni.is_some() && rest_status(n.rest_port, "/primary").await == Some(200) {
                return Some(i);
            }
        }
        None
    }

    /// Waits until some node reports itself the primary; its index.
    pub async fn wait_primary(&self, timeout: Duration) -> Result<usize, String> {
        let found =
            wait::poll(timeout, Duration::from_millis(100), || async move { self.primary().await.ok_or(()) })
                .await;
        found.map_err(|()| format!("no Patroni node is the primary after {timeout:?}: {}", self.logs_tail()))
    }

    /// Waits until a write through HAProxy can commit (the connection lands
    /// on a node that is not in recovery).
    pub async fn wait_writable(&self, timeout: Duration) -> Result<(), String> {
        let url = &self.url;
        let up = wait::poll(timeout, Duration::from_millis(100), || async move {
            let mut c = match tokio::time::timeout(CALL_TIMEOUT, PgConnection::connect(url)).await {
                Ok(Ok(c)) => c,
                Ok(Err(e)) => return Err(e.to_string()),
                Err(_) => return Err("connect timed out".into()),
            };
            let recovering: Result<bool, _> =
                sqlx::query_scalar("select pg_is_in_recovery()").fetch_one(&mut c).await;
            let _ = c.close().await;
            match recovering {
                Ok(false) => Ok(()),
                Ok(true) => Err("HAProxy routes to a node in recovery".into()),
                Err(e) => Err(e.to_string()),
            }
        })
        .await;
        up.map_err(|e| format!("no writable primary through HAProxy after {timeout:?}: {e}"))
    }

    /// Waits until node `primary` has a replica streaming (as `sync` with
    /// `synchronous_mode`, `async` otherwise).
    pub async fn wait_streaming(&self, primary: usize, timeout: Duration) -> Result<(), String> {
        let url = self.nodes[primary].url();
        let want = if self.synchronous { "sync" } else { "async" };
        let url = &url;
        let streaming = wait::poll(timeout, Duration::from_millis(100), || async move {
            let mut c = match tokio::time::timeout(CALL_TIMEOUT, PgConnection::connect(url)).await {
                Ok(Ok(c)) => c,
                Ok(Err(e)) => return Err(e.to_string()),
                Err(_) => return Err("connect timed out".into()),
            };
            let n: Result<i64, _> = sqlx::query_scalar(
                "select count(*) from pg_stat_replication where state = 'streaming' and sync_state = $1",
            )
            .bind(want)
            .fetch_one(&mut c)
            .await;
            let _ = c.close().await;
            match n {
                Ok(n) if n > 0 => Ok(()),
                Ok(_) => Err(format!("no {want} replica streaming")),
                Err(e) => Err(e.to_string()),
            }
        })
        .await;
        streaming.map_err(|e| format!("{e} after {timeout:?}: {}", self.logs_tail()))
    }

    /// Kills node `i` (Patroni and PostgreSQL, SIGKILL): its leader key
    /// stays in etcd until `ttl` runs out, then the other node promotes.
    pub fn kill_node(&mut self, i: usize) {
        self.nodes[i].kill();
    }

    /// Freezes (SIGSTOP) node `i`'s WAL senders: its replica receives
    /// nothing more while the replication connection stays up (a link that
    /// stalls, not one that breaks). A synchronous primary then
    /// acknowledges no commit; an asynchronous one goes on acknowledging
    /// commits only it holds. Undone only by killing the node.
    pub fn freeze_replication(&self, i: usize) -> Result<usize, String> {
        let pids = self.nodes[i].wal_senders();
        if pids.is_empty() {
            return Err(format!("{} has no WAL sender", self.nodes[i].name));
        }
        for pid in &pids {
            // SAFETY: kill of a process this harness's Patroni started.
            unsafe {
                libc::kill(*pid, libc::SIGSTOP);
            }
        }
        Ok(pids.len())
    }

    /// Planned switchover with `patronictl switchover` from the current
    /// leader to `candidate`, waiting for Patroni to report it done.
    pub async fn switchover(&self, leader: usize, candidate: usize) -> Result<String, String> {
        let mut cmd = Command::new(tool("patronictl")?);
        cmd.arg("-c")
            .arg(&self.nodes[leader].config)
            .arg("switchover")
            .args(["--leader", &self.nodes[leader].name, "--candidate", &self.nodes[candidate].name])
            .arg("--force")
            .current_dir(&self.dir)
            .env("HOME", &self.dir);
        match tokio::time::timeout(CTL_TIMEOUT, tokio::task::spawn_blocking(move || procs::run(cmd))).await {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => Err(format!("patronictl: {e}")),
            Err(_) => Err(format!("patronictl switchover did not finish within {CTL_TIMEOUT:?}")),
        }
    }

    /// Takes node `i` out of HAProxy (`state maint`) and closes every
    /// session HAProxy holds to it: the clients lose that node at once,
    /// as at the start of a failover, whatever its PostgreSQL still does.
    pub fn cut_clients_from(&self, i: usize) -> Result<(), String> {
        let server = format!("postgres_primary/{}", self.nodes[i].name);
        self.haproxy_command(&format!("set server {server} state maint"))?;
        self.haproxy_command(&format!("shutdown sessions server {server}"))?;
        Ok(())
    }

    /// One command on HAProxy's runtime API (its answer).
    fn haproxy_command(&self, command: &str) -> Result<String, String> {
        let sock = self.dir.join("haproxy.sock");
        let mut s =
            std::os::unix::net::UnixStream::connect(&sock).map_err(|e| format!("{}: {e}", sock.display()))?;
        s.set_read_timeout(Some(CALL_TIMEOUT)).map_err(|e| e.to_string())?;
        s.set_write_timeout(Some(CALL_TIMEOUT)).map_err(|e| e.to_string())?;
        s.write_all(format!("{command}\n").as_bytes()).map_err(|e| format!("haproxy {command}: {e}"))?;
        let mut answer = String::new();
        s.read_to_string(&mut answer).map_err(|e| format!("haproxy {command}: {e}"))?;
        let answer = answer.trim().to_string();
        if answer.is_empty() {
            Ok(answer)
        } else {
            Err(format!("haproxy {command}: {answer}"))
        }
    }

    /// The last lines of every process's log, for error messages.
    pub fn logs_tail(&self) -> String {
        let mut out = String::new();
        for n in &self.nodes {
            let log = n.log();
            let lines: Vec<&str> = log.lines().rev().take(8).collect();
            out.push_str(&format!("\n--- {} ---\n", n.name));
            for l in lines.into_iter().rev() {
                out.push_str(l);
                out.push('\n');
            }
        }
        out
    }

    /// Copies the logs of every process into `to`.
    pub fn save_logs(&self, to: &Path) {
        for n in &self.nodes {
            let _ = std::fs::copy(n.dir.join("patroni.log"), to.join(format!("patroni-{}.log", n.name)));
            if let Ok(rd) = std::fs::read_dir(n.data_dir().join("log")) {
                for e in rd.flatten() {
                    let _ = std::fs::copy(
                        e.path(),
                        to.join(format!("postgres-{}-{}", n.name, e.file_name().to_string_lossy())),
                    );
                }
            }
        }
        if let Ok(rd) = std::fs::read_dir(&self.dir) {
            for e in rd.flatten() {
                let name = e.file_name().to_string_lossy().to_string();
                if name.ends_with(".log") {
                    let _ = std::fs::copy(e.path(), to.join(name));
                }
            }
        }
    }
}

impl Drop for PatroniCluster {
    fn drop(&mut self) {
        for n in &mut self.nodes {
            n.kill();
        }
        self.stop_etcd();
        self.haproxy.take();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_templates_render_with_every_placeholder_filled() {
        let err = render("a {{X}} {{Y}}", &[("X", "1".into())]).unwrap_err();
        assert!(err.contains("{{Y}}"), "{err}");
        assert_eq!(render("a {{X}}", &[("X", "1".into())]).unwrap(), "a 1");
    }
}
