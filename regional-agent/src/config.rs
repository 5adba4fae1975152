//! Configuration: every flag is also an environment variable (DESIGN §5).

use crate::client::TlsFiles;
use clap::Parser;
pub use quota_shared::telemetry::LogFormat;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

/// The regional agent.
#[derive(Debug, Clone, Parser)]
#[command(name = "regional-agent", version, about)]
pub struct Config {
    /// Region this agent serves; every replica of a region shares one Redis. Required.
    #[arg(long, env = "AGENT_REGION")]
    pub region: Option<String>,

    /// This replica's id, unique within the region (e.g. eu-1). Required.
    #[arg(long, env = "AGENT_ID")]
    pub agent: Option<String>,

    /// Base URL of the allocator, e.g. http://allocator:7070. Required.
    #[arg(long, env = "ALLOCATOR_URL")]
    pub allocator: Option<String>,

    /// The region's Redis: redis://host:port, or a comma-separated list of
    /// Redis Cluster nodes. Required.
    #[arg(long, env = "REDIS_URL", hide_env_values = true)]
    pub redis: Option<String>,

    /// Treat a single --redis URL as a Redis Cluster seed node.
    #[arg(long, env = "AGENT_REDIS_CLUSTER", default_value_t = false)]
    pub redis_cluster: bool,

    /// Prefix of every Redis key (for regions sharing a server); must not contain braces.
    #[arg(long, env = "AGENT_REDIS_PREFIX", default_value = "")]
    pub redis_prefix: String,

    /// Address to serve the agent API on.
    #[arg(long, env = "AGENT_LISTEN", default_value = "127.0.0.1:7171")]
    pub listen: SocketAddr,

    /// Bearer token presented to the allocator.
    #[arg(long, env = "QUOTA_AGENT_TOKEN", hide_env_values = true)]
    pub agent_token: Option<String>,

    /// Tokens this agent alone may admit per quota and window while Redis is
    /// unreachable (counted in I6). 0 answers 503 store_unavailable instead.
    #[arg(long, env = "AGENT_LOCAL_FALLBACK_PER_AGENT", default_value_t = 0)]
    pub local_fallback_per_agent: i64,

    /// Renew-ahead horizon in ms: renew when the balance would run out, or a
    /// lease would expire, within this time (plus three measured round trips).
    #[arg(long, env = "AGENT_RENEW_AHEAD_MS", default_value_t = 500)]
    pub renew_ahead_ms: u64,

    /// Timeout of every allocator call, ms.
    #[arg(long, env = "AGENT_ALLOCATOR_TIMEOUT_MS", default_value_t = 1000)]
    pub allocator_timeout_ms: u64,

    /// Timeout of every Redis call, ms.
    #[arg(long, env = "AGENT_REDIS_TIMEOUT_MS", default_value_t = 500)]
    pub redis_timeout_ms: u64,

    /// Longest an acquire waits for a renewal in flight before answering, ms.
    #[arg(long, env = "AGENT_ACQUIRE_WAIT_MS", default_value_t = 300)]
    pub acquire_wait_ms: u64,

    /// How often the outbox is cut and drained, ms.
    #[arg(long, env = "AGENT_OUTBOX_INTERVAL_MS", default_value_t = 200)]
    pub outbox_interval_ms: u64,

    /// `text` or `json`.
    #[arg(long, env = "LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,

    /// For chaos tests only: shifts this agent's wall clock by this many ms
    /// (±), to show that skew cannot extend a lease (I2).
    #[arg(
        long,
        env = "AGENT_TEST_CLOCK_OFFSET_MS",
        default_value_t = 0,
        hide = true,
        allow_hyphen_values = true
    )]
    pub test_clock_offset_ms: i64,

    /// PEM file of CA certificates trusted for an https:// allocator, in
    /// addition to the system's trust roots.
    #[arg(long, env = "AGENT_ALLOCATOR_CA_FILE")]
    pub allocator_ca_file: Option<PathBuf>,

    /// PEM client certificate (chain) presented to the allocator (mTLS);
    /// needs --allocator-client-key.
    #[arg(long, env = "AGENT_ALLOCATOR_CLIENT_CERT")]
    pub allocator_client_cert: Option<PathBuf>,

    /// PEM private key of --allocator-client-cert.
    #[arg(long, env = "AGENT_ALLOCATOR_CLIENT_KEY")]
    pub allocator_client_key: Option<PathBuf>,
}

