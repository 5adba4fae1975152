//! Shared set-up of the agent tests: PostgreSQL, the allocator in process,
//! one Redis per region, agents as real processes.

#![allow(dead_code)]

use quota_tests::agent::{AgentOpts, AgentProc};
use quota_tests::app::{Options, TestAllocator};
use quota_tests::clock::TestClock;
use quota_tests::fixtures::{put_policy, Stack};
use quota_tests::http::{Http, Resp};
use quota_tests::redis::TestRedis;
use quota_tests::redis_cluster::TestRedisCluster;
use regional_agent::keys::Keys;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

/// The agent binary Cargo built for these tests.
pub fn bin() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_regional-agent"))
}

/// PostgreSQL, the allocator and one Redis.
pub struct World {
    pub stack: Stack,
    pub redis: TestRedis,
    /// A local Redis Cluster the agents use instead of `redis` when set.
    pub cluster: Option<TestRedisCluster>,
    /// The clock the allocator and every agent read windows from.
    pub clock: TestClock,
}

impl World {
    pub async fn start() -> World {
        World::start_with_redis(TestRedis::start()).await
    }

    /// PostgreSQL, the allocator and the given Redis (e.g. one started with
    /// extra arguments).
    pub async fn start_with_redis(redis: TestRedis) -> World {
        World { stack: Stack::start().await, redis, cluster: None, clock: TestClock::real() }
    }

    /// PostgreSQL, the allocator and one Redis on a clock whose next
    /// boundary of `secs`-second windows comes `lead` after they are up
    /// (the time the test needs to reach it); every agent started by
    /// [`World::agent`] follows that clock. See `quota_tests::clock`.
    pub async fn start_clocked(secs: i64, lead: Duration) -> World {
        let db = quota_tests::pg::TestDb::start().await;
        let redis = TestRedis::start();
        // Picked once the slow start-ups are done, so the lead is the test's.
        let clock = TestClock::boundary_in(secs, lead);
        let opts = Options { clock: Some(clock.shared()), ..Default::default() };
        let alloc = TestAllocator::spawn_with(&db.url, opts).await;
        let http = Http::new(&alloc.base);
        World { stack: Stack { db, alloc, http }, redis, cluster: None, clock }
    }

    /// PostgreSQL, the allocator and a local 3-master Redis Cluster the
    /// agents are pointed at (as a comma-separated node list).
    pub async fn start_cluster() -> World {
        let cluster = tokio::task::spawn_blocking(TestRedisCluster::start).await.expect("cluster start");
        World {
            stack: Stack::start().await,
            redis: TestRedis::start(),
            cluster: Some(cluster),
            clock: TestClock::real(),
        }
    }

    /// The `--redis` the agents get.
    pub fn redis_url(&self) -> &str {
        self.cluster.as_ref().map_or(&self.redis.url, |c| &c.url)
    }

    /// Writes a policy.
    pub async fn policy(&self, tenant: &str, resource: &str, body: Value) -> Value {
        put_policy(&self.stack.http, tenant, resource, body).await
    }

