//! The `limitador` peer as a child process: `quota-lab bench` builds the
//! `limitador-peer` binary on first use (with the `limitador-peer` feature,
//! which compiles RocksDB: minutes, once) and runs it once per repetition,
//! so the peer is measured in the same run, interleaved with the agent,
//! while no other command or test pays for that build.

use super::hist::Sample;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

/// A peer run may take this much longer than its measuring time (process
/// start, Redis connection, script load) before it is killed.
const PEER_OVERHEAD: Duration = Duration::from_secs(30);

/// A built peer binary.
pub struct Peer {
    exe: PathBuf,
}

impl Peer {
    /// Builds (when run under cargo) and finds the peer binary, or says why
    /// there is none, naming what to install.
    pub fn ensure(progress: &dyn Fn(&str)) -> Result<Peer, String> {
        let dir = crate::bins::profile_dir()?;
        let exe = dir.join("limitador-peer");
        let skip = std::env::var_os("QUOTA_LAB_NO_BUILD").is_some();
        if let (Some(cargo), false) = (std::env::var_os("CARGO"), skip) {
            let release = dir.file_name().is_some_and(|n| n == "release");
            progress("peer: building limitador-peer (the first build compiles RocksDB, several minutes)");
            let mut cmd = crate::bins::cargo_command(&cargo);
            cmd.args([
                "build",
                "--quiet",
                "-p",
                "chaos",
                "--features",
                "limitador-peer",
                "--bin",
                "limitador-peer",
            ]);
            if release {
                cmd.arg("--release");
            }
            let out = cmd
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .output()
                .map_err(|e| format!("cannot run cargo build: {e}"))?;
            if !out.status.success() {
                let err = String::from_utf8_lossy(&out.stderr);
                let hint = if err.contains("libclang") {
                    " (RocksDB's bindgen needs libclang: install `libclang-dev`)"
                } else {
                    ""
                };
                let tail: Vec<&str> = err.lines().rev().take(6).collect();
                return Err(format!(
                    "building limitador-peer failed{hint}: {}",
                    tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
                ));
            }
        }
        if !exe.is_file() {
            return Err(format!(
                "{} not found; build it with `cargo build --release -p chaos --features limitador-peer --bin limitador-peer`",
                exe.display()
            ));
        }
        Ok(Peer { exe })
    }

    /// One closed-loop run of the peer against `redis_url`.
    pub async fn measure(&self, redis_url: &str, clients: usize, dur: Duration) -> Result<Sample, String> {
        let mut cmd = tokio::process::Command::new(&self.exe);
        cmd.args(["--redis", redis_url, "--clients", &clients.to_string()])
            .args(["--millis", &dur.as_millis().to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let child = cmd.spawn().map_err(|e| format!("cannot start {}: {e}", self.exe.display()))?;
        let out = tokio::time::timeout(dur + PEER_OVERHEAD, child.wait_with_output())
            .await
            .map_err(|_| format!("limitador-peer did not finish within {:?}", dur + PEER_OVERHEAD))?
            .map_err(|e| format!("limitador-peer: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "limitador-peer exited with {}: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        serde_json::from_slice(&out.stdout).map_err(|e| format!("limitador-peer output: {e}"))
    }
}
