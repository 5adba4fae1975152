//! No secret in a log, an answer or `--help` (DESIGN §5 Security): the
//! allocator (in this process, its `tracing` output captured at debug level)
//! and agent processes (debug logs) run with a shared token, region tokens,
//! an admin token and a client key; the routes are driven, failures
//! included (wrong tokens, another region's token, an agent with a bad
//! token); then every log line, error body and status page is scanned.

mod common;

use common::{acquire, bin};
use quota_tests::agent::{AgentOpts, AgentProc};
use quota_tests::app::{Options, TestAllocator, TlsFiles};
use quota_tests::fixtures::put_policy;
use quota_tests::http::Http;
use quota_tests::pg::TestDb;
use quota_tests::redis::TestRedis;
use quota_tests::tls::{write, Ca};
use serde_json::json;
use std::sync::{Arc, Mutex};
use std::time::Duration;

const SHARED: &str = "S3cret-shared-agent-1b7e";
const ADMIN: &str = "S3cret-admin-94d0";
const EU: &str = "S3cret-eu-region-c2a1";
const US: &str = "S3cret-us-region-7f55";

/// Collects everything the in-process allocator logs.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_secret_appears_in_logs_answers_or_help() {
    let captured = Captured::default();
    let sink = captured.clone();
    tracing_subscriber::fmt()
        .with_max_level(tracing::Level::DEBUG)
        .with_ansi(false)
        .with_writer(move || sink.clone())
        .init();

    let dir = tempfile::tempdir().expect("dir");
    let (ca, clients) = (Ca::new("server root"), Ca::new("client root"));
    let server = ca.server("allocator", 1);
    let leaf = clients.client("eu-1", Some("eu"));
    let key_body: String = leaf.key_pem.lines().nth(1).expect("key line").to_string();
    let server_key_body: String = server.key_pem.lines().nth(1).expect("key line").to_string();
    let secrets = [SHARED, ADMIN, EU, US, key_body.as_str(), server_key_body.as_str()];

    let tokens = write(dir.path(), "agent-tokens", &format!("eu {EU}\nus {US}\n"));
    let files = TlsFiles {
        cert: write(dir.path(), "server.pem", &server.cert_pem),
        key: write(dir.path(), "server.key", &server.key_pem),
        client_ca: Some(write(dir.path(), "clients.pem", &clients.cert_pem)),
    };
    let db = TestDb::start().await;
    let opts = Options {
        agent_token: Some(SHARED.into()),
        admin_token: Some(ADMIN.into()),
        agent_tokens_file: Some(tokens),
        tls: Some(files),
        ..Default::default()
    };
    let alloc = TestAllocator::spawn_with(&db.url, opts).await;
    let redis = TestRedis::start();
    let http = Http::with_identity(&alloc.base, &ca.cert_pem, &leaf.cert_pem, &leaf.key_pem);
    let mut answers = Vec::new();
    put_policy(
        &http.with_token(Some(ADMIN)),
        "atlas",
        "read",
        json!({"limit": 100, "window_secs": 3600, "fail_mode": "strict"}),
    )
    .await;

    let ca_file = write(dir.path(), "ca.pem", &ca.cert_pem).display().to_string();
    let agent_env = |token: &str| {
        let mut o = AgentOpts::new("eu", "eu-1", &alloc.base, &redis.url);
        o.env.extend(
            [
                ("QUOTA_AGENT_TOKEN", token.to_string()),
                ("RUST_LOG", "debug".to_string()),
                ("AGENT_ALLOCATOR_CA_FILE", ca_file.clone()),
                (
                    "AGENT_ALLOCATOR_CLIENT_CERT",
                    write(dir.path(), "c.pem", &leaf.cert_pem).display().to_string(),
                ),
                (
                    "AGENT_ALLOCATOR_CLIENT_KEY",
                    write(dir.path(), "c.key", &leaf.key_pem).display().to_string(),
                ),
            ]
            .map(|(k, v)| (k.to_string(), v)),
        );
        o
    };
    let good = AgentProc::spawn(bin(), agent_env(EU)).await;
    answers.push(acquire(&good.http, "atlas", "read").await.expect(200).body);
    answers.push(good.http.get("/v1/status").await.body);
    answers.push(good.http.get("/metrics").await.body);

    // Failures: an agent whose token the allocator does not know, wrong and
    // other-region tokens straight at the allocator.
    let mut bad_opts = agent_env("S3cret-unknown-token-0000");
    bad_opts.agent = "eu-2".into();
    let bad = AgentProc::spawn_unregistered(bin(), bad_opts).await;
    quota_tests::wait::until("the bad agent is refused", Duration::from_secs(10), || {
        let bad = &bad;
        async move { bad.log().contains("unauthorized").then_some(()) }
    })
    .await;
    answers.push(acquire(&bad.http, "atlas", "read").await.body);
    answers.push(bad.http.get("/v1/status").await.body);
    for token in [Some("S3cret-wrong"), None, Some(US)] {
        let r = http
            .with_token(token)
            .post("/v1/agents/register", &json!({"region": "eu", "agent": "eu-9"}))
            .await;
        assert!(r.status == 401 || r.status == 403, "{}", r.body);
        answers.push(r.body);
    }
    answers.push(http.with_token(Some(EU)).get("/v1/policies/atlas/read").await.body);

    // A malformed tokens file is a start error naming the line only.
    let broken = write(dir.path(), "broken-tokens", &format!("eu {EU}\nus {US} extra\n"));
    let err = quota_tests::app::AgentTokens::load(&broken).unwrap_err();
    assert!(err.contains("line 2"), "{err}");
    answers.push(json!(err));
    // --help shows the variables' names, not their values.
    let help = std::process::Command::new(bin())
        .arg("--help")
        .env("QUOTA_AGENT_TOKEN", SHARED)
        .output()
        .expect("agent --help");
    let help = String::from_utf8_lossy(&help.stdout).into_owned();
    assert!(help.contains("QUOTA_AGENT_TOKEN") && help.contains("allocator-ca-file"), "{help}");

    let texts = [
        ("allocator log", String::from_utf8_lossy(&captured.0.lock().unwrap()).into_owned()),
        ("agent log", good.log()),
        ("bad agent log", bad.log()),
        ("answers", serde_json::to_string(&answers).unwrap()),
        ("agent --help", help),
    ];
    assert!(texts[0].1.contains("agent tokens file loaded"), "the capture works");
    assert!(texts[1].1.contains("DEBUG"), "the agent logs at debug level");
    for (what, text) in &texts {
        for s in secrets.iter().chain(["S3cret-unknown-token-0000", "S3cret-wrong"].iter()) {
            assert!(!text.contains(s), "{what} contains a secret ({} chars)", s.len());
        }
        assert!(!text.contains("PRIVATE KEY"), "{what} contains key material");
    }
    alloc.stop().await;
}
