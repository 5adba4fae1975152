//! Child processes owned by a test. [`Child`] kills its process when dropped
//! (including during a panic's unwinding), and the process also gets
//! SIGKILL from the kernel if the test thread that started it dies
//! (`PR_SET_PDEATHSIG`), so nothing outlives the test.

use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};

/// The unprivileged user servers run as when the tests run as root
/// (PostgreSQL refuses to run as root).
pub const NOBODY: (u32, u32) = (65534, 65534);

/// Whether this process runs as root.
pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// A running child process.
pub struct Child {
    inner: std::process::Child,
    name: String,
}

impl Child {
    /// Spawns `cmd` with output sent to `log` (a file path), as `user` when
    /// given, dying with the spawning thread.
    pub fn spawn(
        name: &str,
        mut cmd: Command,
        log: &std::path::Path,
        user: Option<(u32, u32)>,
    ) -> std::io::Result<Child> {
        let out = std::fs::File::create(log)?;
        let err = out.try_clone()?;
        cmd.stdin(Stdio::null()).stdout(out).stderr(err);
        if let Some((uid, gid)) = user {
            cmd.uid(uid).gid(gid);
        }
        // A process group of its own: Ctrl-C in a terminal reaches only the
        // owner, which then stops its children in order.
        cmd.process_group(0);
        // SAFETY: prctl is async-signal-safe; it runs after setuid, which
        // would otherwise clear the death signal.
        unsafe {
            cmd.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        Ok(Child { inner: cmd.spawn()?, name: name.to_string() })
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.inner.id()
    }

    /// Sends `sig` to the process.
    pub fn signal(&self, sig: i32) {
        // SAFETY: kill with a pid we own.
        unsafe {
            libc::kill(self.inner.id() as i32, sig);
        }
    }

    /// Sends `sig` to the process's whole group (it leads one of its own,
    /// see [`Child::spawn`]): the children a server forked die with it, as
    /// on a host that crashed.
    pub fn signal_group(&self, sig: i32) {
        // SAFETY: kill of a process group we created.
        unsafe {
            libc::kill(-(self.inner.id() as i32), sig);
        }
    }

    /// Whether the process has exited, with its status.
    pub fn try_wait(&mut self) -> Option<std::process::ExitStatus> {
        self.inner.try_wait().ok().flatten()
    }

    /// Sends `sig` and waits up to `timeout` for the exit; SIGKILL after.
    pub fn stop(&mut self, sig: i32, timeout: std::time::Duration) -> Option<std::process::ExitStatus> {
        if let Some(s) = self.try_wait() {
            return Some(s);
        }
        self.signal(sig);
        let every = std::time::Duration::from_millis(10);
        if let Ok(s) = crate::wait::poll_blocking(timeout, every, || self.try_wait().ok_or(())) {
            return Some(s);
        }
        let _ = self.inner.kill();
        self.inner.wait().ok()
    }

    /// The name given at spawn.
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        self.stop(libc::SIGKILL, std::time::Duration::from_secs(5));
    }
}

/// The processes whose parent is `parent`.
pub fn children_of(parent: i32) -> Vec<i32> {
    let mut pids = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else { continue };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else { continue };
        // Fields after the command name (which may hold spaces): state, ppid, ...
        let ppid = stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().nth(1));
        if ppid.and_then(|p| p.parse::<i32>().ok()) == Some(parent) {
            pids.push(pid);
        }
    }
    pids
}

/// Finds an executable on `PATH` or in the extra directories.
pub fn find_binary(name: &str, extra_dirs: &[std::path::PathBuf]) -> Option<std::path::PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path).chain(extra_dirs.iter().cloned()).map(|d| d.join(name)).find(|p| p.is_file())
}

/// Runs a command to completion, returning its stdout or a readable error.
pub fn run(mut cmd: Command) -> Result<String, String> {
    let out = cmd.output().map_err(|e| format!("{cmd:?}: {e}"))?;
    if !out.status.success() {
        return Err(format!("{cmd:?} failed: {}\n{}", out.status, String::from_utf8_lossy(&out.stderr)));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Whether a Docker engine answers (for the container fallback).
pub fn docker_available() -> bool {
    Command::new("docker")
        .args(["info", "--format", "{{.ServerVersion}}"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// A container removed when dropped.
pub struct Container {
    id: String,
}

impl Container {
    /// `docker run -d` of `image` with `args`, publishing `port` on a free
    /// loopback port; returns the container and that host port.
    pub fn run(image: &str, port: u16, args: &[&str]) -> Result<(Container, u16), String> {
        let mut cmd = Command::new("docker");
        cmd.args(["run", "-d", "--rm", "-p", &format!("127.0.0.1::{port}")]).args(args).arg(image);
        let id = run(cmd)?.trim().to_string();
        let c = Container { id };
        let mut cmd = Command::new("docker");
        cmd.args(["port", &c.id, &port.to_string()]);
        let mapping = run(cmd)?;
        let host_port = mapping
            .lines()
            .next()
            .and_then(|l| l.rsplit(':').next())
            .and_then(|p| p.trim().parse().ok())
            .ok_or_else(|| format!("cannot read the port mapping {mapping:?}"))?;
        Ok((c, host_port))
    }
}

impl Drop for Container {
    fn drop(&mut self) {
        let _ = Command::new("docker")
            .args(["rm", "-f", &self.id])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}
