//! Maximum policy age (F24): an agent cut off from the allocator for longer
//! than `--max-policy-age-secs` applies each policy's `on_stale`, also
//! after a SIGKILL and a restart during the partition (the confirmation
//! instant is kept in Redis), and forgets it at the first grant after the
//! heal. Real allocator on PostgreSQL, Redis, the agent as a process behind
//! a fault proxy.

mod common;

use common::{acquire, World};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use quota_tests::agent::{AgentOpts, AgentProc};
use quota_tests::http::{metric, Http};
use quota_tests::proxy::{Fault, FaultProxy};
use serde_json::{json, Value};
use std::time::{Duration, Instant};

const MAX_AGE_SECS: u64 = 3;

async fn status_of(http: &Http, resource: &str) -> Value {
    let s = http.get("/v1/status").await.expect(200);
    s.body["quotas"]
        .as_array()
        .and_then(|qs| qs.iter().find(|q| q["resource"] == resource).cloned())
        .unwrap_or(Value::Null)
}

async fn metrics(http: &Http) -> String {
    let r = http.get("/metrics").await.expect(200);
    r.body.as_str().expect("metrics text").to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_past_the_max_age_applies_each_policys_on_stale_across_a_restart() {
    let w = World::start().await;
    // Leases that outlive the test: while fresh, a partition is served from
    // them; what changes at the age is the policy's word alone.
    let lasting = json!({"limit": 1000, "window_secs": 3600, "chunk_min": 200, "chunk_max": 200,
                         "lease_ttl_secs": 3600, "fail_mode": "strict"});
    let mut fail = lasting.clone();
    fail["on_stale"] = json!("fail_mode");
    let mut keep = lasting.clone();
    keep["on_stale"] = json!("keep");
    w.policy("atlas", "strict-fail", fail).await;
    w.policy("atlas", "strict-keep", keep).await;
    // A shadow policy whose pool is spent: it admits everything while
    // fresh (shadow_refused), and is enforced once stale.
    w.policy(
        "atlas",
        "shadow-fail",
        json!({"limit": 3, "window_secs": 3600, "chunk_max": 3, "lease_ttl_secs": 3600,
               "fallback_per_region": 0, "enforce": false, "on_stale": "fail_mode"}),
    )
    .await;
    let sw = FaultProxy::in_front_of(&w.stack.alloc.base).await.expect("fault proxy");
    let age = MAX_AGE_SECS.to_string();
    let mut opts = AgentOpts::new("eu", "eu-1", &sw.http_url(), w.redis_url());
    opts.env.push(("AGENT_MAX_POLICY_AGE_SECS".into(), age));
    let grpc = format!("127.0.0.1:{}", quota_tests::free_port());
    opts.env.push(("AGENT_GRPC_LISTEN".into(), grpc.clone()));
    let mut a = AgentProc::spawn(common::bin(), opts).await;
    // The first grant teaches the policy with one token; demand then
    // brings a lease of the chunk.
    for r in ["strict-fail", "strict-keep"] {
        quota_tests::wait::until("a lease of several tokens", Duration::from_secs(15), || {
            let http = a.http.clone();
            async move {
                assert_eq!(acquire(&http, "atlas", r).await.status, 200, "{r}");
                (status_of(&http, r).await["lease_tokens"].as_i64().unwrap_or(0) >= 5).then_some(())
            }
        })
        .await;
    }
    for _ in 0..5 {
        assert_eq!(acquire(&a.http, "atlas", "shadow-fail").await.status, 200);
    }
    let shadow = acquire(&a.http, "atlas", "shadow-fail").await;
    assert_eq!((shadow.status, &shadow.body["shadow_refused"]), (200, &json!(true)), "{}", shadow.body);
    let st = a.http.get("/v1/status").await.expect(200);
    assert_eq!(st.body["max_policy_age_secs"], json!(MAX_AGE_SECS));
    let q = status_of(&a.http, "strict-fail").await;
    assert_eq!((&q["policy"]["on_stale"], &q["policy_stale"]), (&json!("fail_mode"), &json!(false)), "{q}");

    // The partition: while the policies are younger than the age, the
    // leases serve and the shadow policy still refuses nobody.
    sw.set(Fault::Blackhole);
    let cut = Instant::now();
    let r = acquire(&a.http, "atlas", "strict-fail").await;
    assert_eq!((r.status, &r.body["source"]), (200, &json!("lease")), "{}", r.body);
    // Polled on the status, so that no decision spends the lease meanwhile.
    quota_tests::wait::until("strict-fail stale", Duration::from_secs(20), || {
        let http = a.http.clone();
        async move { (status_of(&http, "strict-fail").await["policy_stale"] == json!(true)).then_some(()) }
    })
    .await;
    let after = cut.elapsed();
    eprintln!("strict-fail stale {after:?} after the partition began (max age {MAX_AGE_SECS} s)");
    let stale = acquire(&a.http, "atlas", "strict-fail").await;
    assert_eq!(stale.status, 503, "{}", stale.body);
    assert_eq!(stale.body["error"], json!("policy_stale"), "{}", stale.body);
    assert!(stale.header("retry-after").is_some(), "503 policy_stale carries Retry-After");
    // The age counts from the last grant, before the partition: never
    // before the max age from the cut, and soon after it.
    assert!(after >= Duration::from_secs(MAX_AGE_SECS) - Duration::from_millis(1500), "{after:?}");
    // Over RLS: a refusal Envoy cannot let through, whatever its
    // failure_mode_deny.
    let r = common::rls_atlas(&grpc, &[("resource", "strict-fail")]).await;
    assert_eq!(r.overall_code, Code::OverLimit as i32, "{r:?}");
    let reason =
        r.response_headers_to_add.iter().find(|h| h.key == "x-quota-refused").map(|h| h.value.clone());
    assert_eq!(reason.as_deref(), Some("policy_stale"), "{r:?}");
    // Each quota's age counts from its own last grant.
    for r in ["strict-keep", "shadow-fail"] {
        quota_tests::wait::until("stale", Duration::from_secs(10), || {
            let http = a.http.clone();
            async move { (status_of(&http, r).await["policy_stale"] == json!(true)).then_some(()) }
        })
        .await;
    }
    let kept = acquire(&a.http, "atlas", "strict-keep").await;
    assert_eq!((kept.status, &kept.body["source"]), (200, &json!("lease")), "keep: {}", kept.body);
    let enforced = acquire(&a.http, "atlas", "shadow-fail").await;
    // Refused as an enforced policy refuses a spent pool (the agent may
    // know it spent, 429, or only that it cannot ask, 503).
    let refused = matches!(
        (enforced.status, enforced.error()),
        (429, "quota_exhausted") | (503, "allocator_unreachable")
    );
    assert!(refused, "a stale shadow policy is enforced: {} {}", enforced.status, enforced.body);
    for r in ["strict-fail", "strict-keep", "shadow-fail"] {
        let q = status_of(&a.http, r).await;
        assert_eq!(q["policy_stale"], json!(true), "{q}");
        assert!(q["policy_age_secs"].as_i64().unwrap_or(0) >= MAX_AGE_SECS as i64, "{q}");
    }
    let text = metrics(&a.http).await;
    assert_eq!(metric(&text, "agent_policy_stale{quota=\"atlas/strict-fail\"}"), Some(1.0), "{text}");
    let refused =
        "agent_quota_refusals_total{quota=\"atlas/strict-fail\",code=\"policy_stale\",version=\"1\"}";
    assert!(metric(&text, refused).unwrap_or(0.0) >= 1.0, "{text}");
    for applied in ["refused", "kept", "enforced"] {
        let n = metric(&text, &format!("agent_stale_policy_decisions_total{{applied=\"{applied}\"}}"));
        assert!(n.unwrap_or(0.0) >= 1.0, "{applied}: {n:?}");
    }

    // A crash and a restart during the partition: the age comes back from
    // Redis, so the restarted agent does not start the age over.
    a.stop(libc::SIGKILL);
    a.start_unregistered().await;
    // Until its first call to the allocator fails (one allocator timeout)
    // a new process counts the allocator reachable, and nothing is stale.
    quota_tests::wait::until("the restarted agent sees the partition", Duration::from_secs(10), || {
        let http = a.http.clone();
        async move {
            let s = http.get("/v1/status").await;
            (s.body["allocator_reachable"] == json!(false)).then_some(())
        }
    })
    .await;
    let r = acquire(&a.http, "atlas", "strict-fail").await;
    assert_eq!((r.status, &r.body["error"]), (503, &json!("policy_stale")), "after restart: {}", r.body);

    // The heal: the first grant confirms the policy again.
    sw.set(Fault::Pass);
    let healed =
        quota_tests::wait::until("strict-fail admits after the heal", Duration::from_secs(20), || {
            let http = a.http.clone();
            async move {
                let r = acquire(&http, "atlas", "strict-fail").await;
                (r.status == 200).then_some(r)
            }
        })
        .await;
    assert_eq!(healed.body["policy_version"], json!(1), "{}", healed.body);
    let q = status_of(&a.http, "strict-fail").await;
    assert_eq!(q["policy_stale"], json!(false), "{q}");
    // The next grant (due once decisions drain the lease) confirms the
    // policy again: its age starts over.
    quota_tests::wait::until("a grant confirms the policy", Duration::from_secs(20), || {
        let http = a.http.clone();
        async move {
            assert_eq!(acquire(&http, "atlas", "strict-fail").await.status, 200);
            let age = status_of(&http, "strict-fail").await["policy_age_secs"].as_i64();
            age.filter(|s| *s < MAX_AGE_SECS as i64 - 1).map(|_| ())
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_max_policy_age_above_30_days_is_refused_at_start() {
    let out = std::process::Command::new(common::bin())
        .env("AGENT_REGION", "eu")
        .env("AGENT_ID", "eu-1")
        .env("ALLOCATOR_URL", "http://127.0.0.1:9")
        .env("REDIS_URL", "redis://127.0.0.1:9")
        .env("AGENT_MAX_POLICY_AGE_SECS", "2592001")
        .output()
        .expect("run the agent");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--max-policy-age-secs"), "{err}");
}
