//! The kernel-level partition: region `us`'s agent runs in a network
//! namespace of its own, reaching the allocator over one veth pair and its
//! Redis (and its clients reaching it) over another; the cut takes the
//! allocator veth down, so the agent sees the network, not a proxy, fail.
//! Needs root and `ip netns`; elsewhere the scenario is skipped and says so.

use super::harness::{Profile, Run};
use crate::bins::Bins;
use crate::report::{ScenarioReport, Verdict};
use crate::stack::StackSpec;
use crate::traffic::region_total;
use quota_tests::agent::{AgentOpts, AgentProc};
use quota_tests::proxy::FaultProxy;
use std::process::Command;

/// The namespace and veth pairs, removed when dropped.
struct Net {
    ns: String,
    alloc_host: String,
    /// `(host ip, namespace ip)` of the allocator path and of the Redis/clients path.
    alloc_ips: (String, String),
    redis_ips: (String, String),
    links: Vec<String>,
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip").args(args).output().map_err(|e| format!("ip {}: {e}", args.join(" ")))?;
    if !out.status.success() {
        return Err(format!("ip {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim()));
    }
    Ok(())
}

impl Net {
    fn create() -> Result<Net, String> {
        let id = std::process::id() % 100_000;
        let octet = id % 250 + 1;
        let mut net = Net {
            ns: format!("qlab{id}"),
            alloc_host: format!("qa{id}h"),
            alloc_ips: (format!("10.213.{octet}.1"), format!("10.213.{octet}.2")),
            redis_ips: (format!("10.214.{octet}.1"), format!("10.214.{octet}.2")),
            links: Vec::new(),
        };
        ip(&["netns", "add", &net.ns])?;
        ip(&["netns", "exec", &net.ns, "ip", "link", "set", "lo", "up"])?;
        for (tag, (host_ip, ns_ip)) in [("a", net.alloc_ips.clone()), ("r", net.redis_ips.clone())] {
            let (h, n) = (format!("q{tag}{id}h"), format!("q{tag}{id}n"));
            ip(&["link", "add", &h, "type", "veth", "peer", "name", &n])?;
            net.links.push(h.clone());
            ip(&["link", "set", &n, "netns", &net.ns])?;
            ip(&["addr", "add", &format!("{host_ip}/30"), "dev", &h])?;
            ip(&["link", "set", &h, "up"])?;
            ip(&["netns", "exec", &net.ns, "ip", "addr", "add", &format!("{ns_ip}/30"), "dev", &n])?;
            ip(&["netns", "exec", &net.ns, "ip", "link", "set", &n, "up"])?;
        }
        Ok(net)
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        let _ = ip(&["netns", "del", &self.ns]);
        for l in &self.links {
            let _ = ip(&["link", "del", l]);
        }
    }
}

/// Why the scenario cannot run here, if it cannot: root, `ip`, and the
/// right to create a namespace and a veth pair (a container may lack it).
fn unsupported() -> Option<String> {
    if !quota_tests::procs::is_root() {
        return Some("needs root to create network namespaces".into());
    }
    let probe = format!("qlabprobe{}", std::process::id() % 100_000);
    let link = format!("qp{}h", std::process::id() % 100_000);
    let made = ip(&["netns", "add", &probe]).and_then(|()| {
        let veth = ip(&[
            "link",
            "add",
            &link,
            "type",
            "veth",
            "peer",
            "name",
            &format!("qp{}n", std::process::id() % 100_000),
        ]);
        let _ = ip(&["link", "del", &link]);
        veth
    });
    let _ = ip(&["netns", "del", &probe]);
    made.err().map(|e| format!("cannot create a network namespace and veth pair here: {e}"))
}

pub async fn partition(p: &Profile, bins: Bins) -> Result<ScenarioReport, String> {
    if let Some(why) = unsupported() {
        return Ok(ScenarioReport {
            scenario: "netns-partition".into(),
            verdict: Verdict::Skipped,
            windows: Vec::new(),
            notes: vec![format!("skipped: {why}")],
            seconds: 0.0,
            figures: Default::default(),
        });
    }
    let net = Net::create()?;
    let spec = StackSpec {
        regions: vec![("eu".into(), 1), ("us".into(), 0)],
        allocators: 1,
        agent_env: Vec::new(),
        sentinel_regions: Vec::new(),
        patroni: None,
    };
    let agent_bin = bins.agent.clone();
    let mut run = Run::start("netns-partition", p, bins, Some(spec), false).await?;
    let upstreams: Vec<String> = run.stack.allocators.iter().map(|a| a.addr.clone()).collect();
    let alloc = FaultProxy::start_on(&net.alloc_ips.0, upstreams).await.map_err(|e| e.to_string())?;
    let redis_addr = run.stack.region("us").redis.url.trim_start_matches("redis://").to_string();
    let redis = FaultProxy::start_on(&net.redis_ips.0, vec![redis_addr]).await.map_err(|e| e.to_string())?;
    let wrapper = run.stack.log_dir().join("agent-in-netns.sh");
    std::fs::write(
        &wrapper,
        format!("#!/bin/sh\nexec ip netns exec {} {} \"$@\"\n", net.ns, agent_bin.display()),
    )
    .map_err(|e| e.to_string())?;
    std::fs::set_permissions(&wrapper, std::os::unix::fs::PermissionsExt::from_mode(0o755))
        .map_err(|e| e.to_string())?;
    let mut opts = AgentOpts::new("us", "us-1", &alloc.http_url(), &format!("redis://{}", redis.addr));
    opts.host = net.redis_ips.1.clone();
    opts.env.push(("AGENT_REDIS_PREFIX".into(), run.stack.region("us").redis.prefix.clone()));
    let agent = AgentProc::spawn(&wrapper, opts).await;
    run.stack.region_mut("us").agents.push(agent);
    run.note(format!("us-1 runs in network namespace {} (allocator via {})", net.ns, alloc.addr));
    run.traffic(&[("eu", 0.4), ("us", 0.3)]);
    run.pass(1.5).await;
    let before = region_total(&run.tally(), "us");
    ip(&["link", "set", &net.alloc_host, "down"])?;
    run.note(format!("veth {} down: us cut off from the allocator for 3 windows", net.alloc_host));
    run.pass(3.0).await;
    let during = region_total(&run.tally(), "us").since(&before);
    ip(&["link", "set", &net.alloc_host, "up"])?;
    run.note("veth up again");
    run.pass(1.5).await;
    let after = region_total(&run.tally(), "us").since(&before).since(&during);
    run.check(during.fallback > 0, format!("us admitted {} from fallback while cut off", during.fallback));
    run.check(after.lease > 0, format!("us admitted {} from leases after the heal", after.lease));
    let rep = run.finish().await;
    drop((alloc, redis, net));
    rep
}
