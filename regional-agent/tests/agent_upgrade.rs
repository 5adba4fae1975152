//! A rolling upgrade from the legacy key layout (one Redis Cluster slot per
//! quota) to the tenant layout, on one Redis: an agent of each layout in
//! one region, partitioned from the allocator. Each layout counts the
//! region's fallback allowance under its own keys, so without the legacy
//! gate the region would admit the allowance once per layout (F34). The
//! legacy agent is `regional-agent --key-layout legacy`, which writes the
//! keys, agent set and liveness value of the release before (the key names
//! are pinned by `keys::tests`).

mod common;

use common::{hammer, next_window, Tally, World};
use quota_tests::proxy::{Fault, FaultProxy};
use serde_json::json;

const WINDOW: i64 = 20;
const ALLOWANCE: i64 = 7;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn old_and_new_agents_on_one_redis_never_admit_more_than_the_bound() {
    let w = World::start().await;
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

    // Both admit from leases; then a partition in a fresh window.
    let mut tally = Tally::default();
    tally.merge(&hammer(&old.http, "u", (0, ""), 3).await);
    tally.merge(&hammer(&new.http, "u", (0, ""), 3).await);
    next_window(WINDOW).await;
    sw.set(Fault::Blackhole);
    let old_during = hammer(&old.http, "u", stop, 300).await;
    let new_during = hammer(&new.http, "u", stop, 300).await;
    // Both again: neither has anything left to give.
    let old_again = hammer(&old.http, "u", stop, 300).await;
    let new_again = hammer(&new.http, "u", stop, 300).await;
    assert!(old_during.fallback() > 0, "the old agent used the region's allowance: {old_during:?}");
    assert_eq!(
        new_during.fallback() + new_again.fallback(),
        0,
        "the new agent takes no fallback while an old one is alive: {new_during:?} {new_again:?}"
    );
    eprintln!(
        "partitioned window: old agent {} fallback admits, new agent {} (allowance {ALLOWANCE})",
        old_during.fallback() + old_again.fallback(),
        new_during.fallback() + new_again.fallback()
    );
    for t in [&old_during, &new_during, &old_again, &new_again] {
        tally.merge(t);
    }
    for (ws, (_, fb)) in &tally.by_window {
        assert!(*fb <= ALLOWANCE, "window {ws} admitted {fb} from fallback across both layouts: {tally:?}");
    }

    // Heal: every admit of both layouts reaches the allocator.
    sw.set(Fault::Pass);
    w.wait_accounting("atlas", "u", &tally.by_window).await;

    // The old agent is replaced (killed, as a pod is): what it left under
    // the legacy keys is reported by the new agent, and once its liveness
    // has lapsed the new agent may use the allowance in a later window.
    tally.merge(&hammer(&old.http, "u", (0, ""), 3).await);
    old.stop(9);
    quota_tests::wait::until("the old agent's liveness lapses", std::time::Duration::from_secs(30), || {
        let url = w.redis_url().to_string();
        async move {
            let client = redis::Client::open(url).ok()?;
            let mut conn = client.get_multiplexed_async_connection().await.ok()?;
            let live: i64 =
                redis::cmd("EXISTS").arg("a:{2:eu/6:eu-old}:live").query_async(&mut conn).await.ok()?;
            (live == 0).then_some(())
        }
    })
    .await;
    // The gate (the last sighting plus the liveness key's 10 s) passes on
    // the Redis clock.
    quota_tests::wait::until("the legacy gate passes", std::time::Duration::from_secs(30), || {
        let url = w.redis_url().to_string();
        async move {
            let client = redis::Client::open(url).ok()?;
            let mut conn = client.get_multiplexed_async_connection().await.ok()?;
            let gate: i64 = redis::cmd("GET").arg("r:{2:eu}:legacy").query_async(&mut conn).await.ok()?;
            let (s, us): (i64, i64) = redis::cmd("TIME").query_async(&mut conn).await.ok()?;
            (s * 1000 + us / 1000 > gate).then_some(())
        }
    })
    .await;
    next_window(WINDOW).await;
    tally.merge(&hammer(&new.http, "u", (0, ""), 2).await);
    sw.set(Fault::Blackhole);
    let alone = hammer(&new.http, "u", stop, 300).await;
    assert!(alone.fallback() > 0 && alone.fallback() <= ALLOWANCE, "{alone:?}");
    eprintln!("after the old agent left: the new agent admitted {} from fallback", alone.fallback());
    tally.merge(&alone);
    sw.set(Fault::Pass);
    w.wait_accounting("atlas", "u", &tally.by_window).await;
    for win in w.windows("atlas", "u").await {
        assert_eq!(win["bound_held"], json!(true), "{win}");
    }
}
