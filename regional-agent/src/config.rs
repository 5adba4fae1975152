//! Configuration: every flag is also an environment variable (DESIGN §5).

use crate::client::TlsFiles;
use clap::Parser;
use quota_shared::listen::{self, Limits};
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

    /// The region's Redis: redis://host:port (rediss:// for TLS), or a
    /// comma-separated list of Redis Cluster nodes. Required unless
    /// --redis-sentinel and --redis-master are given; with them, only its
    /// scheme, user, password and database number are used (the primary's
    /// address comes from Sentinel).
    #[arg(long, env = "REDIS_URL", hide_env_values = true)]
    pub redis: Option<String>,

    /// Redis Sentinel nodes watching the region's primary, `host:port[,host:port...]`
    /// (`rediss://host:port,...` to reach the Sentinels over TLS; the primary
    /// then too, unless REDIS_URL says redis://).
    /// The agent asks them for the current primary and asks again after a
    /// connection error, a timeout or a READONLY answer (a failover).
    /// Goes with --redis-master.
    #[arg(long, env = "AGENT_REDIS_SENTINEL")]
    pub redis_sentinel: Option<String>,

    /// Name of the primary the Sentinels monitor (`sentinel monitor NAME ...`).
    /// Goes with --redis-sentinel.
    #[arg(long, env = "AGENT_REDIS_MASTER")]
    pub redis_master: Option<String>,

    /// How often the agent reads the Redis server's maxmemory-policy and
    /// evicted_keys, ms (any policy but noeviction stops admission).
    #[arg(long, env = "AGENT_REDIS_POLICY_CHECK_MS", default_value_t = 5000)]
    pub redis_policy_check_ms: u64,

    /// Treat a single --redis URL as a Redis Cluster seed node.
    #[arg(long, env = "AGENT_REDIS_CLUSTER", default_value_t = false)]
    pub redis_cluster: bool,

    /// Prefix of every Redis key (for regions sharing a server); must not contain braces.
    #[arg(long, env = "AGENT_REDIS_PREFIX", default_value = "")]
    pub redis_prefix: String,

    /// Redis key layout: `tenant` (a tenant's quotas share one Cluster
    /// slot, so one decision may span several of them) or `legacy` (one
    /// slot per quota, as agents before multi-quota decisions wrote; for
    /// rehearsing or rolling back an upgrade). See docs/deploying.md,
    /// "Upgrading".
    #[arg(long, env = "AGENT_KEY_LAYOUT", value_enum, default_value_t = KeyLayout::Tenant)]
    pub key_layout: KeyLayout,

    /// Address to serve Envoy's rate limit service (gRPC RLS v3) and the
    /// gRPC health service on; off when not given.
    #[arg(long, env = "AGENT_GRPC_LISTEN")]
    pub grpc_listen: Option<SocketAddr>,

    /// The descriptor entry key that names the quota (RLS).
    #[arg(long, env = "AGENT_RLS_RESOURCE_KEY", default_value = "resource")]
    pub rls_resource_key: String,

    /// The descriptor entry key that names the per-key principal (RLS).
    #[arg(long, env = "AGENT_RLS_KEY_ENTRY", default_value = "user")]
    pub rls_key_entry: String,

    /// RLS answers carry RateLimit, RateLimit-Policy and Retry-After for
    /// Envoy to add to the response.
    #[arg(long, env = "AGENT_RLS_HEADERS", default_value_t = false)]
    pub rls_headers: bool,

    /// Seconds a client has, from connecting (or from the first byte of its
    /// next request on a kept-alive connection), to send a request's
    /// headers (and as long again for its body once they are in), on the
    /// HTTP port; on the gRPC port, to send the HTTP/2 connection preface.
    /// Slower clients are disconnected.
    #[arg(long, env = "AGENT_HEADER_READ_TIMEOUT_SECS", default_value_t = listen::DEFAULT_HEADER_READ_TIMEOUT_SECS)]
    pub header_read_timeout_secs: u64,

    /// Seconds a connection may stay without a request (HTTP: between
    /// kept-alive requests; gRPC: without receiving a byte) before it is
    /// closed.
    #[arg(long, env = "AGENT_IDLE_TIMEOUT_SECS", default_value_t = listen::DEFAULT_IDLE_TIMEOUT_SECS)]
    pub idle_timeout_secs: u64,

    /// Most connections open at once on the HTTP port. At the bound a new
    /// connection evicts the longest-idle one; when all are busy a
    /// reserved share (1/32, 1 to 64) serves /healthz and /readyz only, and
    /// beyond it new connections are closed at once. Lowered at start (with
    /// --grpc-max-connections) to fit the open-file limit.
    #[arg(long, env = "AGENT_MAX_CONNECTIONS", default_value_t = 1024)]
    pub max_connections: usize,

    /// Most connections open at once on the gRPC port; beyond it new
    /// connections are closed at once.
    #[arg(long, env = "AGENT_GRPC_MAX_CONNECTIONS", default_value_t = 256)]
    pub grpc_max_connections: usize,

    /// Most concurrent HTTP/2 streams (RLS calls) per gRPC connection
    /// (advertised as SETTINGS_MAX_CONCURRENT_STREAMS and enforced).
    #[arg(long, env = "AGENT_GRPC_MAX_STREAMS_PER_CONNECTION", default_value_t = 1024)]
    pub grpc_max_streams_per_connection: u32,

    /// Threads serving the gRPC port, each a single-threaded runtime that
    /// owns the connections handed to it (in turn) and a Redis connection
    /// of its own; 0 means one per CPU, at most 4.
    #[arg(long, env = "AGENT_GRPC_THREADS", default_value_t = 0)]
    pub grpc_threads: usize,

    /// Adds up to one second, at random, to every `Retry-After` (and
    /// `retry_after_s`), so clients refused together come back spread over
    /// two seconds instead of in one wave (seed 002 F26; `cargo lab
    /// gameday --only 3` measures both). `false` answers the bare wait.
    #[arg(long, env = "AGENT_RETRY_AFTER_JITTER", default_value_t = true, action = clap::ArgAction::Set)]
    pub retry_after_jitter: bool,

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

    /// Decisions in flight at which this agent starts shedding by
    /// priority (`503 shed`): priority 4 at this line, 3 at 1.25x, 2 at
    /// 1.5x; 0 and 1 never. 0 turns the count off.
    #[arg(long, env = "AGENT_SHED_IN_FLIGHT", default_value_t = 512)]
    pub shed_in_flight: usize,

    /// Spend-script latency (a moving average over the last second) at
    /// which this agent sheds by priority as for `--shed-in-flight`, ms;
    /// 0 (the default) turns it off: a slow store is already bounded by
    /// `--redis-timeout-ms`.
    #[arg(long, env = "AGENT_SHED_STORE_LATENCY_MS", default_value_t = 0)]
    pub shed_store_latency_ms: u64,

    /// Age past which a policy this agent could not refresh (no grant
    /// answer for the quota while the allocator is unreachable) is stale,
    /// seconds: the policy's `on_stale` then decides (`keep` enforcing it,
    /// or `fail_mode`). 0: policies never go stale.
    #[arg(long, env = "AGENT_MAX_POLICY_AGE_SECS", default_value_t = 3600)]
    pub max_policy_age_secs: u64,

    /// How often the outbox is cut and drained, ms.
    #[arg(long, env = "AGENT_OUTBOX_INTERVAL_MS", default_value_t = 200)]
    pub outbox_interval_ms: u64,

    /// How often the agent sends its status (epoch, reachability, outbox
    /// depth, dead letters, per quota its mode and 429/503 counts) to the
    /// allocator's fleet pages, ms; 0 sends none.
    #[arg(long, env = "AGENT_STATUS_INTERVAL_MS", default_value_t = 2000)]
    pub status_interval_ms: u64,

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

    /// PEM file of the CA certificates that sign the region's Redis (and
    /// Sentinel) server certificates, for rediss:// URLs. Replaces the
    /// system's trust roots on that link: a public CA has no business
    /// vouching for a private Redis.
    #[arg(long, env = "AGENT_REDIS_CA_FILE")]
    pub redis_ca_file: Option<PathBuf>,

    /// PEM client certificate (chain) presented to Redis and Sentinel over
    /// TLS (`tls-auth-clients yes`); needs --redis-client-key.
    #[arg(long, env = "AGENT_REDIS_CLIENT_CERT")]
    pub redis_client_cert: Option<PathBuf>,

    /// PEM private key of --redis-client-cert.
    #[arg(long, env = "AGENT_REDIS_CLIENT_KEY")]
    pub redis_client_key: Option<PathBuf>,
}