    /// Starts an agent of `region` talking to `allocator` (default: the real
    /// one), on the world's clock unless `env` shifts it otherwise.
    pub async fn agent(
        &self,
        region: &str,
        agent: &str,
        allocator: Option<&str>,
        env: &[(&str, &str)],
    ) -> AgentProc {
        let mut opts =
            AgentOpts::new(region, agent, allocator.unwrap_or(&self.stack.alloc.base), self.redis_url());
        if self.clock.offset_ms() != 0 {
            opts.env.push(self.clock.agent_env(0));
        }
        opts.env.extend(env.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        AgentProc::spawn(bin(), opts).await
    }

    /// Whole tokens in `key`'s bucket of atlas/`resource`, read from Redis.
    pub async fn bucket_tokens(&self, resource: &str, key: &str) -> Option<i64> {
        let name = Keys::per_key_bucket(&Keys::new("").quota("atlas", resource), key);
        let client = redis::Client::open(self.redis_url()).expect("redis url");
        let mut conn = client.get_multiplexed_async_connection().await.expect("redis");
        let t: Option<String> =
            redis::cmd("HGET").arg(&name).arg("t").query_async(&mut conn).await.expect("HGET");
        t.map(|t| t.parse::<i64>().expect("micro-tokens") / 1_000_000)
    }

    /// Waits until the allocator counts `want` consumed on atlas/`resource`
    /// over all its windows (20 s at most).
    pub async fn wait_consumed(&self, resource: &str, want: i64) {
        let r = quota_tests::wait::poll(Duration::from_secs(20), Duration::from_millis(100), || async {
            let got: i64 = self
                .windows("atlas", resource)
                .await
                .iter()
                .map(|x| x["consumed"].as_i64().unwrap_or(0))
                .sum();
            if got == want {
                Ok(())
            } else {
                Err(got)
            }
        })
        .await;
        assert_eq!(r, Ok(()), "allocator consumed of {resource}");
    }

    /// The allocator's per-window accounting of a quota.
    pub async fn windows(&self, tenant: &str, resource: &str) -> Vec<Value> {
        let r = self.stack.http.get(&format!("/v1/windows/{tenant}/{resource}")).await.expect(200);
        r.body["windows"].as_array().cloned().unwrap_or_default()
    }

    /// Σ admitted per window start (RFC 3339) from the allocator.
    pub async fn admitted_by_window(&self, tenant: &str, resource: &str) -> BTreeMap<String, (i64, i64)> {
        self.windows(tenant, resource)
            .await
            .iter()
            .filter(|w| {
                w["consumed"].as_i64().unwrap_or(0) + w["fallback_admitted"].as_i64().unwrap_or(0) > 0
            })
            .map(|w| {
                (
                    norm(w["window_start"].as_str().unwrap_or_default()),
                    (w["consumed"].as_i64().unwrap_or(0), w["fallback_admitted"].as_i64().unwrap_or(0)),
                )
            })
            .collect()
    }

    /// Waits until the allocator's accounting equals `expected` exactly.
    pub async fn wait_accounting(
        &self,
        tenant: &str,
        resource: &str,
        expected: &BTreeMap<String, (i64, i64)>,
    ) {
        let matched =
            quota_tests::wait::poll(Duration::from_secs(20), Duration::from_millis(50), || async move {
                let got = self.admitted_by_window(tenant, resource).await;
                if &got == expected {
                    Ok(())
                } else {
                    Err(got)
                }
            })
            .await;
        if let Err(last) = matched {
            panic!("allocator accounting {last:?} never matched the client-side counts {expected:?}");
        }
    }
}

/// RFC 3339 normalised through chrono.
pub fn norm(s: &str) -> String {
    chrono::DateTime::parse_from_rfc3339(s)
        .map(|d| d.with_timezone(&chrono::Utc).to_rfc3339())
        .unwrap_or_default()
}

/// One acquire.
pub async fn acquire(http: &Http, tenant: &str, resource: &str) -> Resp {
    http.post("/v1/acquire", &json!({"tenant": tenant, "resource": resource})).await
}

/// Client-side tally of 200s per window and source.
#[derive(Debug, Default, Clone)]
pub struct Tally {
    /// window start → (lease, fallback)
    pub by_window: BTreeMap<String, (i64, i64)>,
    pub statuses: BTreeMap<(u16, String), i64>,
}

impl Tally {
    pub fn add(&mut self, r: &Resp) {
        *self.statuses.entry((r.status, r.error().to_string())).or_default() += 1;
        if r.status == 200 {
            let ws = norm(r.body["window_start"].as_str().unwrap_or_default());
            let e = self.by_window.entry(ws).or_default();
            match r.body["source"].as_str() {
                Some("fallback") => e.1 += 1,
                _ => e.0 += 1,
            }
        }
    }

