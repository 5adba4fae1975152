//! A measuring benchmark needs optimised code.
//!
//! `cargo lab` (the launcher in `lab/`) runs quota-lab in the profile built
//! last, and always in release for a measuring benchmark (anything but
//! `--smoke`, which only checks that the harness runs). A debug quota-lab
//! started some other way refuses such a run rather than publish figures
//! of unoptimised code.

/// True when this run must not go on: a measuring benchmark in a binary
/// built without optimisations.
pub fn bench_needs_release(smoke: bool, optimised: bool) -> bool {
    !smoke && !optimised
}

/// Whether this binary was built with optimisations (the release profile).
pub fn optimised() -> bool {
    !cfg!(debug_assertions)
}

/// What a debug quota-lab says when asked for a measuring benchmark.
pub const USE_RELEASE: &str = "benchmarks measure the release build: run `cargo lab bench ...` \
                               (it builds and runs target/release/quota-lab), or --smoke to check the harness";

/// What a debug quota-lab says when asked for a game day with drill 2.
pub const GAMEDAY_USE_RELEASE: &str = "drill 2 (the hot-tenant flood) measures latency in the release build: run \
                                       `cargo lab gameday ...` (it builds and runs target/release/quota-lab), or \
                                       leave drill 2 out with --only";

#[cfg(test)]
mod tests {
    use super::bench_needs_release;

    #[test]
    fn only_a_measuring_bench_in_a_debug_build_is_refused() {
        // (smoke, optimised) -> refused?
        let table =
            [((false, false), true), ((true, false), false), ((false, true), false), ((true, true), false)];
        for ((smoke, optimised), want) in table {
            assert_eq!(bench_needs_release(smoke, optimised), want, "smoke={smoke} optimised={optimised}");
        }
    }
}
