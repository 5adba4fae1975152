//! An ephemeral PostgreSQL for one test.
//!
//! In order of preference: the server named by `DATABASE_URL` (a fresh
//! database per test, dropped afterwards); local server binaries (`initdb`
//! runs once per test process into a template data directory, each test
//! copies it and starts its own `postgres` on a free loopback port, as the
//! unprivileged `nobody` when running as root); a `postgres` container when a
//! Docker engine answers. Everything started is stopped when the [`TestDb`]
//! drops, also on panic.

use crate::procs::{self, Child, Container, NOBODY};
use crate::wait;
use sqlx::{Connection, Executor, PgConnection};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

/// How long a server may take to accept connections.
const READY_TIMEOUT: Duration = Duration::from_secs(30);

/// One test's database.
pub struct TestDb {
    /// URL of the test's own database.
    pub url: String,
    server: Option<Server>,
    external: Option<(String, String)>,
    _container: Option<Container>,
}

/// A local server process and its data directory.
struct Server {
    child: Option<Child>,
    dir: PathBuf,
    port: u16,
}

impl Server {
    fn start(&mut self) -> Result<(), String> {
        let bin = pg_bin("postgres")?;
        let data = self.dir.join("data");
        let mut cmd = Command::new(bin);
        cmd.arg("-D").arg(&data).arg("-p").arg(self.port.to_string()).arg("-k").arg(&self.dir);
        for setting in [
            "listen_addresses=127.0.0.1",
            // PostgreSQL 15's defaults, named so that the server's WAL
            // settings do not change with the packaged version.
            "wal_level=replica",
            "max_wal_senders=5",
            "fsync=off",
            "full_page_writes=off",
            "max_connections=300",
            "shared_buffers=32MB",
            "log_min_messages=warning",
        ] {
            cmd.arg("-c").arg(setting);
        }
        let user = procs::is_root().then_some(NOBODY);
        self.child = Some(
            Child::spawn("postgres", cmd, &self.dir.join("postgres.log"), user).map_err(|e| e.to_string())?,
        );
        Ok(())
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            // SIGQUIT is PostgreSQL's immediate shutdown: the data is thrown away anyway.
            c.stop(libc::SIGQUIT, Duration::from_secs(5));
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

pub(crate) fn pg_bin(name: &str) -> Result<PathBuf, String> {
    let mut extra: Vec<PathBuf> = Vec::new();
    if let Ok(rd) = std::fs::read_dir("/usr/lib/postgresql") {
        let mut versions: Vec<PathBuf> = rd.flatten().map(|e| e.path().join("bin")).collect();
        versions.sort();
        versions.reverse();
        extra.extend(versions);
    }
    procs::find_binary(name, &extra)
        .ok_or_else(|| format!("{name} not found on PATH or in /usr/lib/postgresql/*/bin"))
}

/// A directory the server user may write to.
pub(crate) fn make_dir(path: &Path) -> Result<(), String> {
    std::fs::create_dir_all(path).map_err(|e| format!("{}: {e}", path.display()))?;
    if procs::is_root() {
        std::os::unix::fs::chown(path, Some(NOBODY.0), Some(NOBODY.1)).map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// The per-process scratch directory, removed when the process exits.
pub(crate) fn scratch_root() -> &'static PathBuf {
    static ROOT: OnceLock<PathBuf> = OnceLock::new();
    ROOT.get_or_init(|| {
        let root = std::env::temp_dir().join(format!("quota-tests-{}", std::process::id()));
        let _ = make_dir(&root);
        extern "C" fn cleanup() {
            let root = std::env::temp_dir().join(format!("quota-tests-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(root);
        }
        // SAFETY: registering a plain extern "C" function.
        unsafe {
            libc::atexit(cleanup);
        }
        root
    })
}

/// `initdb` once per process; each test copies the result.
fn template() -> Result<&'static PathBuf, String> {
    static TEMPLATE: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    TEMPLATE
        .get_or_init(|| {
            let dir = scratch_root().join("template");
            make_dir(&dir)?;
            let mut cmd = Command::new(pg_bin("initdb")?);
            cmd.arg("-D").arg(&dir).args([
                "-A",
                "trust",
                "-U",
                "postgres",
                "-E",
                "UTF8",
                "--no-locale",
                "--no-sync",
            ]);
            if procs::is_root() {
                use std::os::unix::process::CommandExt;
                cmd.uid(NOBODY.0).gid(NOBODY.1);
            }
            cmd.current_dir(scratch_root());
            procs::run(cmd)?;
            Ok(dir)
        })
        .as_ref()
        .map_err(|e| e.clone())
}

fn copy_template(to: &Path) -> Result<(), String> {
    let mut cmd = Command::new("cp");
    cmd.arg("-a").arg(template()?).arg(to);
    if procs::is_root() {
        use std::os::unix::process::CommandExt;
        cmd.uid(NOBODY.0).gid(NOBODY.1);
    }
    procs::run(cmd).map(|_| ())
}

/// Connects to `url` until it answers; a server of ours that exits ends
/// the wait at once, with its log.
async fn wait_ready(url: &str, mut server: Option<&mut Server>) -> Result<(), String> {
    // `Ok(Err(_))`: the server exited, no point in waiting longer.
    let waited = wait::poll(READY_TIMEOUT, Duration::from_millis(25), || {
        let exited = server.as_deref_mut().and_then(|s| {
            let status = s.child.as_mut().and_then(|c| c.try_wait())?;
            let log = std::fs::read_to_string(s.dir.join("postgres.log")).unwrap_or_default();
            Some(format!("postgres exited with {status}: {log}"))
        });
        async move {
            match PgConnection::connect(url).await {
                Ok(c) => {
                    let _ = c.close().await;
                    Ok(Ok(()))
                }
                Err(e) => exited.map(Err).ok_or(e),
            }
        }
    })
    .await;
    waited.map_err(|e| format!("PostgreSQL at {url} not ready after {READY_TIMEOUT:?}: {e}"))?
}

impl TestDb {
    /// A fresh database for one test. Panics with the reason when no
    /// PostgreSQL can be had.
    pub async fn start() -> TestDb {
        match Self::try_start().await {
            Ok(db) => db,
            Err(e) => panic!("cannot start PostgreSQL for the test: {e}"),
        }
    }

    async fn try_start() -> Result<TestDb, String> {
        if let Ok(admin) = std::env::var("DATABASE_URL") {
            return Self::on_external(admin).await;
        }
        if pg_bin("initdb").is_ok() && pg_bin("postgres").is_ok() {
            return Self::local().await;
        }
        if procs::docker_available() {
            let (container, port) =
                Container::run("postgres:16-alpine", 5432, &["-e", "POSTGRES_HOST_AUTH_METHOD=trust"])?;
            let url = format!("postgres://postgres@127.0.0.1:{port}/postgres");
            wait_ready(&url, None).await?;
            return Ok(TestDb { url, server: None, external: None, _container: Some(container) });
        }
        Err("no DATABASE_URL, no initdb/postgres binaries (apt-get install postgresql) and no Docker engine"
            .into())
    }

    async fn local() -> Result<TestDb, String> {
        let mut last_err = String::new();
        // A free port can be taken between the probe and the bind; try again.
        for _ in 0..3 {
            let dir = scratch_root().join(format!("pg-{}", uuid::Uuid::new_v4().simple()));
            make_dir(&dir)?;
            copy_template(&dir.join("data"))?;
            let port = crate::free_port();
            let mut server = Server { child: None, dir, port };
            server.start()?;
            let url = format!("postgres://postgres@127.0.0.1:{port}/postgres");
            match wait_ready(&url, Some(&mut server)).await {
                Ok(()) => return Ok(TestDb { url, server: Some(server), external: None, _container: None }),
                Err(e) => last_err = e,
            }
        }
        Err(last_err)
    }

    async fn on_external(admin: String) -> Result<TestDb, String> {
        let name = format!("quota_test_{}", uuid::Uuid::new_v4().simple());
        let mut conn = PgConnection::connect(&admin).await.map_err(|e| format!("DATABASE_URL: {e}"))?;
        conn.execute(format!("create database {name}").as_str()).await.map_err(|e| e.to_string())?;
        let _ = conn.close().await;
        let url = replace_db(&admin, &name);
        Ok(TestDb { url, server: None, external: Some((admin, name)), _container: None })
    }

    /// Kills the local server (SIGKILL) and starts it again on the same data
    /// directory and port: committed data survives, connections break.
    pub async fn restart(&mut self) {
        let server = self.server.as_mut().expect("restart needs a local server");
        if let Some(mut c) = server.child.take() {
            c.stop(libc::SIGKILL, Duration::from_secs(5));
        }
        // The postmaster's children notice its death and exit; wait for the pid file to go stale.
        let pid_file = server.dir.join("data").join("postmaster.pid");
        let _ = std::fs::remove_file(&pid_file);
        server.start().expect("restart postgres");
        let url = self.url.clone();
        wait_ready(&url, self.server.as_mut()).await.expect("postgres ready after restart");
    }

    /// Sends `sig` to the local server's postmaster and every process it
    /// forked (backends, background workers): SIGSTOP pauses PostgreSQL with
    /// its connections open, SIGCONT resumes it. (The postmaster leaves the
    /// process group the harness gave it, so the group cannot be used.)
    pub fn signal_all(&self, sig: i32) {
        let server = self.server.as_ref().expect("signal_all needs a local server");
        let postmaster = server.child.as_ref().expect("server running").pid() as i32;
        let mut pids = vec![postmaster];
        pids.extend(procs::children_of(postmaster));
        for pid in pids {
            // SAFETY: kill of a process this harness started or its child.
            unsafe {
                libc::kill(pid, sig);
            }
        }
    }

    /// Stops the local server; it stays down until [`TestDb::restart`].
    pub fn stop(&mut self) {
        let server = self.server.as_mut().expect("stop needs a local server");
        if let Some(mut c) = server.child.take() {
            c.stop(libc::SIGQUIT, Duration::from_secs(5));
        }
    }
}

impl TestDb {
    /// `127.0.0.1:PORT` of the local server, `None` for an external one or
    /// a container.
    pub fn local_addr(&self) -> Option<String> {
        self.server.as_ref().map(|s| format!("127.0.0.1:{}", s.port))
    }

    /// Kills the local server with SIGKILL (a crash: nothing flushed,
    /// nothing sent to standbys); it stays down until [`TestDb::restart`].
    pub fn kill(&mut self) {
        let server = self.server.as_mut().expect("kill needs a local server");
        if let Some(mut c) = server.child.take() {
            // The backends and the WAL sender too: none may send one more
            // byte to a client or the standby after the "crash".
            c.signal_group(libc::SIGKILL);
            c.stop(libc::SIGKILL, Duration::from_secs(5));
        }
    }
}

fn replace_db(url: &str, db: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (url, None),
    };
    let scheme_end = base.find("://").map(|i| i + 3).unwrap_or(0);
    let base = match base[scheme_end..].find('/') {
        Some(i) => &base[..scheme_end + i],
        None => base,
    };
    match query {
        Some(q) => format!("{base}/{db}?{q}"),
        None => format!("{base}/{db}"),
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        if let Some((admin, name)) = self.external.take() {
            // Drop runs outside any runtime guarantee, so use a thread of our own.
            let _ = std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().ok()?;
                rt.block_on(async {
                    let mut conn = PgConnection::connect(&admin).await.ok()?;
                    conn.execute(format!("drop database if exists {name} with (force)").as_str()).await.ok()
                })
            })
            .join();
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn replace_db_keeps_credentials_and_query() {
        assert_eq!(
            super::replace_db("postgres://u:p@h:5/db?sslmode=disable", "t1"),
            "postgres://u:p@h:5/t1?sslmode=disable"
        );
        assert_eq!(super::replace_db("postgres://h", "t1"), "postgres://h/t1");
    }
}