    pub fn merge(&mut self, o: &Tally) {
        for (k, v) in &o.by_window {
            let e = self.by_window.entry(k.clone()).or_default();
            e.0 += v.0;
            e.1 += v.1;
        }
        for (k, v) in &o.statuses {
            *self.statuses.entry(k.clone()).or_default() += v;
        }
    }

    pub fn admitted(&self) -> i64 {
        self.by_window.values().map(|(a, b)| a + b).sum()
    }

    pub fn fallback(&self) -> i64 {
        self.by_window.values().map(|(_, b)| b).sum()
    }

    pub fn count(&self, status: u16, code: &str) -> i64 {
        self.statuses.get(&(status, code.to_string())).copied().unwrap_or(0)
    }
}

/// Asks until `times` refusals in a row (20 ms apart, so that leases in
/// flight settle) and returns every answer, in order: the loop each client
/// of the concurrency tests runs until its pool is spent.
pub async fn until_refused<T, F, Fut>(times: u32, mut ask: F, admitted: impl Fn(&T) -> bool) -> Vec<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = T>,
{
    let mut answers = Vec::new();
    let mut refused = 0;
    while refused < times {
        let answer = ask().await;
        if admitted(&answer) {
            refused = 0;
        } else {
            refused += 1;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        answers.push(answer);
    }
    answers
}

/// Two quotas of `atlas` for the all-or-nothing tests: `catalog` (1,000)
/// and `search` (40, exhausted first), both strict, per hour.
pub async fn catalog_and_search(w: &World) {
    w.policy("atlas", "catalog", json!({"limit": 1000, "window_secs": 3600, "fail_mode": "strict"})).await;
    w.policy(
        "atlas",
        "search",
        json!({"limit": 40, "window_secs": 3600, "fail_mode": "strict", "chunk_max": 7}),
    )
    .await;
}

/// I5: two replicas of region `eu`, 64 concurrent clients until the pool of
/// 600 is exhausted: exactly as many 200s as tokens the allocator granted to
/// the region (net of returns), none spent twice, and the allocator's
/// accounting equals the client-side counts.
pub async fn i5_two_replicas_64_clients(w: &World) {
    w.policy("atlas", "write", json!({"limit": 600, "window_secs": 3600, "fail_mode": "strict"})).await;
    let a = w.agent("eu", "eu-1", None, &[]).await;
    let b = w.agent("eu", "eu-2", None, &[]).await;
    let mut tasks = Vec::new();
    for i in 0..64 {
        let http = if i % 2 == 0 { a.http.clone() } else { b.http.clone() };
        tasks.push(tokio::spawn(async move {
            let mut t = Tally::default();
            for r in until_refused(5, || acquire(&http, "atlas", "write"), |r| r.status == 200).await {
                t.add(&r);
                if r.status != 200 {
                    assert_eq!((r.status, r.error()), (429, "quota_exhausted"), "{}", r.body);
                    assert!(r
                        .header("retry-after")
                        .and_then(|v| v.parse::<i64>().ok())
                        .is_some_and(|s| s >= 1));
                }
            }
            t
        }));
    }
    let mut tally = Tally::default();
    for t in tasks {
        tally.merge(&t.await.unwrap());
    }
    let windows = w.windows("atlas", "write").await;
    let win = windows.iter().find(|w| w["granted"].as_i64().unwrap_or(0) > 0).expect("a window with grants");
    let eu = &win["regions"]["eu"];
    let net = eu["granted"].as_i64().unwrap() - eu["returned"].as_i64().unwrap();
    assert_eq!(net, 600, "the pool is exhausted by the region: {win}");
    assert_eq!(tally.admitted(), net, "200s must equal tokens granted: {tally:?}");
    w.wait_accounting("atlas", "write", &tally.by_window).await;
}

/// Several quotas in one decision under concurrency: two replicas of `eu`,
/// 16 clients asking for one `catalog` token and one `search` token at a
/// time, until `search` (40 tokens, strict) is exhausted while `catalog`
/// (1,000) is not. No answer may debit one quota without the other: the
/// allocator counts exactly the 200s on both, and the refusals name
/// `search` and debit nothing (the `catalog` count would drift above
/// `search`'s).
pub async fn multi_quota_all_or_nothing(w: &World) {
    catalog_and_search(w).await;
    let a = w.agent("eu", "eu-1", None, &[]).await;
    let b = w.agent("eu", "eu-2", None, &[]).await;
    let body = json!({"tenant": "atlas", "resources": [{"resource": "catalog"}, {"resource": "search"}]});
    let mut tasks = Vec::new();
    for i in 0..16 {
        let http = if i % 2 == 0 { a.http.clone() } else { b.http.clone() };
        let body = body.clone();
        tasks.push(tokio::spawn(async move {
            let (mut catalog, mut search) = (Tally::default(), Tally::default());
            for r in until_refused(3, || http.post("/v1/acquire", &body), |r| r.status == 200).await {
                if r.status == 200 {
                    let results = r.body["results"].as_array().cloned().unwrap_or_default();
                    assert_eq!(results.len(), 2, "{}", r.body);
                    for (t, p) in [(&mut catalog, &results[0]), (&mut search, &results[1])] {
                        let ws = norm(p["window_start"].as_str().unwrap_or_default());
                        t.by_window.entry(ws).or_default().0 += 1;
                    }
                } else {
                    assert_eq!((r.status, r.error()), (429, "quota_exhausted"), "{}", r.body);
                    assert_eq!(r.body["limit"], json!("search"), "{}", r.body);
                    assert_eq!(r.body["resource"], json!("search"), "{}", r.body);
                }
            }
            (catalog, search)
        }));
    }
    let (mut catalog, mut search) = (Tally::default(), Tally::default());
    for t in tasks {
        let (c, s) = t.await.unwrap();
        catalog.merge(&c);
        search.merge(&s);
    }
    assert_eq!(search.admitted(), 40, "search's pool admits exactly its limit: {search:?}");
    assert_eq!(catalog.by_window, search.by_window);
    w.wait_accounting("atlas", "catalog", &catalog.by_window).await;
    w.wait_accounting("atlas", "search", &search.by_window).await;
}

/// Hammers until `stop` answers are seen in a row or `max` requests.
pub async fn hammer(http: &quota_tests::http::Http, resource: &str, stop: (u16, &str), max: usize) -> Tally {
    let mut t = Tally::default();
    let mut streak = 0;
    for _ in 0..max {
        let r = acquire(http, "atlas", resource).await;
        t.add(&r);
        if (r.status, r.error()) == stop {
            assert!(r.header("retry-after").is_some(), "{}", r.body);
            streak += 1;
            if streak >= 3 {
                break;
            }
        } else {
            streak = 0;
        }
    }
    t
}

/// One `ShouldRateLimit` of tenant atlas with one descriptor of `entries`
/// on the agent's RLS port `addr` (connecting, within 20 s, each time).
pub async fn rls_atlas(
    addr: &str,
    entries: &[(&str, &str)],
) -> envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse {
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
    use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
    use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
    let url = format!("http://{addr}");
    let mut c = quota_tests::wait::until("the RLS port accepts", Duration::from_secs(20), || {
        let url = url.clone();
        async move { RateLimitServiceClient::connect(url).await.ok() }
    })
    .await;
    let entries = entries.iter().map(|(k, v)| Entry { key: k.to_string(), value: v.to_string() }).collect();
    let d = RateLimitDescriptor { entries, ..Default::default() };
    let req = RateLimitRequest { domain: "atlas".into(), descriptors: vec![d], hits_addend: 1 };
    c.should_rate_limit(req).await.expect("an answer, not a gRPC error").into_inner()
}
