//! Servers the lab needs and cargo cannot build: PostgreSQL and Redis.
//!
//! When one is missing, `cargo lab demo` installs it with `apt-get` where
//! it can (root or passwordless sudo, `apt-get` present, and either `--yes`
//! or a "y" typed on a terminal), else it prints the exact command and
//! stops. [`decide`] is the whole decision, a pure function; the rest of
//! this module only looks at the machine and runs `apt-get`.

use quota_tests::procs::{docker_available, find_binary, is_root};
use std::io::{BufRead, IsTerminal, Write};
use std::path::PathBuf;
use std::process::{Command, Stdio};

/// The Debian/Ubuntu package with PostgreSQL's server binaries.
pub const PG_PACKAGE: &str = "postgresql";
/// The Debian/Ubuntu package with `redis-server`.
pub const REDIS_PACKAGE: &str = "redis-server";

/// What this machine allows, as far as installing packages goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Machine {
    /// The effective user is root.
    pub is_root: bool,
    /// `sudo -n true` succeeds.
    pub passwordless_sudo: bool,
    /// `apt-get` is on `PATH`.
    pub apt_get: bool,
    /// Standard input is a terminal, so a question can be answered.
    pub stdin_tty: bool,
}

/// Why the lab prints the command instead of running it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// Neither root nor passwordless sudo.
    NoPrivilege,
    /// No `apt-get`: not a Debian or Ubuntu machine.
    NoAptGet,
    /// Nobody to ask (stdin is not a terminal) and no `--yes`.
    NotAsked,
    /// The question was answered with something other than yes.
    Declined,
}

/// What to do about missing server packages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Nothing is missing.
    Nothing,
    /// Install now (`--yes`), through `sudo -n` when `sudo`.
    Install { sudo: bool },
    /// Ask on the terminal first, then install through `sudo -n` when `sudo`.
    Ask { sudo: bool },
    /// Print the command (with `sudo` unless root) and stop.
    PrintCommand { sudo: bool, why: Refusal },
}

/// The decision for `missing` packages on `machine`, `yes` being `--yes`.
pub fn decide(missing: &[&str], machine: Machine, yes: bool) -> Decision {
    if missing.is_empty() {
        return Decision::Nothing;
    }
    let sudo = !machine.is_root;
    if !machine.is_root && !machine.passwordless_sudo {
        return Decision::PrintCommand { sudo, why: Refusal::NoPrivilege };
    }
    if !machine.apt_get {
        return Decision::PrintCommand { sudo, why: Refusal::NoAptGet };
    }
    if yes {
        Decision::Install { sudo }
    } else if machine.stdin_tty {
        Decision::Ask { sudo }
    } else {
        Decision::PrintCommand { sudo, why: Refusal::NotAsked }
    }
}

/// Whether an answer to the question means yes (`y` or `yes`, any case).
pub fn is_yes(answer: &str) -> bool {
    matches!(answer.trim().to_ascii_lowercase().as_str(), "y" | "yes")
}

/// The question asked on a terminal.
pub fn question(missing: &[&str]) -> String {
    format!("Install {} with apt-get? [y/N] ", missing.join(" "))
}

/// The command a person runs to install `missing`, on one line.
pub fn command_line(missing: &[&str], sudo: bool) -> String {
    let s = if sudo { "sudo " } else { "" };
    format!("{s}apt-get update && {s}apt-get install -y --no-install-recommends {}", missing.join(" "))
}

/// The message printed (as the error) when the lab does not install.
pub fn refusal_message(missing: &[&str], sudo: bool, why: Refusal) -> String {
    let reason = match why {
        Refusal::NoPrivilege => "not root and no passwordless sudo, so the lab does not install them itself",
        Refusal::NoAptGet => {
            "no apt-get on this machine: the lab installs only with apt-get, on Debian or Ubuntu"
        }
        Refusal::NotAsked => "standard input is not a terminal to ask on, and --yes was not given",
        Refusal::Declined => "not installing them, as answered",
    };
    let how = match why {
        Refusal::NoAptGet => format!(
            "install {} with this system's package manager; on Debian or Ubuntu that is:\n    {}",
            missing.join(" and "),
            command_line(missing, sudo)
        ),
        _ => format!("run:\n    {}\n  then `cargo lab demo` again", command_line(missing, sudo)),
    };
    format!(
        "missing server packages: {} ({reason}).\n  {how}\n  (or `cargo lab demo --yes` as root or with \
         passwordless sudo; or point DATABASE_URL / REDIS_URL at running servers; or start a Docker engine)",
        missing.join(" ")
    )
}

/// PostgreSQL's server binaries, found where the test harness finds them:
/// on `PATH` or in `/usr/lib/postgresql/*/bin` (Debian does not put them
/// on `PATH`).
fn have_postgres() -> bool {
    let pg_dirs: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .map(|rd| rd.filter_map(|e| e.ok()).map(|e| e.path().join("bin")).collect())
        .unwrap_or_default();
    ["initdb", "pg_ctl", "postgres"].iter().all(|b| find_binary(b, &pg_dirs).is_some())
}

