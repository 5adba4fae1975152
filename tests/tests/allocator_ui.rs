//! The `/ui` dashboard rendered by a real headless Chromium: a screenshot
//! and the DOM after rendering, which must show the numbers of the operator
//! scenario. Chromium is the Debian package `chromium`; without it this test
//! fails and says so.

use quota_tests::chromium::{self, run as run_chromium};
use quota_tests::fixtures::operator_scenario_played;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_renders_in_headless_chromium_with_the_scenario_numbers() {
    let bin = chromium::binary();
    // No tokens: the dashboard is open on loopback, so Chromium needs no header.
    let (_db, _clock, alloc, _http) = operator_scenario_played().await;
    let dir = tempfile::tempdir().expect("tempdir");

    let index =
        run_chromium(&bin, &dir.path().join("p1"), &["--dump-dom".into()], &format!("{}/ui", alloc.base))
            .await;
    assert!(index.contains("href=\"/ui/quotas/atlas/read\""), "{index}");
    assert!(index.contains("<td data-field=\"limit\">1000</td>"), "{index}");

    let url = format!("{}/ui/quotas/atlas/read", alloc.base);
    let dom = run_chromium(&bin, &dir.path().join("p2"), &["--dump-dom".into()], &url).await;
    assert!(dom.contains("<svg id=\"chart\""), "the chart is inline SVG: {dom}");
    assert!(dom.contains("class=\"bound\"") && dom.contains("class=\"limit\""), "{dom}");
    assert!(dom.contains("http-equiv=\"refresh\""), "{dom}");
    let row =
        |start: &str| chromium::element(&dom, &format!("<tr data-window=\"{start}\">"), "</tr>").to_string();
    let w0 = row("2026-12-02T10:00:00Z");
    for cell in [
        "<td data-field=\"limit\">1000</td>",
        "<td data-field=\"bound\">1100</td>",
        "<td data-field=\"admitted\">440</td>",
        "<td data-region=\"eu\">250</td>",
        "<td data-region=\"us\">190</td>",
        "<td data-field=\"fallback_admitted\">40</td>",
        "<td data-field=\"fallback_share\">9.1%</td>",
        "<td data-field=\"stranded\">50</td>",
        "<td data-field=\"bound_held\">yes</td>",
    ] {
        assert!(w0.contains(cell), "window 10:00 lacks {cell}: {w0}");
    }
    let w1 = row("2026-12-02T10:01:00Z");
    for cell in [
        "<td data-field=\"admitted\">1150</td>",
        "<td data-region=\"eu\">950</td>",
        "<td data-region=\"us\">200</td>",
        "<td data-field=\"bound_held\" class=\"bad\">NO</td>",
    ] {
        assert!(w1.contains(cell), "window 10:01 lacks {cell}: {w1}");
    }

    let png = dir.path().join("quota.png");
    run_chromium(
        &bin,
        &dir.path().join("p3"),
        &[format!("--screenshot={}", png.display()), "--window-size=1280,900".into()],
        &url,
    )
    .await;
    let bytes = std::fs::read(&png).expect("chromium wrote the screenshot");
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "PNG signature");
    assert!(bytes.len() > 10_000, "a rendered page, not a blank one: {} bytes", bytes.len());
    if let Ok(keep) = std::env::var("UI_SCREENSHOT") {
        std::fs::copy(&png, keep).expect("copy screenshot");
    }
}
