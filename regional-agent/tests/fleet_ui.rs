//! The fleet at a glance (`/ui` and `/ui/regions`) rendered by headless
//! Chromium after a scripted scenario with real agents: region `us` admits
//! from its lease and its fallback allowance while partitioned from the
//! allocator, then answers 503; region `eu` exhausts the pool and gets
//! 429s. The index must show exactly the admits, 429s and 503s the clients
//! saw and `us` in fallback; the regions page both agents with their epoch
//! and an empty outbox.

mod common;

use common::{acquire, Tally, World};
use quota_tests::chromium;
use quota_tests::http::Http;
use quota_tests::proxy::{Fault, FaultProxy};
use serde_json::json;
use std::time::Duration;

/// Statuses every 300 ms instead of 2 s, so the pages settle quickly.
const FAST_STATUS: (&str, &str) = ("AGENT_STATUS_INTERVAL_MS", "300");

/// The HTML of a page, as the server sends it (for polling).
async fn html(http: &Http, path: &str) -> String {
    http.get(path).await.expect(200).body.as_str().unwrap_or_default().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fleet_pages_show_the_scenario_admits_refusals_fallback_and_agents() {
    let bin = chromium::binary();
    let w = World::start().await;
    // A day-long window: the whole scenario counts in one window.
    w.policy(
        "atlas",
        "read",
        json!({"limit": 6, "window_secs": 86400, "chunk_max": 2, "fallback_per_region": 2}),
    )
    .await;
    let eu = w.agent("eu", "eu-1", None, &[FAST_STATUS]).await;
    let sw = FaultProxy::in_front_of(&w.stack.alloc.base).await.expect("fault proxy");
    let mut us =
        w.agent("us", "us-1", Some(&sw.http_url()), &[FAST_STATUS, ("AGENT_REDIS_PREFIX", "us:")]).await;
    // The first start in a new region counts the first window's fallback as
    // spent (see the agent's crate doc); a restarted agent finds the region
    // known, so its fallback allowance is there.
    us.stop(libc::SIGTERM);
    let us_epoch = us.start().await;
    let eu_epoch = eu.epoch().await;

    let mut tally = Tally::default();
    tally.add(&acquire(&us.http, "atlas", "read").await.expect(200));
    sw.set(Fault::Blackhole);
    for _ in 0..10 {
        tally.add(&acquire(&us.http, "atlas", "read").await);
    }
    let mut refused = 0;
    for _ in 0..40 {
        let r = acquire(&eu.http, "atlas", "read").await;
        tally.add(&r);
        if r.status == 429 {
            refused += 1;
            if refused == 2 {
                break;
            }
        }
    }
    sw.set(Fault::Pass);
    let admitted = tally.admitted();
    let n429 = tally.count(429, "quota_exhausted");
    let n503 = tally.count(503, "allocator_unreachable") + tally.count(503, "store_unavailable");
    assert_eq!(tally.fallback(), 2, "us admitted its whole fallback allowance: {tally:?}");
    assert!(n429 >= 2 && n503 >= 1, "{tally:?}");
    assert_eq!(tally.statuses.values().sum::<i64>(), admitted + n429 + n503, "no other answer: {tally:?}");

    // The reports and statuses arrive within a few seconds of the heal.
    let cells = [
        format!("<td data-field=\"admitted\">{admitted}</td>"),
        // limit 6 + 2 per region seen (eu and us)
        "<td data-field=\"bound\">10</td>".to_string(),
        format!("<td data-field=\"refused_429\">{n429}</td>"),
        format!("<td data-field=\"refused_503\">{n503}</td>"),
    ];
    let http = &w.stack.http;
    quota_tests::wait::until("the index shows the scenario", Duration::from_secs(30), || async {
        let page = html(http, "/ui").await;
        let row = page.find("<tr data-quota=\"atlas/read\">").map(|i| &page[i..])?;
        cells.iter().all(|c| row.contains(c.as_str())).then_some(())
    })
    .await;
    quota_tests::wait::until(
        "both outboxes drained, the allocator reachable",
        Duration::from_secs(30),
        || async {
            let page = html(http, "/ui/regions").await;
            let both = |cell: &str| page.matches(cell).count() == 2;
            (both("<td data-field=\"outbox_depth\">0</td>") && both("<td data-field=\"reachable\">yes</td>"))
                .then_some(())
        },
    )
    .await;

    let dir = tempfile::tempdir().expect("tempdir");
    let base = &w.stack.alloc.base;
    let index = chromium::dump_dom(&bin, &dir.path().join("p1"), &format!("{base}/ui")).await;
    let row = chromium::element(&index, "<tr data-quota=\"atlas/read\">", "</tr>");
    for c in &cells {
        assert!(row.contains(c.as_str()), "the index row lacks {c}: {row}");
    }
    let fallback = chromium::element(row, "<td class=\"l\" data-field=\"fallback_regions\">", "</td>");
    assert!(
        fallback.contains(">us</a>") && !fallback.contains(">eu</a>"),
        "only us was in fallback: {fallback}"
    );
    assert!(row.contains("<svg class=\"bar\""), "the bar is inline SVG: {row}");
    assert!(index.contains("href=\"/ui/regions\""), "{index}");

    let regions = chromium::dump_dom(&bin, &dir.path().join("p2"), &format!("{base}/ui/regions")).await;
    assert!(regions.contains("<span id=\"agents\">2</span>"), "{regions}");
    assert!(regions.contains("<span id=\"stale\">0</span>"), "{regions}");
    for (agent, epoch) in [("eu/eu-1", eu_epoch), ("us/us-1", us_epoch)] {
        let row = chromium::element(&regions, &format!("<tr data-agent=\"{agent}\">"), "</tr>");
        for c in [
            format!("<td data-field=\"epoch\">{epoch}</td>"),
            "<td data-field=\"outbox_depth\">0</td>".to_string(),
            "<td data-field=\"reachable\">yes</td>".to_string(),
            "<td data-field=\"dead_letters\">0</td>".to_string(),
            "<td data-field=\"quotas\">1</td>".to_string(),
        ] {
            assert!(row.contains(c.as_str()), "{agent} lacks {c}: {row}");
        }
    }
    assert_eq!(us_epoch, 2, "us-1 registered at each of its two starts");
}
