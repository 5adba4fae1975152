//! Every command the README and the docs pages show is run: `curl`
//! examples against a real allocator and agent (one stack, README first,
//! then the pages in [`PAGES`] order, so a page may build on what an
//! earlier one set up), `cargo lab ...` lines through quota-lab's argument
//! parser (`.ci/run` runs the demo and the short chaos profile for real),
//! `cargo test --workspace` is this very run. A command of any other kind
//! fails the test, so no page can grow a command nobody runs. The same
//! binary checks that every relative link of those pages resolves and that
//! the chaos page describes every scenario.

mod markdown;

use quota_tests::agent::{AgentOpts, AgentProc};
use quota_tests::app::{Options, TestAllocator};
use quota_tests::pg::TestDb;
use quota_tests::redis::TestRedis;
use std::path::{Path, PathBuf};
use std::process::Command;

const ADMIN: &str = "readme-admin-token";
const AGENT: &str = "readme-agent-token";

/// The pages whose commands run, in the order they run. Every `docs/*.md`
/// must be listed: a new page fails [`pages`] until it is placed here.
const PAGES: &[&str] = &[
    "README.md",
    "docs/api.md",
    "docs/envoy.md",
    "docs/deploying.md",
    "docs/operating.md",
    "docs/guarantees.md",
    "docs/limits.md",
    "docs/chaos.md",
    "docs/benchmarks.md",
    "docs/testing.md",
    "docs/ci.md",
];

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Each page of [`PAGES`] with its text; panics when a listed page is
/// missing or a `docs/*.md` page is not listed.
fn pages() -> Vec<(&'static str, String)> {
    let docs = root().join("docs");
    let mut unlisted: Vec<String> = std::fs::read_dir(&docs)
        .expect("docs/")
        .filter_map(|e| e.ok())
        .map(|e| format!("docs/{}", e.file_name().to_string_lossy()))
        .filter(|p| p.ends_with(".md") && !PAGES.contains(&p.as_str()))
        .collect();
    unlisted.sort();
    assert!(
        unlisted.is_empty(),
        "{unlisted:?} not in PAGES of chaos/tests/readme.rs: place each in the order its commands run"
    );
    PAGES
        .iter()
        .map(|p| (*p, std::fs::read_to_string(root().join(p)).unwrap_or_else(|e| panic!("{p}: {e}"))))
        .collect()
}

fn is_assignment(l: &str) -> bool {
    l.split_whitespace().all(|w| {
        w.split_once('=')
            .is_some_and(|(k, _)| !k.is_empty() && k.chars().all(|c| c.is_ascii_uppercase() || c == '_'))
    })
}

/// How a command of a page is run.
enum Step {
    Lab(String),
    Curl(String),
}

/// The steps of a page's ```sh blocks; panics on a command no test runs.
fn steps(page: &str, text: &str) -> Vec<Step> {
    let mut out = Vec::new();
    for line in markdown::sh_blocks(text).into_iter().flatten() {
        if let Some(args) = line.strip_prefix("cargo lab ") {
            out.push(Step::Lab(args.to_string()));
        } else if line == "cargo test --workspace" || is_assignment(&line) {
            // This run is the test command; variables are set below.
        } else if line.starts_with("curl ") {
            out.push(Step::Curl(line));
        } else {
            panic!("{page}: command `{line}` is not run by any test; run it here or in .ci/run");
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_readme_command_runs() {
    let pages = pages();
    let steps: Vec<(&str, Step)> = pages
        .iter()
        .flat_map(|(page, text)| steps(page, text).into_iter().map(move |s| (*page, s)))
        .collect();
    assert!(
        Command::new("curl").arg("--version").output().is_ok_and(|o| o.status.success()),
        "curl is needed to run the docs' examples: apt-get install curl"
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
    for (page, step) in &steps {
        match step {
            Step::Lab(args) => {
                let out = Command::new(env!("CARGO_BIN_EXE_quota-lab"))
                    .args(args.split_whitespace())
                    .env("QUOTA_LAB_DRY_RUN", "1")
                    .output()
                    .expect("run quota-lab");
                assert!(
                    out.status.success(),
                    "{page}: line `cargo lab {args}` is not accepted by quota-lab: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            // Each line on its own, so a failure names the line.
            Step::Curl(line) => {
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
                    "{page}: command failed: {line}\nstdout: {}\nstderr: {}",
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                );
            }
        }
        ran += 1;
    }
    assert!(ran >= 5, "only {ran} commands found in {PAGES:?}; the parser or the pages are broken");
}

/// A link to another page must find it, and a `#anchor` a heading there:
/// moving a section between pages cannot leave a link behind.
#[test]
fn every_relative_link_resolves() {
    let mut broken = Vec::new();
    for (page, text) in pages() {
        let dir = root().join(page).parent().map(Path::to_path_buf).unwrap_or_else(root);
        for link in markdown::links(&text) {
            if link.contains("://") || link.starts_with("mailto:") {
                continue;
            }
            let (path, anchor) = link.split_once('#').map_or((link.as_str(), None), |(p, a)| (p, Some(a)));
            let target = if path.is_empty() { root().join(page) } else { dir.join(path) };
            if !target.exists() {
                broken.push(format!("{page}: ({link}): no file {}", target.display()));
                continue;
            }
            let Some(anchor) = anchor else { continue };
            let headings =
                std::fs::read_to_string(&target).map(|t| markdown::anchors(&t)).unwrap_or_default();
            if !headings.iter().any(|h| h == anchor) {
                broken.push(format!("{page}: ({link}): no heading #{anchor} in {}", target.display()));
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

/// docs/chaos.md's table says what each scenario does: a scenario added to
/// `cargo lab chaos` without a row there fails here.
#[test]
fn the_chaos_page_describes_every_scenario() {
    let page = std::fs::read_to_string(root().join("docs/chaos.md")).expect("docs/chaos.md");
    let missing: Vec<&str> = chaos::scenarios::SCENARIOS
        .iter()
        .map(|(name, _)| *name)
        .filter(|name| !page.contains(&format!("| `{name}` |")))
        .collect();
    assert!(missing.is_empty(), "docs/chaos.md has no row for {missing:?}");
}
