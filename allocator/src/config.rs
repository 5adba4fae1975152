//! Configuration: every flag is also an environment variable (DESIGN §5).

use crate::tls::TlsFiles;
use clap::Parser;
use quota_shared::listen::{self, Limits};
pub use quota_shared::telemetry::LogFormat;
use std::net::SocketAddr;
use std::path::PathBuf;

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

    /// How many quotas `/metrics` shows per-window gauges for
    /// (`allocator_window_*`: the open and the previous window of the
    /// quotas with the most tokens granted in them); 0 turns them off.
    #[arg(long, env = "ALLOCATOR_WINDOW_METRICS_QUOTAS", default_value_t = 20)]
    pub window_metrics_quotas: u32,

    /// Rows per retention delete statement.
    #[arg(long, env = "ALLOCATOR_RETENTION_BATCH", default_value_t = 5000)]
    pub retention_batch: i64,

    /// Seconds the allocator waits after SIGTERM/SIGINT for in-flight
    /// requests before it exits anyway; a second signal exits at once.
    #[arg(long, env = "ALLOCATOR_SHUTDOWN_TIMEOUT_SECS", default_value_t = 10)]
    pub shutdown_timeout_secs: u64,

    /// Seconds a client has, from connecting (or from the first byte of its
    /// next request on a kept-alive connection), to send a request's
    /// headers (TLS handshakes count within it), and as long again for its
    /// body once they are in. Slower clients are disconnected.
    #[arg(long, env = "ALLOCATOR_HEADER_READ_TIMEOUT_SECS", default_value_t = listen::DEFAULT_HEADER_READ_TIMEOUT_SECS)]
    pub header_read_timeout_secs: u64,

    /// Seconds a kept-alive connection may wait for its next request
    /// (longer than the agents' 90 s idle pool, so they close first).
    #[arg(long, env = "ALLOCATOR_IDLE_TIMEOUT_SECS", default_value_t = listen::DEFAULT_IDLE_TIMEOUT_SECS)]
    pub idle_timeout_secs: u64,

    /// Most connections open at once. At the bound a new connection
    /// evicts the longest-idle one; when all are busy a reserved share
    /// (1/32, 1 to 64) serves /healthz and /readyz only, and beyond it new
    /// connections are closed at once. Lowered at start to fit the
    /// open-file limit.
    #[arg(long, env = "ALLOCATOR_MAX_CONNECTIONS", default_value_t = 4096)]
    pub max_connections: usize,

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

    /// PEM certificate chain to serve HTTPS with (needs --tls-key);
    /// reloaded when the file changes or on SIGHUP. Without it: plain HTTP.
    #[arg(long, env = "ALLOCATOR_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,

    /// PEM private key of --tls-cert.
    #[arg(long, env = "ALLOCATOR_TLS_KEY")]
    pub tls_key: Option<PathBuf>,

    /// PEM CA certificates; when given, every client must present a
    /// certificate signed by one of them (mTLS). A SAN `region:<r>` limits
    /// the connection to region r.
    #[arg(long, env = "ALLOCATOR_TLS_CLIENT_CA")]
    pub tls_client_ca: Option<PathBuf>,

    /// File of per-region agent tokens, one "region token" per line (`#`
    /// comments); a token acts only for its region. Re-read when it changes.
    #[arg(long, env = "QUOTA_AGENT_TOKENS_FILE")]
    pub agent_tokens_file: Option<PathBuf>,
}

/// An empty variable counts as not set.
fn non_empty(v: &Option<String>) -> Option<String> {
    v.clone().filter(|s| !s.trim().is_empty())
}

/// An empty path counts as not set.
fn path(p: &Option<PathBuf>) -> Option<PathBuf> {
    p.clone().filter(|p| !p.as_os_str().is_empty())
}

impl Config {
    /// The API listener's limits; a value out of range is an error naming
    /// its flag.
    pub fn limits(&self) -> Result<Limits, String> {
        Limits::validate(
            self.header_read_timeout_secs,
            self.idle_timeout_secs,
            self.max_connections,
            ["--header-read-timeout-secs", "--idle-timeout-secs", "--max-connections"],
        )
    }

    /// `QUOTA_AGENT_TOKEN`, unless empty.
    pub fn agent_token(&self) -> Option<String> {
        non_empty(&self.agent_token)
    }

    /// `QUOTA_ADMIN_TOKEN`, unless empty.
    pub fn admin_token(&self) -> Option<String> {
        non_empty(&self.admin_token)
    }

    /// `QUOTA_AGENT_TOKENS_FILE`, unless empty.
    pub fn agent_tokens_file(&self) -> Option<PathBuf> {
        path(&self.agent_tokens_file)
    }

    /// The TLS files, or `None` for plain HTTP; a certificate without its
    /// key (or a key or client CA without a certificate) is an error.
    pub fn tls_files(&self) -> Result<Option<TlsFiles>, String> {
        match (path(&self.tls_cert), path(&self.tls_key)) {
            (Some(cert), Some(key)) => Ok(Some(TlsFiles { cert, key, client_ca: path(&self.tls_client_ca) })),
            (None, None) if path(&self.tls_client_ca).is_none() => Ok(None),
            (None, None) => {
                Err("ALLOCATOR_TLS_CLIENT_CA needs ALLOCATOR_TLS_CERT and ALLOCATOR_TLS_KEY".into())
            }
            _ => Err("ALLOCATOR_TLS_CERT and ALLOCATOR_TLS_KEY must be set together (--tls-cert, --tls-key)"
                .into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listener_limits_out_of_range_are_errors_naming_the_flag() {
        for (flag, bad) in
            [("--header-read-timeout-secs", "0"), ("--idle-timeout-secs", "3601"), ("--max-connections", "3")]
        {
            let c = Config::try_parse_from(["allocator", flag, bad]).expect("flags parse");
            let e = c.limits().unwrap_err();
            assert!(e.contains(flag), "{flag} {bad}: {e}");
        }
        let c = Config::try_parse_from(["allocator"]).expect("flags parse");
        assert_eq!(c.limits().expect("defaults are valid").max_connections, 4096);
    }
}
