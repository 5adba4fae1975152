//! Headless Chromium for the `/ui` tests: the page as a browser renders it
//! (`--dump-dom`) and screenshots. Chromium is the Debian package
//! `chromium`; without it the tests that need it fail and say so.

use std::path::{Path, PathBuf};
use std::time::Duration;

/// The Chromium binary, or a panic naming the package to install.
pub fn binary() -> PathBuf {
    ["chromium", "chromium-browser", "google-chrome"]
        .iter()
        .find_map(|name| crate::procs::find_binary(name, &[]))
        .unwrap_or_else(|| {
            panic!(
                "headless Chromium not found: install the Debian package `chromium` \
                 (apt-get install -y --no-install-recommends chromium); .ci/run installs it when missing"
            )
        })
}

/// Runs headless Chromium with `args` then `url` and the profile directory
/// `profile` (one per run), returning stdout; at most 90 s.
pub async fn run(bin: &Path, profile: &Path, args: &[String], url: &str) -> String {
    let mut cmd = tokio::process::Command::new(bin);
    cmd.args([
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-background-networking",
        "--no-first-run",
        "--hide-scrollbars",
    ])
    .arg(format!("--user-data-dir={}", profile.display()))
    .args(args)
    .arg(url)
    .kill_on_drop(true);
    let out = tokio::time::timeout(Duration::from_secs(90), cmd.output())
        .await
        .expect("chromium finished within 90 s")
        .expect("chromium started");
    assert!(out.status.success(), "chromium failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The DOM of `url` after rendering.
pub async fn dump_dom(bin: &Path, profile: &Path, url: &str) -> String {
    run(bin, profile, &["--dump-dom".into()], url).await
}

/// The HTML of the element that starts with `start` (e.g. `<tr data-x="y">`)
/// up to the first `end` after it, or a panic showing `html`.
pub fn element<'a>(html: &'a str, start: &str, end: &str) -> &'a str {
    let from = html.find(start).unwrap_or_else(|| panic!("no {start} in: {html}"));
    let to =
        html[from..].find(end).map(|i| from + i).unwrap_or_else(|| panic!("no {end} after {start}: {html}"));
    &html[from..to]
}
