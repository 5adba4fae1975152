//! The OpenAPI documents tell the truth: Schemathesis (an OpenAPI-driven
//! fuzzer from PyPI, `st`) generates requests from each service's
//! `/openapi.json` against a live allocator and agent and finds no server
//! error, no undocumented status and no answer outside its documented
//! schema. A missing `st` fails the test with the install command (.ci/run
//! installs it); it is never skipped.

mod common;

use common::World;
use serde_json::json;
use std::process::Command;

/// Runs Schemathesis against `base`'s document; returns its report on failure.
fn fuzz(base: &str) -> Result<(), String> {
    // st keeps a cache in its working directory: not in the source tree.
    let dir = tempfile::tempdir().expect("temp dir");
    let out = Command::new("st")
        .current_dir(dir.path())
        .args(["run", &format!("{base}/openapi.json")])
        .args(["--checks", "not_a_server_error,status_code_conformance,response_schema_conformance"])
        .args(["--max-examples", "30", "--seed", "19", "--no-color"])
        .output()
        .unwrap_or_else(|e| {
            panic!("Schemathesis' `st` cannot be started ({e}); install it with `pip install schemathesis` (.ci/run does)")
        });
    let report = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    if out.status.success() && report.contains("passed") {
        Ok(())
    } else {
        Err(report)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schemathesis_finds_no_server_error_undocumented_status_or_schema_mismatch() {
    let w = World::start().await;
    w.policy("atlas", "read", json!({"limit": 1000, "window_secs": 3600})).await;
    let a = w.agent("eu", "eu-1", None, &[]).await;
    let (alloc, agent) = (w.stack.alloc.base.clone(), a.base.clone());
    let results = tokio::task::spawn_blocking(move || (fuzz(&alloc), fuzz(&agent))).await.expect("fuzz");
    if let Err(report) = results.0 {
        panic!("allocator:\n{report}");
    }
    if let Err(report) = results.1 {
        panic!("agent:\n{report}");
    }
}