/// The validated settings the agent runs with.
#[derive(Debug, Clone)]
pub struct Settings {
    pub region: String,
    pub agent: String,
    pub allocator: String,
    /// Redis URLs: one server, cluster seed nodes, or (with `sentinel`) at
    /// most one URL whose credentials are used on the primary.
    pub redis: Vec<String>,
    pub redis_cluster: bool,
    /// The Sentinels and the primary's name, when the region's Redis is
    /// found through Sentinel.
    pub sentinel: Option<SentinelSettings>,
    /// Period of the eviction policy check.
    pub redis_policy_check: Duration,
    pub redis_prefix: String,
    pub key_layout: crate::keys::Layout,
    pub grpc_listen: Option<SocketAddr>,
    pub rls: RlsMapping,
    /// The HTTP port's limits.
    pub http_limits: Limits,
    /// The gRPC port's (the same timeouts, its own bound).
    pub grpc_limits: Limits,
    /// Concurrent streams per gRPC connection.
    pub grpc_max_streams: u32,
    /// Threads serving the gRPC port (at least 1).
    pub grpc_threads: usize,
    pub agent_token: Option<String>,
    pub local_fallback_per_agent: i64,
    pub renew_ahead: Duration,
    pub allocator_timeout: Duration,
    pub redis_timeout: Duration,
    pub acquire_wait: Duration,
    /// Decisions in flight that start shedding (0: off).
    pub shed_in_flight: usize,
    /// Spend latency that starts shedding (zero: off).
    pub shed_store_latency: Duration,
    /// `None`: policies never go stale (`--max-policy-age-secs 0`).
    pub max_policy_age: Option<Duration>,
    pub outbox_interval: Duration,
    /// `None`: no status is sent (`--status-interval-ms 0`).
    pub status_interval: Option<Duration>,
    pub test_clock_offset_ms: i64,
    /// TLS settings of the allocator link.
    pub allocator_tls: TlsFiles,
    /// TLS files of the Redis link (used only with rediss:// URLs; given
    /// without one, they are a configuration error).
    pub redis_tls: TlsFiles,
}

