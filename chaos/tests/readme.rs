//! Every command the README shows is run: `curl` examples against a real
//! allocator and agent (in README order, one stack), `cargo lab ...` lines
//! through quota-lab's argument parser (`.ci/run` runs the demo and the
//! short chaos profile for real), `cargo test --workspace` is this very
//! run. A command of any other kind fails the test, so the README cannot
//! grow a command nobody runs.

use quota_tests::agent::{AgentOpts, AgentProc};
use quota_tests::app::{Options, TestAllocator};
use quota_tests::pg::TestDb;
use quota_tests::redis::TestRedis;
use std::path::Path;
use std::process::Command;

const ADMIN: &str = "readme-admin-token";
const AGENT: &str = "readme-agent-token";

/// Logical lines (continuations joined) of every ```sh block, in order.
fn sh_blocks(text: &str) -> Vec<Vec<String>> {
    let mut blocks = Vec::new();
    let mut cur: Option<Vec<String>> = None;
    let mut pending = String::new();
    for line in text.lines() {
        let t = line.trim_end();
        match (&mut cur, t.trim_start()) {
            (None, "```sh") => cur = Some(Vec::new()),
            (Some(_), "```") => blocks.push(cur.take().unwrap_or_default()),
            (Some(b), l) => {
                if let Some(head) = l.strip_suffix('\\') {
                    pending.push_str(head);
                    pending.push(' ');
                } else {
                    pending.push_str(l);
                    let full = std::mem::take(&mut pending);
                    if !full.trim().is_empty() && !full.trim_start().starts_with('#') {
                        b.push(full.trim().to_string());
                    }
                }
            }
            (None, _) => {}
        }
    }
    blocks
}

fn is_assignment(l: &str) -> bool {
    l.split_whitespace().all(|w| {
        w.split_once('=')
            .is_some_and(|(k, _)| !k.is_empty() && k.chars().all(|c| c.is_ascii_uppercase() || c == '_'))
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_readme_command_runs() {
    let readme = Path::new(env!("CARGO_MANIFEST_DIR")).join("../README.md");
    let text = std::fs::read_to_string(&readme).expect("README.md");
    let blocks = sh_blocks(&text);
    assert!(!blocks.is_empty(), "README has no ```sh blocks");
    assert!(
        Command::new("curl").arg("--version").output().is_ok_and(|o| o.status.success()),
        "curl is needed to run the README's examples: apt-get install curl"
    );

    let db = TestDb::start().await;
    let opts =
        Options { agent_token: Some(AGENT.into()), admin_token: Some(ADMIN.into()), ..Default::default() };
    let alloc = TestAllocator::spawn_with(&db.url, opts).await;
    let redis = TestRedis::start();
    let bins = chaos::bins::locate().expect("service binaries (cargo test --workspace builds them)");
    let mut aopts = AgentOpts::new("eu", "eu-1", &alloc.base, &redis.url);
    aopts.env.push(("AGENT_REDIS_PREFIX".into(), redis.prefix.clone()));
    aopts.env.push(("QUOTA_AGENT_TOKEN".into(), AGENT.into()));
    let agent = AgentProc::spawn(&bins.agent, aopts).await;

    let mut ran = 0;
    for block in &blocks {
        let mut script = Vec::new();
        for line in block {
            if let Some(args) = line.strip_prefix("cargo lab ") {
                let out = Command::new(env!("CARGO_BIN_EXE_quota-lab"))
                    .args(args.split_whitespace())
                    .env("QUOTA_LAB_DRY_RUN", "1")
                    .output()
                    .expect("run quota-lab");
                assert!(
                    out.status.success(),
                    "README line `{line}` is not accepted by quota-lab: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
                ran += 1;
            } else if line == "cargo test --workspace" || is_assignment(line) {
                // This run is the test command; variables are set below.
            } else if line.starts_with("curl ") {
                script.push(line.clone());
            } else {
                panic!("README command `{line}` is not run by any test; run it here or in .ci/run");
            }
        }
        if script.is_empty() {
            continue;
        }
        // Each line on its own, so a failure names the line.
        for line in &script {
            let out = Command::new("sh")
                .arg("-ec")
                .arg(line)
                .env("ALLOCATOR", &alloc.base)
                .env("AGENT", &agent.base)
                .env("QUOTA_ADMIN_TOKEN", ADMIN)
                .output()
                .expect("run sh");
            assert!(
                out.status.success(),
                "README command failed: {line}\nstdout: {}\nstderr: {}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            ran += 1;
        }
    }
    assert!(ran >= 5, "only {ran} README commands found; the parser or the README is broken");
}
