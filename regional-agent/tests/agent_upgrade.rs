//! A rolling upgrade from the legacy key layout (one Redis Cluster slot per
//! quota) to the tenant layout, on one Redis: an agent of each layout in
//! one region, partitioned from the allocator. Each layout counts the
//! region's fallback allowance under its own keys, so without the legacy
//! gate the region would admit the allowance once per layout (F34). The
//! legacy agent is `regional-agent --key-layout legacy`, which writes the
//! keys, agent set and liveness value of the release before (the key names
//! are pinned by `keys::tests`).

mod common;

use common::{acquire, hammer, Tally, World};
use quota_tests::proxy::{Fault, FaultProxy};
use serde_json::json;
use std::time::Duration;

const WINDOW: i64 = 45;
const ALLOWANCE: i64 = 7;

/// Acquires on `http` until `fallback` admits came from the allowance (at
/// most `max` requests).
async fn until_fallback(http: &quota_tests::http::Http, fallback: i64, max: usize) -> Tally {
    let mut t = Tally::default();
    for _ in 0..max {
        t.add(&acquire(http, "atlas", "u").await);
        if t.fallback() == fallback {
            break;
        }
    }
    t
}

/// Redis's clock (ms).
async fn redis_now_ms(conn: &mut redis::aio::MultiplexedConnection) -> Option<i64> {
    let (s, us): (i64, i64) = redis::cmd("TIME").query_async(conn).await.ok()?;
    Some(s * 1000 + us / 1000)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn old_and_new_agents_on_one_redis_never_admit_more_than_the_bound() {
    // The first window ends a few seconds in (time to start both agents
    // and admit), not at the next real boundary.
    let w = World::start_clocked(WINDOW, Duration::from_secs(6)).await;
    w.policy(
        "atlas",
        "u",
        json!({"limit": 60, "window_secs": WINDOW, "chunk_max": 60, "fallback_per_region": ALLOWANCE}),
    )
    .await;
    let sw = FaultProxy::in_front_of(&w.stack.alloc.base).await.expect("fault proxy");
    // The old agent's liveness key lasts 10 s (its outbox runs every second).
    let mut old = w
        .agent(
            "eu",
            "eu-old",
            Some(&sw.http_url()),
            &[("AGENT_KEY_LAYOUT", "legacy"), ("AGENT_OUTBOX_INTERVAL_MS", "1000")],
        )
        .await;
    let new = w.agent("eu", "eu-new", Some(&sw.http_url()), &[]).await;
    let stop = (503, "allocator_unreachable");
    let client = redis::Client::open(w.redis_url()).expect("redis url");
    let conn = client.get_multiplexed_async_connection().await.expect("redis");

    // Both admit from leases; then a partition in a fresh window.
    let mut tally = Tally::default();
    tally.merge(&hammer(&old.http, "u", (0, ""), 3).await);
    tally.merge(&hammer(&new.http, "u", (0, ""), 3).await);
    let window_end = w.clock.next_window(WINDOW, Duration::ZERO).await + WINDOW;
    sw.set(Fault::Blackhole);
    // The old agent spends its leases, then 4 of the region's 7.
    let old_during = until_fallback(&old.http, 4, 300).await;
    assert_eq!(old_during.fallback(), 4, "{old_during:?}");
    // While it is alive the new agent takes none: the old one's count
    // keeps changing under keys the new one's script cannot read.
    let new_during = hammer(&new.http, "u", stop, 300).await;
    assert_eq!(
        new_during.fallback(),
        0,
        "the new agent takes no fallback while an old one is alive: {new_during:?}"
    );
    tally.merge(&old_during);
    tally.merge(&new_during);

    // The old agent is replaced (killed, as a pod is) mid-window. Once its
    // liveness lapsed and the gate passed, its count is frozen and the new
    // agent adds it to its own: 3 left in this window, not a fresh 7 (F34).
    old.stop(9);
    quota_tests::wait::until("the old agent's liveness lapses", Duration::from_secs(30), || {
        let mut conn = conn.clone();
        async move {
            let live: i64 =
                redis::cmd("EXISTS").arg("a:{2:eu/6:eu-old}:live").query_async(&mut conn).await.ok()?;
            (live == 0).then_some(())
        }
    })
    .await;
    quota_tests::wait::until("the legacy gate passes", Duration::from_secs(30), || {
        let mut conn = conn.clone();
        async move {
            let gate: i64 = redis::cmd("GET").arg("r:{2:eu}:legacy").query_async(&mut conn).await.ok()?;
            (redis_now_ms(&mut conn).await? > gate + regional_agent::legacy::READ_SLACK_MS).then_some(())
        }
    })
    .await;
    assert!(
        w.clock.now().timestamp() < window_end - 2,
        "the gate passed too late for this test to say anything (window ends at {window_end})"
    );
    let new_after = hammer(&new.http, "u", stop, 300).await;
    eprintln!(
        "partitioned window: old agent {} fallback admits, new agent {} while it lived and {} after (allowance {ALLOWANCE})",
        old_during.fallback(),
        new_during.fallback(),
        new_after.fallback()
    );
    assert_eq!(
        new_after.fallback(),
        ALLOWANCE - 4,
        "the new agent honours the old one's count: {new_after:?}"
    );
    tally.merge(&new_after);
    for (ws, (_, fb)) in &tally.by_window {
        assert!(*fb <= ALLOWANCE, "window {ws} admitted {fb} from fallback across both layouts: {tally:?}");
    }

    // Heal: every admit of both layouts reaches the allocator, the old
    // agent's through the new one (its legacy counters and its outbox).
    sw.set(Fault::Pass);
    w.wait_accounting("atlas", "u", &tally.by_window).await;
    for win in w.windows("atlas", "u").await {
        assert_eq!(win["bound_held"], json!(true), "{win}");
    }
}
