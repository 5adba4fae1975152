//! The agent → Redis link over TLS (`rediss://`, DESIGN §5 Security) with
//! real handshakes against `redis-server --tls-port`: certificates made per
//! test (rcgen), trusted through `--redis-ca-file`, a client certificate
//! when Redis requires one (`--tls-auth-clients yes`), and the primary and
//! Sentinel of a Sentinel group over TLS. A Redis certificate the agent
//! cannot verify (unknown CA, expired) makes the store unusable: acquire
//! answers `503 store_unavailable`, `/readyz` 503, and `/v1/status`
//! (`redis_error`) and the log say why, without the URL's password.
//!
//! The servers keep a plain loopback port for the harness's own checks
//! (`redis-cli dbsize`); the agents are only ever given the TLS port.

mod common;

use common::{acquire, bin};
use quota_tests::agent::{AgentOpts, AgentProc};
use quota_tests::fixtures::{put_policy, Stack};
use quota_tests::redis::TestRedis;
use quota_tests::redis_cluster::TestRedisCluster;
use quota_tests::sentinel::{TestSentinel, MASTER_NAME};
use quota_tests::tls::{write, Ca, Leaf, ServerFiles};
use serde_json::json;
use std::path::Path;
use std::time::Duration;

/// A password inside the Redis URL of the failure tests: it must never
/// show in a log, `/v1/status` or `/readyz`.
const URL_SECRET: &str = "pw-redis-7f3a9c";

/// The number of keys on the server's plain port (`redis-cli dbsize`).
fn dbsize(port: u16) -> u64 {
    let out = std::process::Command::new("redis-cli")
        .args(["-p", &port.to_string(), "dbsize"])
        .output()
        .expect("redis-cli");
    String::from_utf8_lossy(&out.stdout).trim().parse().expect("dbsize is a number")
}

/// A redis-server serving TLS with `leaf` (signed by `ca`).
fn tls_redis(dir: &Path, ca: &Ca, leaf: &Leaf, auth_clients: bool) -> TestRedis {
    let files = ServerFiles::write(dir, "redis", leaf, ca);
    TestRedis::start_tls(&files, auth_clients, &[])
}

fn opts(stack: &Stack, redis_url: &str, env: Vec<(&str, String)>) -> AgentOpts {
    let mut o = AgentOpts::new("eu", "eu-1", &stack.alloc.base, redis_url);
    o.env.extend(env.into_iter().map(|(k, v)| (k.to_string(), v)));
    o
}

fn file(dir: &Path, name: &str, contents: &str) -> String {
    write(dir, name, contents).display().to_string()
}

async fn lease_policy(stack: &Stack) {
    put_policy(
        &stack.http,
        "atlas",
        "read",
        json!({"limit": 100, "window_secs": 3600, "fail_mode": "strict"}),
    )
    .await;
}

/// Full acquire path (register, grant, credit, spend) over `rediss://`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_admits_from_leases_in_a_redis_reached_over_tls() {
    let dir = tempfile::tempdir().expect("dir");
    let ca = Ca::new("redis root");
    let redis = tls_redis(dir.path(), &ca, &ca.server("redis", 1), false);
    let stack = Stack::start().await;
    lease_policy(&stack).await;
    let env = vec![("AGENT_REDIS_CA_FILE", file(dir.path(), "ca.pem", &ca.cert_pem))];
    let agent = AgentProc::spawn(bin(), opts(&stack, &redis.tls_url(), env)).await;

    for _ in 0..3 {
        let r = acquire(&agent.http, "atlas", "read").await.expect(200);
        assert_eq!(r.body["source"], "lease", "{}", r.body);
    }
    assert_eq!(agent.http.get_status("/readyz").await, Some(200));
    let status = agent.http.get("/v1/status").await.expect(200).body;
    assert!(status["redis_error"].is_null(), "{status}");
    // The agent's state is in that server, reached through its TLS port.
    assert!(dbsize(redis.port()) > 0, "no keys in the TLS Redis");
}

