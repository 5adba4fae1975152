//! `cargo lab demo` on a machine without the servers: the real quota-lab
//! binary, with a `PATH` on which neither `redis-server` nor `sudo` nor
//! `docker` can be found (only `apt-get`), and no `DATABASE_URL` /
//! `REDIS_URL`. Nothing is installed: the cases that may install (root,
//! with `--yes` or a "y" typed on a terminal) find a stand-in `apt-get`
//! that only records how it was called; the others must end in the printed
//! command. The decision itself is table-tested in `chaos::install`.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

const NOBODY: u32 = 65534;

/// A directory for `PATH` holding only `apt-get`, readable by everybody.
fn bare_path() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    if let Some(apt) = quota_tests::procs::find_binary("apt-get", &[]) {
        std::os::unix::fs::symlink(apt, dir.path().join("apt-get")).expect("symlink apt-get");
    }
    dir
}

/// `quota-lab demo <args>` with nothing but `PATH` in its environment and
/// stdin not a terminal, optionally run as `nobody` through `setpriv`.
fn demo(path: &Path, args: &[&str], as_nobody: Option<&PathBuf>) -> Output {
    let lab = env!("CARGO_BIN_EXE_quota-lab");
    let mut cmd = match as_nobody {
        Some(setpriv) => {
            let mut c = Command::new(setpriv);
            c.arg(format!("--reuid={NOBODY}"))
                .arg(format!("--regid={NOBODY}"))
                .arg("--clear-groups")
                .arg("--")
                .arg(lab);
            c
        }
        None => Command::new(lab),
    };
    cmd.arg("demo")
        .args(args)
        .env_clear()
        .env("PATH", path)
        .current_dir(path)
        .stdin(Stdio::null())
        .output()
        .expect("run quota-lab")
}

