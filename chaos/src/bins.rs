//! The real `allocator` and `regional-agent` binaries the lab runs, built
//! with the same profile as `quota-lab` itself and found next to it.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Paths of the two service binaries.
#[derive(Debug, Clone)]
pub struct Bins {
    pub allocator: PathBuf,
    pub agent: PathBuf,
}

/// The directory holding `quota-lab` (`target/<profile>`); a test binary
/// lives one level deeper, in `deps/`.
pub fn profile_dir() -> Result<PathBuf, String> {
    let exe = std::env::current_exe().map_err(|e| format!("cannot locate quota-lab: {e}"))?;
    let mut dir = exe.parent().map(Path::to_path_buf).ok_or("quota-lab has no parent directory")?;
    if dir.file_name().is_some_and(|n| n == "deps") {
        dir.pop();
    }
    Ok(dir)
}

/// Builds the service binaries when run under cargo (a no-op when they are
/// fresh) and returns their paths.
pub fn ensure() -> Result<Bins, String> {
    let dir = profile_dir()?;
    let skip = std::env::var_os("QUOTA_LAB_NO_BUILD").is_some();
    if let (Some(cargo), false) = (std::env::var_os("CARGO"), skip) {
        let release = dir.file_name().is_some_and(|n| n == "release");
        let mut cmd = cargo_command(&cargo);
        cmd.args(["build", "--quiet", "-p", "chaos", "-p", "allocator", "-p", "regional-agent", "--bins"]);
        if release {
            cmd.arg("--release");
        }
        eprintln!(
            "lab: building allocator and regional-agent ({})",
            if release { "release" } else { "debug" }
        );
        let status = cmd.status().map_err(|e| format!("cannot run cargo build: {e}"))?;
        if !status.success() {
            return Err(format!("cargo build of the service binaries failed ({status})"));
        }
    }
    locate()
}

/// A `cargo` command without the variables cargo sets for the package it
/// runs (`CARGO_MANIFEST_DIR`, `CARGO_PKG_*`, ...: quota-lab runs under
/// `cargo run`, `cargo test` or `cargo lab`). Some build scripts track them
/// (ring's tracks `CARGO_MANIFEST_DIR`), so a nested build that inherits
/// them rebuilds ring, rustls and everything above, and the next plain
/// `cargo build` rebuilds them back.
pub fn cargo_command(cargo: &std::ffi::OsStr) -> Command {
    let mut cmd = Command::new(cargo);
    for (k, _) in std::env::vars_os() {
        if k.to_str().is_some_and(lab_launcher::choose::set_by_cargo_for_the_package) {
            cmd.env_remove(k);
        }
    }
    cmd
}

/// The service binaries next to this executable, without building them
/// (`cargo test --workspace` has built them already).
pub fn locate() -> Result<Bins, String> {
    let dir = profile_dir()?;
    let bins = Bins { allocator: dir.join("allocator"), agent: dir.join("regional-agent") };
    let release = if dir.file_name().is_some_and(|n| n == "release") { "--release " } else { "" };
    for b in [&bins.allocator, &bins.agent] {
        if !b.is_file() {
            return Err(format!(
                "{} not found; build it with `cargo build {release}-p allocator -p regional-agent`",
                b.display()
            ));
        }
    }
    Ok(bins)
}

/// What the lab needs from the machine that cargo cannot build: a
/// PostgreSQL and a Redis server (local binaries, env URLs or Docker);
/// `Err` names the missing packages and the command that installs them.
pub fn check_servers() -> Result<(), String> {
    crate::install::check_servers()
}