/// Redis Cluster over TLS: the agent is given the nodes' `rediss://`
/// list, follows the slots the nodes announce (their TLS ports) and
/// admits from leases kept in the cluster.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_admits_from_a_redis_cluster_reached_over_tls() {
    let dir = tempfile::tempdir().expect("dir");
    let ca = Ca::new("redis root");
    let files = ServerFiles::write(dir.path(), "node", &ca.server("node", 1), &ca);
    let cluster = tokio::task::spawn_blocking(move || TestRedisCluster::start_tls(&files))
        .await
        .expect("cluster start");
    let stack = Stack::start().await;
    lease_policy(&stack).await;
    let url = cluster.tls_url.clone().expect("TLS cluster");
    assert_eq!(url.split(',').count(), 3, "{url}");
    let env = vec![("AGENT_REDIS_CA_FILE", file(dir.path(), "ca.pem", &ca.cert_pem))];
    let agent = AgentProc::spawn(bin(), opts(&stack, &url, env)).await;
    for _ in 0..3 {
        let r = acquire(&agent.http, "atlas", "read").await.expect(200);
        assert_eq!(r.body["source"], "lease", "{}", r.body);
    }
    let sizes = cluster.dbsizes();
    assert!(sizes.iter().sum::<u64>() > 0, "no keys in the cluster: {sizes:?}");
    assert_eq!(agent.http.get_status("/readyz").await, Some(200));
}

/// `--tls-auth-clients yes`: the agent with `--redis-client-cert` admits;
/// one without a client certificate cannot use Redis and says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_requiring_client_certificates_serves_only_the_agent_presenting_one() {
    let dir = tempfile::tempdir().expect("dir");
    let ca = Ca::new("redis root");
    let redis = tls_redis(dir.path(), &ca, &ca.server("redis", 1), true);
    let stack = Stack::start().await;
    lease_policy(&stack).await;
    let ca_file = file(dir.path(), "ca.pem", &ca.cert_pem);
    let leaf = ca.client("eu-1", None);
    let env = vec![
        ("AGENT_REDIS_CA_FILE", ca_file.clone()),
        ("AGENT_REDIS_CLIENT_CERT", file(dir.path(), "client.pem", &leaf.cert_pem)),
        ("AGENT_REDIS_CLIENT_KEY", file(dir.path(), "client.key", &leaf.key_pem)),
    ];
    let agent = AgentProc::spawn(bin(), opts(&stack, &redis.tls_url(), env)).await;
    let r = acquire(&agent.http, "atlas", "read").await.expect(200);
    assert_eq!(r.body["source"], "lease", "{}", r.body);
    assert!(!agent.log().contains("PRIVATE KEY"), "key material in the agent's log");

    let mut o = opts(&stack, &redis.tls_url(), vec![("AGENT_REDIS_CA_FILE", ca_file)]);
    o.agent = "eu-2".into();
    let anonymous = AgentProc::spawn_unregistered(bin(), o).await;
    let status = quota_tests::wait::until("status names the Redis failure", Duration::from_secs(20), || {
        let http = anonymous.http.clone();
        async move {
            let s = http.get("/v1/status").await.body;
            s["redis_error"].as_str().is_some().then_some(s)
        }
    })
    .await;
    let r = acquire(&anonymous.http, "atlas", "read").await;
    assert_eq!((r.status, r.error()), (503, "store_unavailable"), "{} / {status}", r.body);
    assert_eq!(anonymous.http.get_status("/readyz").await, Some(503));
}

