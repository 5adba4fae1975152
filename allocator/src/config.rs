//! Configuration: every flag is also an environment variable (DESIGN §5).

use clap::Parser;
pub use quota_shared::telemetry::LogFormat;
use std::net::SocketAddr;

/// The central allocator.
#[derive(Debug, Clone, Parser)]
#[command(name = "allocator", version, about)]
pub struct Config {
    /// Address to serve the HTTP API on.
    #[arg(long, env = "ALLOCATOR_LISTEN", default_value = "127.0.0.1:7070")]
    pub listen: SocketAddr,

    /// PostgreSQL URL, e.g. postgres://quota@db/quota. Required.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    pub database_url: Option<String>,

    /// Bearer token agents present on /v1/agents, /v1/grants, /v1/leases/*/release and /v1/reports.
    #[arg(long, env = "QUOTA_AGENT_TOKEN", hide_env_values = true)]
    pub agent_token: Option<String>,

    /// Bearer token for policy writes and operator reads.
    #[arg(long, env = "QUOTA_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,

    /// Most PostgreSQL connections this replica opens.
    #[arg(long, env = "ALLOCATOR_DB_MAX_CONNECTIONS", default_value_t = 16)]
    pub db_max_connections: u32,

    /// Ledger events and leases older than this many hours are deleted in
    /// the background (per-window summaries stay); 0 keeps everything.
    #[arg(long, env = "ALLOCATOR_RETENTION_HOURS", default_value_t = 168)]
    pub retention_hours: u64,

    /// Rows per retention delete statement.
    #[arg(long, env = "ALLOCATOR_RETENTION_BATCH", default_value_t = 5000)]
    pub retention_batch: i64,

    /// `text` or `json`.
    #[arg(long, env = "LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
}
