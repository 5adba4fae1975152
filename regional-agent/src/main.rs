//! The `regional-agent` binary: parse the configuration, set up logging and
//! serve until SIGTERM/SIGINT (then drain the outbox).

// The serve future nests the whole agent (see the crate root's limit).
#![recursion_limit = "256"]

use clap::Parser;
use regional_agent::config::Config;

#[tokio::main]
async fn main() {
    let config = Config::parse();
    regional_agent::init_tracing(config.log_format);
    if let Err(e) = regional_agent::serve(config).await {
        eprintln!("regional-agent: {e}");
        std::process::exit(2);
    }
}