/// Where to find the region's primary through Sentinel.
#[derive(Debug, Clone, PartialEq)]
pub struct SentinelSettings {
    /// Sentinel addresses, `(host, port)`.
    pub nodes: Vec<(String, u16)>,
    /// The monitored primary's name.
    pub master: String,
    /// The Sentinels are reached over TLS (`rediss://` entries).
    pub tls: bool,
}

/// The scheme prefixes a Redis address may carry.
const PLAIN: &str = "redis://";
const TLS: &str = "rediss://";

/// Whether the entries of `--redis-sentinel` name TLS Sentinels: all
/// `rediss://` (true) or none (false); a mix is an error.
pub fn sentinels_use_tls(list: &str) -> Result<bool, String> {
    let entries: Vec<&str> = list.split(',').map(str::trim).filter(|s| !s.is_empty()).collect();
    let tls = entries.iter().filter(|e| e.starts_with(TLS)).count();
    match tls {
        0 => Ok(false),
        n if n == entries.len() => Ok(true),
        _ => Err("AGENT_REDIS_SENTINEL mixes rediss:// and plain entries: use one scheme for every Sentinel"
            .into()),
    }
}

/// Parses `host:port[,host:port...]` (IPv6 hosts in brackets).
pub fn parse_sentinels(list: &str) -> Result<Vec<(String, u16)>, String> {
    let mut nodes = Vec::new();
    for item in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let bare = item.strip_prefix(TLS).or_else(|| item.strip_prefix(PLAIN)).unwrap_or(item);
        let (host, port) = bare
            .rsplit_once(':')
            .ok_or_else(|| format!("AGENT_REDIS_SENTINEL entry {item:?} is not host:port"))?;
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let port: u16 = port
            .parse()
            .ok()
            .filter(|p| *p > 0)
            .ok_or_else(|| format!("AGENT_REDIS_SENTINEL entry {item:?} has no valid port"))?;
        if host.is_empty() || host.contains('/') {
            return Err(format!("AGENT_REDIS_SENTINEL entry {item:?} is not host:port"));
        }
        nodes.push((host.to_string(), port));
    }
    if nodes.is_empty() {
        return Err("AGENT_REDIS_SENTINEL is empty: give host:port[,host:port...]".into());
    }
    Ok(nodes)
}

