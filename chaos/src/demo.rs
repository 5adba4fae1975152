//! `cargo lab demo`: being written (issue 7).

use clap::Args;

/// Flags of `quota-lab demo`.
#[derive(Debug, Args)]
pub struct DemoArgs {
    /// How long the demo runs, in seconds.
    #[arg(long, default_value_t = 90)]
    pub duration: u64,
}

/// Runs the demo; `Ok(false)` when a window broke its bound.
pub async fn run(_args: DemoArgs) -> Result<bool, String> {
    Err("demo is not written yet".into())
}
