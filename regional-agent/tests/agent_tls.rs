//! The agent → allocator link over HTTPS (DESIGN §5 Security), with real
//! TLS handshakes between the agent process and an allocator serving TLS:
//! certificates made per test, trusted through `--allocator-ca-file`,
//! optionally a client certificate (mTLS). A certificate the agent cannot
//! verify makes the allocator unreachable: the fail mode applies and
//! `/v1/status` says why.

mod common;

use common::{acquire, bin};
use quota_tests::agent::{AgentOpts, AgentProc};
use quota_tests::app::{Options, TestAllocator};
use quota_tests::fixtures::put_policy;
use quota_tests::http::Http;
use quota_tests::pg::TestDb;
use quota_tests::redis::TestRedis;
use quota_tests::tls::{write, Ca};
use serde_json::json;
use std::time::Duration;

/// PostgreSQL, Redis and an allocator serving HTTPS with a certificate of
/// `ca` (requiring client certificates of `client_ca` when given).
struct TlsWorld {
    _db: TestDb,
    redis: TestRedis,
    alloc: TestAllocator,
    admin: Http,
    dir: tempfile::TempDir,
}

async fn start(ca: &Ca, client_ca: Option<&Ca>) -> TlsWorld {
    let dir = tempfile::tempdir().expect("dir");
    let server = ca.server("allocator", 1);
    let files = quota_tests::app::TlsFiles {
        cert: write(dir.path(), "server.pem", &server.cert_pem),
        key: write(dir.path(), "server.key", &server.key_pem),
        client_ca: client_ca.map(|c| write(dir.path(), "client-ca.pem", &c.cert_pem)),
    };
    let db = TestDb::start().await;
    let alloc = TestAllocator::spawn_with(&db.url, Options { tls: Some(files), ..Default::default() }).await;
    assert!(alloc.base.starts_with("https://"), "{}", alloc.base);
    // The test's own calls go over the same TLS; with mTLS they would need a
    // certificate, so policies are written through the allocator's state.
    let admin = Http::with_ca(&alloc.base, &ca.cert_pem);
    TlsWorld { _db: db, redis: TestRedis::start(), alloc, admin, dir }
}

impl TlsWorld {
    fn agent_opts(&self, env: Vec<(&str, String)>) -> AgentOpts {
        let mut opts = AgentOpts::new("eu", "eu-1", &self.alloc.base, &self.redis.url);
        opts.env.extend(env.into_iter().map(|(k, v)| (k.to_string(), v)));
        opts
    }

    fn file(&self, name: &str, contents: &str) -> String {
        write(self.dir.path(), name, contents).display().to_string()
    }
}

async fn strict_policy(http: &Http) {
    put_policy(http, "atlas", "read", json!({"limit": 100, "window_secs": 3600, "fail_mode": "strict"}))
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_acquires_from_a_lease_over_https() {
    let ca = Ca::new("test root");
    let w = start(&ca, None).await;
    strict_policy(&w.admin).await;
    let ca_file = w.file("ca.pem", &ca.cert_pem);
    let agent = AgentProc::spawn(bin(), w.agent_opts(vec![("AGENT_ALLOCATOR_CA_FILE", ca_file)])).await;
    let r = acquire(&agent.http, "atlas", "read").await.expect(200);
    assert_eq!(r.body["source"], "lease", "{}", r.body);
    let status = agent.http.get("/v1/status").await.expect(200).body;
    assert_eq!(status["allocator_reachable"], true, "{status}");
    assert!(status["allocator_error"].is_null(), "{status}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_acquires_over_mutual_tls_with_its_client_certificate() {
    let ca = Ca::new("server root");
    let clients = Ca::new("client root");
    let w = start(&ca, Some(&clients)).await;
    // Without a client certificate the allocator refuses the connection.
    let anonymous = w.admin.get_status("/v1/policies/atlas/read").await;
    assert_eq!(anonymous, None, "a client without a certificate must not get an answer");
    let admin_leaf = clients.client("operator", None);
    let admin = Http::with_identity(&w.alloc.base, &ca.cert_pem, &admin_leaf.cert_pem, &admin_leaf.key_pem);
    strict_policy(&admin).await;

    let leaf = clients.client("eu-1", Some("eu"));
    let env = vec![
        ("AGENT_ALLOCATOR_CA_FILE", w.file("ca.pem", &ca.cert_pem)),
        ("AGENT_ALLOCATOR_CLIENT_CERT", w.file("client.pem", &leaf.cert_pem)),
        ("AGENT_ALLOCATOR_CLIENT_KEY", w.file("client.key", &leaf.key_pem)),
    ];
    let agent = AgentProc::spawn(bin(), w.agent_opts(env)).await;
    let r = acquire(&agent.http, "atlas", "read").await.expect(200);
    assert_eq!(r.body["source"], "lease", "{}", r.body);
    assert!(!agent.log().contains("BEGIN PRIVATE KEY"), "key material in the agent's log");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_the_agent_cannot_verify_makes_the_allocator_unreachable() {
    let ca = Ca::new("server root");
    let w = start(&ca, None).await;
    strict_policy(&w.admin).await;
    let stranger = Ca::new("some other root");
    let env = vec![("AGENT_ALLOCATOR_CA_FILE", w.file("other.pem", &stranger.cert_pem))];
    let agent = AgentProc::spawn_unregistered(bin(), w.agent_opts(env)).await;

    let status = quota_tests::wait::until("status names the TLS failure", Duration::from_secs(15), || {
        let http = agent.http.clone();
        async move {
            let s = http.get("/v1/status").await.body;
            s["allocator_error"].as_str().is_some().then_some(s)
        }
    })
    .await;
    assert_eq!(status["allocator_reachable"], false, "{status}");
    let why = status["allocator_error"].as_str().unwrap().to_lowercase();
    assert!(why.contains("certificate") || why.contains("issuer"), "{status}");

    for _ in 0..5 {
        let r = acquire(&agent.http, "atlas", "read").await;
        assert_eq!((r.status, r.error()), (503, "allocator_unreachable"), "{}", r.body);
        assert!(r.header("retry-after").is_some());
    }
    // Logged once per change of reason, not once per attempt or request.
    let log = agent.log();
    let warnings =
        log.lines().filter(|l| l.contains("regional_agent::client") && l.contains("unreachable")).count();
    assert_eq!(warnings, 1, "{log}");
}
