//! Which build profile a lab command runs in.
//!
//! `cargo lab` runs the dev build, the one `cargo test --workspace` has
//! just made: the demo and the chaos scenarios check bounds and accounting,
//! not speed, and sharing that build spares every developer and CI run a
//! second, release compile of the whole workspace. A benchmark that
//! measures (anything but `--smoke`, which only checks that the harness
//! runs) must time optimised code, so a debug `quota-lab` hands such a run
//! to `cargo run --release` of itself, with the same arguments.

use std::ffi::OsString;
use std::process::{Command, ExitCode};

/// True when this run must be handed to a release build: a measuring
/// benchmark in a binary built without optimisations.
pub fn bench_needs_release(smoke: bool, optimised: bool) -> bool {
    !smoke && !optimised
}

/// Whether this binary was built with optimisations (the release profile).
pub fn optimised() -> bool {
    !cfg!(debug_assertions)
}

/// Runs `cargo run --release` of `quota-lab` with `args` (this run's
/// arguments after the program name) and returns its exit status. Needs to
/// be run under cargo (`cargo lab ...` sets `CARGO`); otherwise says how.
pub fn rerun_in_release(args: impl IntoIterator<Item = OsString>) -> ExitCode {
    let Some(cargo) = std::env::var_os("CARGO") else {
        eprintln!(
            "quota-lab: benchmarks measure the release build; run `cargo lab bench ...`, or \
             `cargo build --release -p chaos` and target/release/quota-lab"
        );
        return ExitCode::from(2);
    };
    eprintln!("lab: benchmarks measure the release build: cargo run --release -p chaos --bin quota-lab");
    let status = Command::new(cargo)
        .args(["run", "--quiet", "--release", "-p", "chaos", "--bin", "quota-lab", "--"])
        .args(args)
        .status();
    match status {
        Ok(s) if s.success() => ExitCode::SUCCESS,
        Ok(s) => ExitCode::from(s.code().and_then(|c| u8::try_from(c).ok()).unwrap_or(1)),
        Err(e) => {
            eprintln!("quota-lab: cannot run cargo: {e}");
            ExitCode::from(2)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::bench_needs_release;

    #[test]
    fn only_a_measuring_bench_in_a_debug_build_moves_to_release() {
        // (smoke, optimised) -> hand over?
        let table =
            [((false, false), true), ((true, false), false), ((false, true), false), ((true, true), false)];
        for ((smoke, optimised), want) in table {
            assert_eq!(bench_needs_release(smoke, optimised), want, "smoke={smoke} optimised={optimised}");
        }
    }
}