/// The packages whose servers the lab cannot find (nothing when
/// `DATABASE_URL` / `REDIS_URL` name servers, or a Docker engine answers).
pub fn missing_packages() -> Vec<&'static str> {
    let have_pg = std::env::var_os("DATABASE_URL").is_some() || have_postgres();
    let have_redis = std::env::var_os("REDIS_URL").is_some() || find_binary("redis-server", &[]).is_some();
    let mut missing = Vec::new();
    if !have_pg {
        missing.push(PG_PACKAGE);
    }
    if !have_redis {
        missing.push(REDIS_PACKAGE);
    }
    if !missing.is_empty() && docker_available() {
        // The harness runs containers instead.
        return Vec::new();
    }
    missing
}

/// The Debian packages of the highly available PostgreSQL the Patroni
/// scenarios run (issue 34), with the commands each provides.
pub const HA_PACKAGES: &[(&str, &[&str])] = &[
    ("patroni", &["patroni", "patronictl"]),
    ("etcd-server", &["etcd"]),
    ("etcd-client", &["etcdctl"]),
    ("haproxy", &["haproxy"]),
];

/// The HA packages some command of which `have` does not find.
pub fn missing_ha_packages_with(have: impl Fn(&str) -> bool) -> Vec<&'static str> {
    HA_PACKAGES.iter().filter(|(_, cmds)| !cmds.iter().all(|c| have(c))).map(|(p, _)| *p).collect()
}

/// For the scenarios on Patroni (`postgres-failover`, ...): `Err` with the
/// exact install command when patroni, etcd or haproxy is missing (the
/// harness looks on `PATH`, HAProxy also in /usr/sbin).
pub fn check_ha_packages() -> Result<(), String> {
    let sbin = [PathBuf::from("/usr/sbin"), PathBuf::from("/usr/local/sbin")];
    let missing = missing_ha_packages_with(|c| find_binary(c, &sbin).is_some());
    if missing.is_empty() {
        return Ok(());
    }
    Err(format!(
        "the PostgreSQL HA scenarios need {}.\n  run:\n    {}",
        missing.join(" "),
        command_line(&missing, !is_root())
    ))
}