/// A Redis certificate the agent cannot verify: the store is unusable,
/// every acquire is `503 store_unavailable` with `Retry-After`, `/readyz`
/// is 503, and `/v1/status`, `/readyz` and the log name the TLS reason
/// (containing `expect`), never the URL's password.
async fn unverifiable_redis_certificate(
    leaf: impl Fn(&Ca) -> Leaf,
    trusted_pem: impl Fn(&Ca) -> String,
    expect: &[&str],
) {
    let dir = tempfile::tempdir().expect("dir");
    let ca = Ca::new("redis root");
    let redis = tls_redis(dir.path(), &ca, &leaf(&ca), false);
    let stack = Stack::start().await;
    lease_policy(&stack).await;
    let url = redis.tls_url().replacen("rediss://", &format!("rediss://:{URL_SECRET}@"), 1);
    let env = vec![("AGENT_REDIS_CA_FILE", file(dir.path(), "trusted.pem", &trusted_pem(&ca)))];
    let agent = AgentProc::spawn_unregistered(bin(), opts(&stack, &url, env)).await;

    let status = quota_tests::wait::until("status names the TLS failure", Duration::from_secs(20), || {
        let http = agent.http.clone();
        async move {
            let s = http.get("/v1/status").await.body;
            s["redis_error"].as_str().is_some_and(|e| e.contains("certificate")).then_some(s)
        }
    })
    .await;
    let why = status["redis_error"].as_str().unwrap().to_lowercase();
    assert!(expect.iter().any(|e| why.contains(e)), "{status}");

    for _ in 0..5 {
        let r = acquire(&agent.http, "atlas", "read").await;
        assert_eq!((r.status, r.error()), (503, "store_unavailable"), "{}", r.body);
        assert!(r.header("retry-after").is_some(), "{:?}", r.headers);
        assert!(r.body["message"].as_str().unwrap_or_default().contains("certificate"), "{}", r.body);
    }
    let ready = agent.http.get("/readyz").await;
    assert_eq!(ready.status, 503, "{}", ready.body);
    assert!(ready.body["message"].as_str().unwrap_or_default().contains("certificate"), "{}", ready.body);

    let log = agent.log();
    let warnings = log
        .lines()
        .filter(|l| {
            l.contains("regional_agent::store") && l.contains("cannot be used") && l.contains("certificate")
        })
        .count();
    assert!(warnings >= 1, "the log does not say why: {log}");
    // Logged once per change of reason, not once per call (the policy check
    // alone retries every 250 ms).
    assert!(warnings <= 3, "logged {warnings} times: {log}");
    for text in [log, status.to_string(), ready.body.to_string()] {
        assert!(!text.contains(URL_SECRET), "the Redis password leaked: {text}");
    }
    drop(redis);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_certificate_from_an_unknown_ca_makes_the_store_unavailable_and_says_why() {
    unverifiable_redis_certificate(
        |ca| ca.server("redis", 1),
        |_| Ca::new("some other root").cert_pem,
        &["issuer"],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_redis_certificate_makes_the_store_unavailable_and_says_why() {
    unverifiable_redis_certificate(
        |ca| ca.expired_server("redis", 2),
        |ca| ca.cert_pem.clone(),
        &["expired"],
    )
    .await;
}

/// Sentinel over TLS: the agent asks the Sentinel on its TLS port for the
/// primary, reaches the primary over TLS (client certificate required by
/// both), and admits from leases kept there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_finds_the_primary_through_a_sentinel_over_tls_and_admits() {
    let dir = tempfile::tempdir().expect("dir");
    let ca = Ca::new("redis root");
    let files = ServerFiles::write(dir.path(), "node", &ca.server("node", 1), &ca);
    let group = {
        let files = files.clone();
        tokio::task::spawn_blocking(move || TestSentinel::start_tls(&files)).await.expect("sentinel group")
    };
    let stack = Stack::start().await;
    lease_policy(&stack).await;
    let leaf = ca.client("eu-1", None);
    let env = vec![
        ("AGENT_REDIS_SENTINEL", group.tls_sentinel_addr.clone().expect("TLS sentinel")),
        ("AGENT_REDIS_MASTER", MASTER_NAME.to_string()),
        ("AGENT_REDIS_CA_FILE", file(dir.path(), "ca.pem", &ca.cert_pem)),
        ("AGENT_REDIS_CLIENT_CERT", file(dir.path(), "client.pem", &leaf.cert_pem)),
        ("AGENT_REDIS_CLIENT_KEY", file(dir.path(), "client.key", &leaf.key_pem)),
    ];
    let agent = AgentProc::spawn(bin(), opts(&stack, "", env)).await;
    for _ in 0..3 {
        let r = acquire(&agent.http, "atlas", "read").await.expect(200);
        assert_eq!(r.body["source"], "lease", "{}", r.body);
    }
    assert!(dbsize(group.primary_port) > 0, "no keys on the primary:\n{}", group.logs());
    let status = agent.http.get("/v1/status").await.expect(200).body;
    assert!(status["redis_error"].is_null(), "{status}");
}