fn required(v: &Option<String>, flag: &str, env: &str) -> Result<String, String> {
    v.clone()
        .filter(|s| !s.trim().is_empty())
        .ok_or_else(|| format!("{env} is not set: pass --{flag} or set {env}"))
}

/// `--grpc-threads` resolved: 0 is one per CPU the process may use, at
/// most [`DEFAULT_GRPC_THREADS_MAX`].
fn grpc_threads(asked: usize) -> usize {
    match asked {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()).min(DEFAULT_GRPC_THREADS_MAX),
        n => n,
    }
}

/// An empty path variable counts as not set.
fn path(p: &Option<PathBuf>) -> Option<PathBuf> {
    p.clone().filter(|p| !p.as_os_str().is_empty())
}

/// Largest `--grpc-max-streams-per-connection`.
const MAX_STREAMS: u32 = 65_536;
/// Largest `--grpc-threads`.
const MAX_GRPC_THREADS: usize = 64;
/// Most gRPC threads the default starts: a sidecar's Envoy has a few
/// workers (a connection each), and each thread holds a Redis connection.
const DEFAULT_GRPC_THREADS_MAX: usize = 4;
/// Largest `--max-policy-age-secs` (30 days): a larger age is `0`'s
/// "never" by another name.
const MAX_POLICY_AGE_SECS: u64 = 30 * 86_400;

impl Config {
    /// Both ports' limits; a value out of range is an error naming its flag.
    fn limits(&self) -> Result<(Limits, Limits), String> {
        let http = Limits::validate(
            self.header_read_timeout_secs,
            self.idle_timeout_secs,
            self.max_connections,
            ["--header-read-timeout-secs", "--idle-timeout-secs", "--max-connections"],
        )?;
        let grpc = listen::connections(self.grpc_max_connections, "--grpc-max-connections")?;
        Ok((http, Limits { max_connections: grpc, ..http }))
    }

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