/// This machine, looked at.
pub fn this_machine() -> Machine {
    let is_root = is_root();
    let passwordless_sudo = !is_root
        && Command::new("sudo")
            .args(["-n", "true"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
    Machine {
        is_root,
        passwordless_sudo,
        apt_get: find_binary("apt-get", &[]).is_some(),
        stdin_tty: std::io::stdin().is_terminal(),
    }
}

/// Runs `apt-get` (through `sudo -n` when `sudo`), its output shown as it goes.
fn apt_get(sudo: bool, args: &[&str]) -> Result<(), String> {
    let mut cmd = if sudo {
        let mut c = Command::new("sudo");
        c.args(["-n", "DEBIAN_FRONTEND=noninteractive", "apt-get"]);
        c
    } else {
        let mut c = Command::new("apt-get");
        c.env("DEBIAN_FRONTEND", "noninteractive");
        c
    };
    cmd.args(args).stdin(Stdio::null());
    let shown = format!("{}apt-get {}", if sudo { "sudo " } else { "" }, args.join(" "));
    eprintln!("lab: running {shown}");
    let status = cmd.status().map_err(|e| format!("cannot run {shown}: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("{shown} failed ({status})"))
    }
}

/// Installs the missing server packages, or explains how; `Err` carries
/// the message (with the exact command) when the lab should stop.
pub fn ensure_servers(yes: bool) -> Result<(), String> {
    let missing = missing_packages();
    let sudo = match decide(&missing, this_machine(), yes) {
        Decision::Nothing => return Ok(()),
        Decision::PrintCommand { sudo, why } => return Err(refusal_message(&missing, sudo, why)),
        Decision::Install { sudo } => sudo,
        Decision::Ask { sudo } => {
            eprint!("lab: no {} found.\n{}", missing.join(" or "), question(&missing));
            let _ = std::io::stderr().flush();
            let mut answer = String::new();
            let _ = std::io::stdin().lock().read_line(&mut answer);
            if !is_yes(&answer) {
                return Err(refusal_message(&missing, sudo, Refusal::Declined));
            }
            sudo
        }
    };
    eprintln!("lab: installing {} with apt-get", missing.join(" "));
    let mut install = vec!["install", "-y", "--no-install-recommends"];
    install.extend(&missing);
    apt_get(sudo, &["update"])
        .and_then(|()| apt_get(sudo, &install))
        .map_err(|e| format!("{e}\n  to install by hand, run:\n    {}", command_line(&missing, sudo)))?;
    let still = missing_packages();
    if !still.is_empty() {
        return Err(format!(
            "apt-get installed {}, but the lab still cannot find the server of: {}",
            missing.join(" "),
            still.join(" ")
        ));
    }
    eprintln!("lab: installed {}", missing.join(" "));
    Ok(())
}

/// For the lab's other commands: `Err` with the exact command when a
/// server is missing; installs nothing (only `cargo lab demo` does).
pub fn check_servers() -> Result<(), String> {
    let missing = missing_packages();
    if missing.is_empty() {
        return Ok(());
    }
    Err(format!(
        "missing server packages: {}.\n  run:\n    {}\n  (or `cargo lab demo --yes`, which installs them as root or \
         with passwordless sudo; or point DATABASE_URL / REDIS_URL at running servers; or start a Docker engine)",
        missing.join(" "),
        command_line(&missing, !is_root())
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    const BOTH: &[&str] = &[PG_PACKAGE, REDIS_PACKAGE];

    fn m(is_root: bool, passwordless_sudo: bool, apt_get: bool, stdin_tty: bool) -> Machine {
        Machine { is_root, passwordless_sudo, apt_get, stdin_tty }
    }

    /// (missing, root, passwordless sudo, apt-get, tty, --yes, decision)
    type Case = (&'static [&'static str], bool, bool, bool, bool, bool, Decision);

    #[test]
    fn decision_table() {
        use Decision::*;
        use Refusal::*;
        // (missing, root, passwordless sudo, apt-get, tty, --yes) → decision
        let cases: &[Case] = &[
            // Nothing missing: nothing to do, whatever the machine.
            (&[], false, false, false, false, false, Nothing),
            (&[], true, false, true, true, true, Nothing),
            // Root with apt-get.
            (BOTH, true, false, true, true, false, Ask { sudo: false }),
            (BOTH, true, false, true, true, true, Install { sudo: false }),
            (BOTH, true, false, true, false, true, Install { sudo: false }),
            (BOTH, true, false, true, false, false, PrintCommand { sudo: false, why: NotAsked }),
            // Root without apt-get.
            (BOTH, true, false, false, true, true, PrintCommand { sudo: false, why: NoAptGet }),
            (BOTH, true, false, false, false, false, PrintCommand { sudo: false, why: NoAptGet }),
            // Passwordless sudo with apt-get.
            (&[REDIS_PACKAGE], false, true, true, true, false, Ask { sudo: true }),
            (&[REDIS_PACKAGE], false, true, true, true, true, Install { sudo: true }),
            (&[PG_PACKAGE], false, true, true, false, true, Install { sudo: true }),
            (&[PG_PACKAGE], false, true, true, false, false, PrintCommand { sudo: true, why: NotAsked }),
            // Passwordless sudo without apt-get.
            (BOTH, false, true, false, true, true, PrintCommand { sudo: true, why: NoAptGet }),
            // Neither root nor passwordless sudo: never installs, not even with --yes.
            (BOTH, false, false, true, true, true, PrintCommand { sudo: true, why: NoPrivilege }),
            (BOTH, false, false, true, true, false, PrintCommand { sudo: true, why: NoPrivilege }),
            (BOTH, false, false, true, false, true, PrintCommand { sudo: true, why: NoPrivilege }),
            (BOTH, false, false, false, false, false, PrintCommand { sudo: true, why: NoPrivilege }),
        ];
        for (missing, root, sudo, apt, tty, yes, want) in cases {
            let got = decide(missing, m(*root, *sudo, *apt, *tty), *yes);
            assert_eq!(
                &got, want,
                "missing {missing:?} root {root} sudo {sudo} apt-get {apt} tty {tty} --yes {yes}"
            );
        }
    }

    #[test]
    fn ha_packages_are_named_by_the_commands_they_provide() {
        assert!(missing_ha_packages_with(|_| true).is_empty());
        assert_eq!(missing_ha_packages_with(|_| false), ["patroni", "etcd-server", "etcd-client", "haproxy"]);
        // patronictl without patroni's daemon still means the package.
        assert_eq!(
            missing_ha_packages_with(|c| c != "patroni" && c != "etcdctl"),
            ["patroni", "etcd-client"]
        );
    }

    #[test]
    fn answers() {
        for a in ["y", "Y", "yes", "YES", " y\n", "Yes\r\n"] {
            assert!(is_yes(a), "{a:?} is yes");
        }
        for a in ["", "\n", "n", "no", "N", "yep", "sure", "y y"] {
            assert!(!is_yes(a), "{a:?} is not yes");
        }
    }

    #[test]
    fn the_question_and_the_command() {
        assert_eq!(question(BOTH), "Install postgresql redis-server with apt-get? [y/N] ");
        assert_eq!(
            command_line(BOTH, true),
            "sudo apt-get update && sudo apt-get install -y --no-install-recommends postgresql redis-server"
        );
        assert_eq!(
            command_line(&[REDIS_PACKAGE], false),
            "apt-get update && apt-get install -y --no-install-recommends redis-server"
        );
    }

    #[test]
    fn every_refusal_prints_the_exact_command() {
        for why in [Refusal::NoPrivilege, Refusal::NoAptGet, Refusal::NotAsked, Refusal::Declined] {
            for sudo in [false, true] {
                let msg = refusal_message(BOTH, sudo, why);
                assert!(msg.contains(&command_line(BOTH, sudo)), "{why:?}: {msg}");
                assert!(msg.starts_with("missing server packages: postgresql redis-server ("), "{msg}");
            }
        }
    }
}
