//! Per-region agent credentials (DESIGN §5 Security): a token from
//! `--agent-tokens-file`, or a client certificate naming `region:<r>`, acts
//! only for its region. Every agent route (register, grant, release,
//! report, status) is tried with the right region's token (2xx), another region's
//! (403 wrong_region, nothing changed, a `refused` ledger event), the shared
//! `QUOTA_AGENT_TOKEN` (2xx) and no token (401).

use quota_tests::app::{Options, TestAllocator, TlsFiles};
use quota_tests::db::{self, Table};
use quota_tests::fixtures::{grant_body, put_policy, report_body, table_counts};
use quota_tests::http::{Http, Resp};
use quota_tests::pg::TestDb;
use quota_tests::tls::{write, Ca};
use serde_json::{json, Value};

const SHARED: &str = "shared-agent-token-7f3a";
const ADMIN: &str = "admin-token-c41d";
const EU: &str = "eu-region-token-19be";
const US: &str = "us-region-token-88c2";

/// POSTs `body` to `path` with another region's credentials and asserts
/// the refusal: 403 wrong_region, no table changed, one more refused event
/// for `region`.
async fn assert_refused(alloc: &TestAllocator, region: &str, http: &Http, path: &str, body: Value) {
    let db = &alloc.state.db;
    let (counts, refusals) = (table_counts(db).await, db::wrong_region_refusals(db, region).await);
    let r: Resp = http.post(path, &body).await;
    assert_eq!((r.status, r.error()), (403, "wrong_region"), "{}", r.body);
    assert_eq!(table_counts(db).await, counts, "a wrong_region request changed state");
    assert_eq!(db::wrong_region_refusals(db, region).await, refusals + 1, "no refused ledger event");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn region_tokens_act_only_for_their_region_on_every_agent_route() {
    let dir = tempfile::tempdir().expect("dir");
    let tokens = write(dir.path(), "agent-tokens", &format!("# region token\neu {EU}\n\nus {US}\n"));
    let db = TestDb::start().await;
    let opts = Options {
        agent_token: Some(SHARED.into()),
        admin_token: Some(ADMIN.into()),
        agent_tokens_file: Some(tokens),
        ..Default::default()
    };
    let alloc = TestAllocator::spawn_with(&db.url, opts).await;
    let http = Http::new(&alloc.base);
    let (admin, shared, eu, none) = (
        http.with_token(Some(ADMIN)),
        http.with_token(Some(SHARED)),
        http.with_token(Some(EU)),
        http.clone(),
    );
    put_policy(&admin, "atlas", "read", json!({"limit": 1000, "window_secs": 3600})).await;

    // register
    let reg = |region: &str| json!({"region": region, "agent": format!("{region}-1")});
    let eu_epoch =
        eu.post("/v1/agents/register", &reg("eu")).await.expect(200).body["epoch"].as_i64().unwrap();
    assert_refused(&alloc, "us", &eu, "/v1/agents/register", reg("us")).await;
    let us_epoch =
        shared.post("/v1/agents/register", &reg("us")).await.expect(200).body["epoch"].as_i64().unwrap();
    assert_eq!(none.post("/v1/agents/register", &reg("eu")).await.status, 401);
    let us_token = http.with_token(Some(US));
    us_token.post("/v1/agents/register", &reg("us")).await.expect(200);
    let us_epoch = us_epoch + 1;

    // grant
    let g = |region: &str, epoch: i64, seq: i64| {
        grant_body("atlas", "read", region, &format!("{region}-1"), epoch, seq, 10, 1.0)
    };
    let eu_lease: Value = eu.post("/v1/grants", &g("eu", eu_epoch, 1)).await.expect(200).body;
    assert_refused(&alloc, "us", &eu, "/v1/grants", g("us", us_epoch, 1)).await;
    let us_lease: Value = shared.post("/v1/grants", &g("us", us_epoch, 1)).await.expect(200).body;
    assert_eq!(none.post("/v1/grants", &g("eu", eu_epoch, 2)).await.status, 401);

    // release: the path names only the lease; the region is the lease's
    let release = |lease: &Value| format!("/v1/leases/{}/release", lease["lease_id"].as_str().unwrap());
    assert_refused(&alloc, "us", &eu, &release(&us_lease), json!({"epoch": us_epoch, "unspent": 4})).await;
    eu.post(&release(&eu_lease), &json!({"epoch": eu_epoch, "unspent": 3})).await.expect(200);
    shared.post(&release(&us_lease), &json!({"epoch": us_epoch, "unspent": 4})).await.expect(200);
    assert_eq!(none.post(&release(&eu_lease), &json!({"epoch": eu_epoch, "unspent": 3})).await.status, 401);

    // report
    let ws = eu_lease["window_start"].clone();
    assert_refused(&alloc, "us", &eu, "/v1/reports", report_body("us", us_epoch, "us-r1", &ws, 6, 0)).await;
    eu.post("/v1/reports", &report_body("eu", eu_epoch, "eu-r1", &ws, 7, 0)).await.expect(200);
    shared.post("/v1/reports", &report_body("us", us_epoch, "us-r1", &ws, 6, 0)).await.expect(200);
    assert_eq!(none.post("/v1/reports", &report_body("eu", eu_epoch, "eu-r2", &ws, 1, 0)).await.status, 401);

    // status: the path names the region
    let status = |epoch: i64| json!({"epoch": epoch, "allocator_reachable": true, "outbox_depth": 0, "quotas_total": 0, "quotas": []});
    let r = eu.put("/v1/agents/us/us-1/status", &status(us_epoch)).await;
    assert_eq!((r.status, r.error()), (403, "wrong_region"), "{}", r.body);
    let n = db::rows(&alloc.state.db, Table::AgentStatus).await;
    assert_eq!(n, 0, "a wrong_region status was stored");
    eu.put("/v1/agents/eu/eu-1/status", &status(eu_epoch)).await.expect(204);
    shared.put("/v1/agents/us/us-1/status", &status(us_epoch)).await.expect(204);
    assert_eq!(none.put("/v1/agents/eu/eu-1/status", &status(eu_epoch)).await.status, 401);

    // The refusals are in the operator's ledger with their reason.
    let ledger = admin.get("/v1/ledger?region=us").await.expect(200).body;
    let reasons: Vec<_> = ledger["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["kind"] == "refused")
        .map(|e| e["reason"].as_str().unwrap_or_default().to_string())
        .collect();
    assert_eq!(reasons, ["wrong_region"; 5], "{ledger}");

    // The file is re-read when it changes: a rotated token works, the old
    // one no longer does, and a malformed version keeps the one in force.
    let rotated = "eu-region-token-rotated-5d0e";
    write(dir.path(), "agent-tokens", &format!("eu {rotated}\nus {US}\n"));
    let eu2 = http.with_token(Some(rotated));
    quota_tests::wait::until("rotated token accepted", std::time::Duration::from_secs(10), || {
        let eu2 = eu2.clone();
        async move { (eu2.post("/v1/agents/register", &reg("eu")).await.status == 200).then_some(()) }
    })
    .await;
    assert_eq!(eu.post("/v1/agents/register", &reg("eu")).await.status, 401);
    write(dir.path(), "agent-tokens", "eu\n");
    // Give the poller several intervals to (not) apply it.
    let seen = std::time::Instant::now();
    quota_tests::wait::until("malformed file ignored for 2.5 s", std::time::Duration::from_secs(10), || {
        let eu2 = eu2.clone();
        async move {
            assert_eq!(eu2.post("/v1/agents/register", &reg("eu")).await.status, 200);
            (seen.elapsed() > std::time::Duration::from_millis(2500)).then_some(())
        }
    })
    .await;
    alloc.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_certificate_naming_a_region_limits_the_shared_token_to_it() {
    let dir = tempfile::tempdir().expect("dir");
    let (ca, clients) = (Ca::new("server root"), Ca::new("client root"));
    let server = ca.server("allocator", 1);
    let files = TlsFiles {
        cert: write(dir.path(), "server.pem", &server.cert_pem),
        key: write(dir.path(), "server.key", &server.key_pem),
        client_ca: Some(write(dir.path(), "clients.pem", &clients.cert_pem)),
    };
    let db = TestDb::start().await;
    let opts = Options { agent_token: Some(SHARED.into()), tls: Some(files), ..Default::default() };
    let alloc = TestAllocator::spawn_with(&db.url, opts).await;
    let leaf = clients.client("eu-1", Some("eu"));
    let eu = Http::with_identity(&alloc.base, &ca.cert_pem, &leaf.cert_pem, &leaf.key_pem)
        .with_token(Some(SHARED));
    let reg = |region: &str| json!({"region": region, "agent": format!("{region}-1")});
    eu.post("/v1/agents/register", &reg("eu")).await.expect(200);
    assert_refused(&alloc, "us", &eu, "/v1/agents/register", reg("us")).await;
    // A certificate without a region name limits nothing.
    let plain = clients.client("tool", None);
    let tool = Http::with_identity(&alloc.base, &ca.cert_pem, &plain.cert_pem, &plain.key_pem)
        .with_token(Some(SHARED));
    tool.post("/v1/agents/register", &reg("us")).await.expect(200);
    alloc.stop().await;
}