/// The validated settings the agent runs with.
#[derive(Debug, Clone)]
pub struct Settings {
    pub region: String,
    pub agent: String,
    pub allocator: String,
    pub redis: Vec<String>,
    pub redis_cluster: bool,
    pub redis_prefix: String,
    pub agent_token: Option<String>,
    pub local_fallback_per_agent: i64,
    pub renew_ahead: Duration,
    pub allocator_timeout: Duration,
    pub redis_timeout: Duration,
    pub acquire_wait: Duration,
    pub outbox_interval: Duration,
    pub test_clock_offset_ms: i64,
    /// TLS settings of the allocator link.
    pub allocator_tls: TlsFiles,
}

fn required(v: &Option<String>, flag: &str, env: &str) -> Result<String, String> {
    v.clone()
        .filter(|s| !s.trim().is_empty())
        .ok_or_else(|| format!("{env} is not set: pass --{flag} or set {env}"))
}

/// An empty path variable counts as not set.
fn path(p: &Option<PathBuf>) -> Option<PathBuf> {
    p.clone().filter(|p| !p.as_os_str().is_empty())
}

impl Config {
    /// The allocator link's TLS files; a certificate without its key (or
    /// the reverse) is an error naming both settings.
    fn allocator_tls(&self) -> Result<TlsFiles, String> {
        let client_cert = match (path(&self.allocator_client_cert), path(&self.allocator_client_key)) {
            (Some(c), Some(k)) => Some((c, k)),
            (None, None) => None,
            _ => {
                return Err(
                    "AGENT_ALLOCATOR_CLIENT_CERT and AGENT_ALLOCATOR_CLIENT_KEY must be set together \
                            (--allocator-client-cert, --allocator-client-key)"
                        .into(),
                )
            }
        };
        Ok(TlsFiles { ca_file: path(&self.allocator_ca_file), client_cert })
    }

    /// Checks the configuration, naming the setting that is missing or wrong.
    pub fn settings(&self) -> Result<Settings, String> {
        let region = required(&self.region, "region", "AGENT_REGION")?;
        let agent = required(&self.agent, "agent", "AGENT_ID")?;
        quota_shared::ids::validate_id(&region).map_err(|e| format!("AGENT_REGION {e}"))?;
        quota_shared::ids::validate_id(&agent).map_err(|e| format!("AGENT_ID {e}"))?;
        let allocator =
            required(&self.allocator, "allocator", "ALLOCATOR_URL")?.trim_end_matches('/').to_string();
        if !(allocator.starts_with("http://") || allocator.starts_with("https://")) {
            return Err(format!("ALLOCATOR_URL must be an http:// or https:// URL, got {allocator:?}"));
        }
        let redis: Vec<String> = required(&self.redis, "redis", "REDIS_URL")?
            .split(',')
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
            .collect();
        if self.redis_prefix.contains(['{', '}']) {
            return Err("AGENT_REDIS_PREFIX must not contain '{' or '}' (it would break the hash tag)".into());
        }
        if self.local_fallback_per_agent < 0 {
            return Err("--local-fallback-per-agent must be >= 0".into());
        }
        Ok(Settings {
            region,
            agent,
            allocator,
            redis_cluster: self.redis_cluster || redis.len() > 1,
            redis,
            redis_prefix: self.redis_prefix.clone(),
            agent_token: self.agent_token.clone().filter(|t| !t.is_empty()),
            local_fallback_per_agent: self.local_fallback_per_agent,
            renew_ahead: Duration::from_millis(self.renew_ahead_ms.max(1)),
            allocator_timeout: Duration::from_millis(self.allocator_timeout_ms.max(1)),
            redis_timeout: Duration::from_millis(self.redis_timeout_ms.max(1)),
            acquire_wait: Duration::from_millis(self.acquire_wait_ms),
            outbox_interval: Duration::from_millis(self.outbox_interval_ms.max(10)),
            test_clock_offset_ms: self.test_clock_offset_ms,
            allocator_tls: self.allocator_tls()?,
        })
    }
}