    /// The Redis link's TLS files, checked the same way.
    fn redis_tls(&self) -> Result<TlsFiles, String> {
        let client_cert = match (path(&self.redis_client_cert), path(&self.redis_client_key)) {
            (Some(c), Some(k)) => Some((c, k)),
            (None, None) => None,
            _ => {
                return Err("AGENT_REDIS_CLIENT_CERT and AGENT_REDIS_CLIENT_KEY must be set together \
                            (--redis-client-cert, --redis-client-key)"
                    .into())
            }
        };
        Ok(TlsFiles { ca_file: path(&self.redis_ca_file), client_cert })
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
        let given = |v: &Option<String>| v.as_deref().is_some_and(|s| !s.trim().is_empty());
        let sentinel = match (given(&self.redis_sentinel), given(&self.redis_master)) {
            (true, true) => Some(SentinelSettings {
                nodes: parse_sentinels(self.redis_sentinel.as_deref().unwrap_or_default())?,
                master: self.redis_master.as_deref().unwrap_or_default().trim().to_string(),
                tls: sentinels_use_tls(self.redis_sentinel.as_deref().unwrap_or_default())?,
            }),
            (true, false) => {
                return Err("AGENT_REDIS_MASTER is not set: --redis-sentinel needs --redis-master NAME \
                    (the name the Sentinels monitor)"
                    .into())
            }
            (false, true) => {
                return Err("AGENT_REDIS_SENTINEL is not set: --redis-master needs --redis-sentinel \
                    host:port[,host:port...]"
                    .into())
            }
            (false, false) => None,
        };
        let redis: Vec<String> = match &sentinel {
            Some(_) => self.redis.clone().filter(|s| !s.trim().is_empty()).into_iter().collect(),
            None => required(&self.redis, "redis", "REDIS_URL")?
                .split(',')
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty())
                .collect(),
        };
        if sentinel.is_some() && (self.redis_cluster || redis.iter().any(|u| u.contains(','))) {
            return Err("AGENT_REDIS_SENTINEL cannot be combined with a Redis Cluster (REDIS_URL list or \
                AGENT_REDIS_CLUSTER): Sentinel serves one primary"
                .into());
        }
        let redis_tls = self.redis_tls()?;
        let tls_urls = redis.iter().filter(|u| u.starts_with(TLS)).count();
        if tls_urls > 0 && tls_urls < redis.len() {
            return Err("REDIS_URL mixes rediss:// and redis:// nodes: use one scheme for every node".into());
        }
        let tls_anywhere = tls_urls > 0 || sentinel.as_ref().is_some_and(|s| s.tls);
        if !tls_anywhere && (redis_tls.ca_file.is_some() || redis_tls.client_cert.is_some()) {
            // A CA file next to a plain URL means the operator expects
            // encryption the agent would not provide: refuse, do not ignore.
            return Err("AGENT_REDIS_CA_FILE / AGENT_REDIS_CLIENT_CERT are set but no Redis address is \
                rediss://: use rediss:// in REDIS_URL (or AGENT_REDIS_SENTINEL) for TLS"
                .into());
        }
        if self.redis_prefix.contains(['{', '}']) {
            return Err("AGENT_REDIS_PREFIX must not contain '{' or '}' (it would break the hash tag)".into());
        }
        if self.rls_resource_key.is_empty()
            || self.rls_key_entry.is_empty()
            || self.rls_resource_key == self.rls_key_entry
        {
            return Err("--rls-resource-key and --rls-key-entry must be two different non-empty keys".into());
        }
        if self.max_policy_age_secs > MAX_POLICY_AGE_SECS {
            return Err(format!(
                "--max-policy-age-secs must be at most {MAX_POLICY_AGE_SECS} (30 days), got {}",
                self.max_policy_age_secs
            ));
        }
        if self.local_fallback_per_agent < 0 {
            return Err("--local-fallback-per-agent must be >= 0".into());
        }
        let (http_limits, grpc_limits) = self.limits()?;
        if !(1..=MAX_STREAMS).contains(&self.grpc_max_streams_per_connection) {
            return Err(format!(
                "--grpc-max-streams-per-connection must be between 1 and {MAX_STREAMS}, got {}",
                self.grpc_max_streams_per_connection
            ));
        }
        if self.grpc_threads > MAX_GRPC_THREADS {
            return Err(format!(
                "--grpc-threads must be between 0 (one per CPU) and {MAX_GRPC_THREADS}, got {}",
                self.grpc_threads
            ));
        }
        Ok(Settings {
            http_limits,
            grpc_limits,
            grpc_max_streams: self.grpc_max_streams_per_connection,
            grpc_threads: grpc_threads(self.grpc_threads),
            region,
            agent,
            allocator,
            redis_cluster: sentinel.is_none() && (self.redis_cluster || redis.len() > 1),
            redis,
            sentinel,
            redis_policy_check: Duration::from_millis(self.redis_policy_check_ms.max(50)),
            redis_prefix: self.redis_prefix.clone(),
            grpc_listen: self.grpc_listen,
            rls: RlsMapping {
                resource_key: self.rls_resource_key.clone(),
                key_entry: self.rls_key_entry.clone(),
                headers: self.rls_headers,
            },
            key_layout: match self.key_layout {
                KeyLayout::Tenant => crate::keys::Layout::Tenant,
                KeyLayout::Legacy => crate::keys::Layout::Legacy,
            },
            agent_token: self.agent_token.clone().filter(|t| !t.is_empty()),
            local_fallback_per_agent: self.local_fallback_per_agent,
            renew_ahead: Duration::from_millis(self.renew_ahead_ms.max(1)),
            allocator_timeout: Duration::from_millis(self.allocator_timeout_ms.max(1)),
            redis_timeout: Duration::from_millis(self.redis_timeout_ms.max(1)),
            acquire_wait: Duration::from_millis(self.acquire_wait_ms),
            shed_in_flight: self.shed_in_flight,
            shed_store_latency: Duration::from_millis(self.shed_store_latency_ms),
            max_policy_age: (self.max_policy_age_secs > 0)
                .then(|| Duration::from_secs(self.max_policy_age_secs)),
            outbox_interval: Duration::from_millis(self.outbox_interval_ms.max(10)),
            status_interval: (self.status_interval_ms > 0)
                .then(|| Duration::from_millis(self.status_interval_ms.max(100))),
            test_clock_offset_ms: self.test_clock_offset_ms,
            allocator_tls: self.allocator_tls()?,
            redis_tls,
        })
    }
}

