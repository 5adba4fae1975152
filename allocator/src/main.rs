//! The `allocator` binary: parse the configuration, set up logging, connect
//! to PostgreSQL (applying migrations) and serve until SIGTERM/SIGINT.

use allocator::config::Config;
use clap::Parser;

#[tokio::main]
async fn main() {
    let config = Config::parse();
    allocator::telemetry::init(config.log_format);
    if let Err(e) = allocator::serve(config).await {
        eprintln!("allocator: {e}");
        std::process::exit(2);
    }
}
