//! `cargo lab ...` (the alias in `.cargo/config.toml`) runs this launcher,
//! which runs `quota-lab` in the build profile the developer has built
//! last, so the lab never forces a second whole-workspace compile:
//!
//! * after `cargo test --workspace` (CI, and most development) the dev
//!   build is the newer one, and the lab's build step is a no-op;
//! * after `cargo build --release --bins` the release one is, likewise;
//! * with neither, release (a first `cargo lab demo` on a fresh machine
//!   gets optimised services);
//! * a measuring benchmark (`bench` without `--smoke`) always runs the
//!   release build: figures must come from optimised code;
//! * `QUOTA_LAB_PROFILE=dev|release` overrides the choice (not a bench's).
//!
//! The launcher then builds the lab's package selection in that profile
//! (`-p chaos -p allocator -p regional-agent --bins`, the one quota-lab
//! itself asks for; fresh in about a second when nothing changed) and runs
//! `target/<profile>/quota-lab` with the same arguments and exit status.

use lab_launcher::choose::{self, Profile, Seen};
use std::path::PathBuf;
use std::process::{Command, ExitCode};
use std::time::SystemTime;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let target = target_dir();
    let built = |p: Profile| -> Option<SystemTime> {
        std::fs::metadata(target.join(p.dir()).join("quota-lab")).and_then(|m| m.modified()).ok()
    };
    let seen = Seen { dev: built(Profile::Dev), release: built(Profile::Release) };
    let wanted = std::env::var("QUOTA_LAB_PROFILE").ok();
    let profile = match choose::profile(&args, wanted.as_deref(), seen) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("cargo lab: {e}");
            return ExitCode::from(2);
        }
    };
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut build = Command::new(&cargo);
    package_env_removed(&mut build);
    build.args(["build", "-p", "chaos", "-p", "allocator", "-p", "regional-agent", "--bins"]);
    if profile == Profile::Release {
        build.arg("--release");
    }
    eprintln!("lab: {} build (see docs/ci.md)", profile.dir());
    match build.status() {
        Ok(s) if s.success() => {}
        Ok(s) => {
            eprintln!("cargo lab: building quota-lab failed ({s})");
            return ExitCode::from(2);
        }
        Err(e) => {
            eprintln!("cargo lab: cannot run cargo: {e}");
            return ExitCode::from(2);
        }
    }
    let exe = target.join(profile.dir()).join("quota-lab");
    let mut lab = Command::new(&exe);
    package_env_removed(&mut lab);
    match lab.args(&args).env("CARGO", &cargo).status() {
        Ok(s) => match s.code() {
            Some(0) => ExitCode::SUCCESS,
            Some(c) => ExitCode::from(u8::try_from(c).unwrap_or(1)),
            // Killed by a signal (Ctrl-C reaches both processes).
            None => ExitCode::from(1),
        },
        Err(e) => {
            eprintln!("cargo lab: cannot run {}: {e}", exe.display());
            ExitCode::from(2)
        }
    }
}

/// Drops what `cargo run` set for this launcher's package
/// (`CARGO_MANIFEST_DIR`, `CARGO_PKG_*`, ...) from `cmd`'s environment:
/// ring's build script tracks `CARGO_MANIFEST_DIR`, so a build that
/// inherits it rebuilds ring, rustls and every crate above, and the next
/// plain `cargo build` rebuilds them back. quota-lab builds too, so it gets
/// the same clean environment (chaos/src/bins.rs keeps the same rule).
fn package_env_removed(cmd: &mut Command) {
    for (k, _) in std::env::vars_os() {
        if k.to_str().is_some_and(choose::set_by_cargo_for_the_package) {
            cmd.env_remove(k);
        }
    }
}

/// Where cargo puts the builds: `CARGO_TARGET_DIR`, else the workspace's
/// `target/` (this crate sits one level below the workspace root).
fn target_dir() -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(d) => PathBuf::from(d),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..").join("target"),
    }
}
