//! `cargo lab chaos`: being written (issue 5).

use clap::Args;

/// Flags of `quota-lab chaos`.
#[derive(Debug, Args)]
pub struct ChaosArgs {
    /// `short` (small windows, CI) or `long` (soak).
    #[arg(long, default_value = "short")]
    pub profile: String,
    /// Runs only this scenario.
    #[arg(long)]
    pub scenario: Option<String>,
}

/// Runs the scenarios; `Ok(false)` when a verdict fails.
pub async fn run(_args: ChaosArgs) -> Result<bool, String> {
    Err("chaos is not written yet".into())
}