fn text(out: &Output) -> (String, String) {
    (String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// Checks the common part of every refusal: exit status 2, the missing
/// package named, the exact command, and no apt-get run.
fn assert_refused(out: &Output, sudo: &str) -> String {
    let (stdout, stderr) = text(out);
    assert_eq!(out.status.code(), Some(2), "stdout: {stdout}\nstderr: {stderr}");
    assert!(stderr.contains("missing server packages: "), "{stderr}");
    // Redis is never on this PATH; PostgreSQL may still be found in
    // /usr/lib/postgresql/*/bin, where the harness looks too.
    let line = stderr
        .lines()
        .map(str::trim)
        .find(|l| l.starts_with(&format!("{sudo}apt-get update && ")))
        .unwrap_or_else(|| panic!("no `{sudo}apt-get update && ...` line in: {stderr}"));
    let want = format!("{sudo}apt-get update && {sudo}apt-get install -y --no-install-recommends ");
    assert!(line.starts_with(&want), "{line}");
    assert!(line.ends_with("redis-server"), "{line}");
    assert!(!stderr.contains("lab: running"), "nothing may be installed here: {stderr}");
    stderr
}

#[test]
fn non_root_gets_the_command_with_sudo_even_with_yes() {
    let dir = bare_path();
    let out = if quota_tests::procs::is_root() {
        let Some(setpriv) = quota_tests::procs::find_binary("setpriv", &[]) else {
            eprintln!("skipped: running as root and no setpriv to drop to a non-root user");
            return;
        };
        // The binary must be reachable by nobody (a target directory under
        // a private home is not).
        let probe = Command::new(&setpriv)
            .args([format!("--reuid={NOBODY}"), format!("--regid={NOBODY}"), "--clear-groups".into()])
            .arg("--")
            .arg(env!("CARGO_BIN_EXE_quota-lab"))
            .arg("--help")
            .output()
            .expect("run setpriv");
        if !probe.status.success() {
            eprintln!("skipped: nobody cannot run quota-lab: {}", String::from_utf8_lossy(&probe.stderr));
            return;
        }
        demo(dir.path(), &["--yes"], Some(&setpriv))
    } else {
        // Not root: `sudo` is not on this PATH, so there is no passwordless sudo.
        demo(dir.path(), &["--yes"], None)
    };
    let stderr = assert_refused(&out, "sudo ");
    assert!(stderr.contains("not root and no passwordless sudo"), "{stderr}");
}

#[test]
fn without_a_terminal_or_yes_it_prints_the_command() {
    let dir = bare_path();
    let out = demo(dir.path(), &[], None);
    let root = quota_tests::procs::is_root();
    let stderr = assert_refused(&out, if root { "" } else { "sudo " });
    if root {
        let apt = dir.path().join("apt-get").exists();
        let why = if apt {
            "standard input is not a terminal to ask on, and --yes was not given"
        } else {
            "no apt-get"
        };
        assert!(stderr.contains(why), "{stderr}");
    }
}

/// A directory for `PATH` holding only a stand-in `apt-get` that appends
/// `DEBIAN_FRONTEND=<value> <args>` to `log` and succeeds.
fn recording_apt_get() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("tempdir");
    let log = dir.path().join("apt-get.log");
    let script = format!("#!/bin/sh\necho \"DEBIAN_FRONTEND=$DEBIAN_FRONTEND $*\" >> '{}'\n", log.display());
    let apt = dir.path().join("apt-get");
    std::fs::write(&apt, script).expect("write apt-get");
    std::fs::set_permissions(&apt, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    (dir, log)
}

/// The stand-in's record: `update`, then `install` of what was missing.
fn assert_installed(log: &Path, stderr: &str) {
    let log = std::fs::read_to_string(log).unwrap_or_else(|e| panic!("apt-get was not run ({e}): {stderr}"));
    let lines: Vec<&str> = log.lines().collect();
    assert_eq!(lines.len(), 2, "{log}");
    assert_eq!(lines[0], "DEBIAN_FRONTEND=noninteractive update");
    assert!(
        lines[1].starts_with("DEBIAN_FRONTEND=noninteractive install -y --no-install-recommends "),
        "{log}"
    );
    assert!(lines[1].ends_with(" redis-server"), "{log}");
    assert!(stderr.contains("lab: running apt-get update"), "progress is shown: {stderr}");
    // The stand-in installed nothing, so the lab says so and stops.
    assert!(stderr.contains("the lab still cannot find the server of: "), "{stderr}");
}

#[test]
fn root_with_yes_runs_apt_get_without_asking() {
    if !quota_tests::procs::is_root() {
        eprintln!(
            "skipped: not root (as non-root, without passwordless sudo, the lab only prints the command)"
        );
        return;
    }
    let (dir, log) = recording_apt_get();
    let out = demo(dir.path(), &["--yes"], None);
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(2), "stdout: {stdout}\nstderr: {stderr}");
    assert!(!stderr.contains("[y/N]"), "--yes does not ask: {stderr}");
    assert_installed(&log, &stderr);
}

/// `quota-lab demo` on a terminal (util-linux `script`), `answer` typed.
fn demo_on_a_terminal(path: &Path, answer: &str) -> Option<Output> {
    let script = quota_tests::procs::find_binary("script", &[])?;
    let mut child = Command::new(script)
        .arg("-qec")
        .arg(format!("{} demo", env!("CARGO_BIN_EXE_quota-lab")))
        .arg("/dev/null")
        .env_clear()
        .env("PATH", path)
        .env("SHELL", "/bin/sh")
        .current_dir(path)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run script");
    use std::io::Write as _;
    child.stdin.take().expect("stdin").write_all(answer.as_bytes()).expect("type the answer");
    Some(child.wait_with_output().expect("wait for script"))
}

#[test]
fn root_on_a_terminal_asks_and_installs_on_yes_only() {
    if !quota_tests::procs::is_root() {
        eprintln!("skipped: not root");
        return;
    }
    let (dir, log) = recording_apt_get();
    let Some(out) = demo_on_a_terminal(dir.path(), "n\n") else {
        eprintln!("skipped: no `script` (util-linux) to run the lab on a terminal");
        return;
    };
    // `script` puts the terminal's output, stderr included, on its stdout.
    let (tty, _) = text(&out);
    assert_eq!(out.status.code(), Some(2), "{tty}");
    assert!(tty.contains(" with apt-get? [y/N]"), "{tty}");
    assert!(tty.contains("not installing them, as answered"), "{tty}");
    assert!(tty.contains("apt-get update && apt-get install -y --no-install-recommends "), "{tty}");
    assert!(!log.exists(), "answered no, yet apt-get ran: {tty}");

    let out = demo_on_a_terminal(dir.path(), "y\n").expect("script");
    let (tty, _) = text(&out);
    assert_eq!(out.status.code(), Some(2), "{tty}");
    assert!(tty.contains(" with apt-get? [y/N]"), "{tty}");
    assert_installed(&log, &tty);
}

#[test]
fn help_tells_how_the_servers_get_installed() {
    let out = Command::new(env!("CARGO_BIN_EXE_quota-lab")).args(["demo", "--help"]).output().expect("run");
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{help}");
    for want in
        ["--yes", "apt-get install", "-y --no-install-recommends", "passwordless sudo", "exact command"]
    {
        assert!(help.contains(want), "`quota-lab demo --help` lacks {want:?}:\n{help}");
    }
}