/// How RLS descriptors map to quotas (`--rls-*` flags, see `crate::rls`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RlsMapping {
    /// The descriptor entry key that names the quota.
    pub resource_key: String,
    /// The descriptor entry key that names the per-key principal.
    pub key_entry: String,
    /// Whether answers carry `RateLimit`, `RateLimit-Policy`, `Retry-After`.
    pub headers: bool,
}

/// `--key-layout`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum KeyLayout {
    Tenant,
    Legacy,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(args: &[&str]) -> Config {
        let mut all =
            vec!["regional-agent", "--region", "eu", "--agent", "eu-1", "--allocator", "http://a:1"];
        all.extend_from_slice(args);
        Config::try_parse_from(all).expect("flags parse")
    }

    #[test]
    fn sentinel_replaces_redis_url() {
        let s = config(&["--redis-sentinel", "127.0.0.1:26379, [::1]:26380", "--redis-master", "m"])
            .settings()
            .expect("valid");
        let sentinel = s.sentinel.expect("sentinel settings");
        assert_eq!(sentinel.nodes, vec![("127.0.0.1".to_string(), 26379), ("::1".to_string(), 26380)]);
        assert_eq!(sentinel.master, "m");
        assert!(!s.redis_cluster);
        if std::env::var_os("REDIS_URL").is_none() {
            assert!(s.redis.is_empty());
        }
    }

    #[test]
    fn one_sentinel_flag_alone_is_a_config_error_naming_the_other() {
        let e = config(&["--redis-sentinel", "127.0.0.1:26379"]).settings().unwrap_err();
        assert!(e.contains("AGENT_REDIS_MASTER"), "{e}");
        let e = config(&["--redis-master", "m", "--redis", "redis://x:1"]).settings().unwrap_err();
        assert!(e.contains("AGENT_REDIS_SENTINEL"), "{e}");
    }

    #[test]
    fn without_sentinel_redis_url_is_required() {
        if std::env::var_os("REDIS_URL").is_some() {
            return; // the environment supplies it
        }
        let e = config(&[]).settings().unwrap_err();
        assert!(e.contains("REDIS_URL"), "{e}");
    }

    #[test]
    fn sentinel_entries_must_be_host_and_port() {
        for bad in ["", "host", "host:0", "host:x", ":1", "redis://h:1/0"] {
            assert!(parse_sentinels(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn sentinel_and_cluster_do_not_combine() {
        let e =
            config(&["--redis-sentinel", "h:1", "--redis-master", "m", "--redis", "redis://a:1,redis://b:2"])
                .settings()
                .unwrap_err();
        assert!(e.contains("Cluster"), "{e}");
    }

    #[test]
    fn rediss_urls_and_tls_sentinels_are_recognised() {
        let s = config(&["--redis", "rediss://a:1", "--redis-ca-file", "/ca.pem"]).settings().expect("valid");
        assert_eq!(s.redis_tls.ca_file.as_deref(), Some(std::path::Path::new("/ca.pem")));
        let s = config(&["--redis-sentinel", "rediss://127.0.0.1:26379,rediss://h:2", "--redis-master", "m"])
            .settings()
            .expect("valid");
        let sentinel = s.sentinel.expect("sentinel");
        assert!(sentinel.tls);
        assert_eq!(sentinel.nodes, vec![("127.0.0.1".to_string(), 26379), ("h".to_string(), 2)]);
    }

    #[test]
    fn redis_tls_files_without_a_rediss_address_are_a_config_error() {
        let e = config(&["--redis", "redis://a:1", "--redis-ca-file", "/ca.pem"]).settings().unwrap_err();
        assert!(e.contains("AGENT_REDIS_CA_FILE") && e.contains("rediss://"), "{e}");
    }

    #[test]
    fn a_redis_client_certificate_needs_its_key() {
        let e = config(&["--redis", "rediss://a:1", "--redis-client-cert", "/c.pem"]).settings().unwrap_err();
        assert!(e.contains("AGENT_REDIS_CLIENT_KEY"), "{e}");
    }

    #[test]
    fn listener_limits_out_of_range_are_errors_naming_the_flag() {
        let base = ["--redis", "redis://a:1"];
        for (flag, bad) in [
            ("--header-read-timeout-secs", "0"),
            ("--idle-timeout-secs", "0"),
            ("--idle-timeout-secs", "3601"),
            ("--max-connections", "2"),
            ("--grpc-max-connections", "0"),
            ("--grpc-max-streams-per-connection", "0"),
            ("--grpc-threads", "65"),
        ] {
            let mut args = base.to_vec();
            args.extend([flag, bad]);
            let e = config(&args).settings().unwrap_err();
            assert!(e.contains(flag), "{flag} {bad}: {e}");
        }
        let s = config(&base).settings().expect("defaults are valid");
        assert_eq!(s.http_limits.max_connections, 1024);
        assert_eq!(s.grpc_limits.max_connections, 256);
        assert_eq!(s.grpc_limits.header_read_timeout, s.http_limits.header_read_timeout);
        assert!((1..=DEFAULT_GRPC_THREADS_MAX).contains(&s.grpc_threads), "{}", s.grpc_threads);
        let two = config(&["--redis", "redis://a:1", "--grpc-threads", "2"]).settings().unwrap();
        assert_eq!(two.grpc_threads, 2);
    }

    #[test]
    fn mixed_schemes_are_a_config_error() {
        let e = config(&["--redis", "rediss://a:1,redis://b:2"]).settings().unwrap_err();
        assert!(e.contains("mixes"), "{e}");
        let e =
            config(&["--redis-sentinel", "rediss://a:1,b:2", "--redis-master", "m"]).settings().unwrap_err();
        assert!(e.contains("mixes"), "{e}");
    }
}
