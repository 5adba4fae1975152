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

    /// Ledger events, leases, report records and gone agents older than
    /// this many hours are deleted in the background; report items of
    /// windows older than this are refused (422 report_expired). 0 keeps
    /// everything and refuses no window as too old.
    #[arg(long, env = "ALLOCATOR_RETENTION_HOURS", default_value_t = 168)]
    pub retention_hours: u64,

    /// Per-window summaries (pools and their region rows, which
    /// GET /v1/windows reads) of windows that ended more than this many
    /// hours ago are deleted; at least --retention-hours; 0 keeps them.
    #[arg(long, env = "ALLOCATOR_WINDOW_RETENTION_HOURS", default_value_t = 2160)]
    pub window_retention_hours: u64,

    /// Rows per retention delete statement.
    #[arg(long, env = "ALLOCATOR_RETENTION_BATCH", default_value_t = 5000)]
    pub retention_batch: i64,

    /// Seconds the allocator waits after SIGTERM/SIGINT for in-flight
    /// requests before it exits anyway; a second signal exits at once.
    #[arg(long, env = "ALLOCATOR_SHUTDOWN_TIMEOUT_SECS", default_value_t = 10)]
    pub shutdown_timeout_secs: u64,

    /// Tests only: shifts this replica's own clock by this many
    /// milliseconds, to show that no window decision reads it (they read
    /// the database's clock).
    #[arg(
        long,
        env = "ALLOCATOR_TEST_CLOCK_OFFSET_MS",
        default_value_t = 0,
        hide = true,
        allow_hyphen_values = true
    )]
    pub test_clock_offset_ms: i64,

    /// `text` or `json`.
    #[arg(long, env = "LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
}
