//! `lua/permit.lua` on a real Redis, rule by rule: a region never hands
//! out more than its cap, a late answer cannot raise a cap lowered since
//! or stretch the lease, a renewal never outlives the lease nor a state
//! the server cannot vouch for, a conflict's answer applied to a lost
//! state blocks hand-outs (also when the state was lost while the answer
//! was on its way), expired permits are purged in bounded steps, and a
//! retried request id gets the same permit only for the same holder.

use quota_tests::redis::TestRedis;
use regional_agent::client::TlsFiles;
use regional_agent::keys::Keys;
use regional_agent::scripts::{self, PermitReturn, PermitSynced, PermitTake};
use regional_agent::store::Store;
use std::time::Duration;

async fn store(redis: &TestRedis) -> Store {
    Store::connect(
        std::slice::from_ref(&redis.url),
        false,
        None,
        &TlsFiles::default(),
        Duration::from_secs(2),
    )
    .await
    .expect("store")
}

/// The region's state after a first applied answer: `cap` permits, a
/// lease of `lease_ms` from now, permits of `ttl_ms`.
async fn seeded(s: &Store, p: &str, cap: i64, lease_ms: i64, ttl_ms: i64) -> i64 {
    let plan = scripts::permit_plan(s, p, None).await.unwrap();
    assert!(plan.state.is_none(), "a fresh quota has no state");
    let synced = scripts::permit_sync(s, p, 1, cap, plan.now_ms + lease_ms, 0, ttl_ms, false).await.unwrap();
    assert_eq!(synced, PermitSynced::Synced);
    plan.now_ms
}

fn taken(t: &PermitTake) -> bool {
    matches!(t, PermitTake::Taken { .. })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cap_holds_and_a_late_answer_cannot_raise_it_or_stretch_the_lease() {
    let redis = TestRedis::start();
    let s = store(&redis).await;
    let p = Keys::new("").permit_quota("acme", "export");
    seeded(&s, &p, 2, 60_000, 10_000).await;
    assert!(taken(&scripts::permit_take(&s, &p, "a", 10_000, "").await.unwrap()));
    assert!(taken(&scripts::permit_take(&s, &p, "b", 10_000, "").await.unwrap()));
    assert_eq!(
        scripts::permit_take(&s, &p, "c", 10_000, "").await.unwrap(),
        PermitTake::Full { live: 2, cap: 2 }
    );
    // One is released, the cap is lowered to the live one before the
    // allocator is told; a late conflict answer at the same seq (cap 2)
    // must not raise it back.
    assert_eq!(scripts::permit_return(&s, &p, "b", false, "").await.unwrap(), PermitReturn::Released);
    let lowered = scripts::permit_plan(&s, &p, Some(0)).await.unwrap().state.unwrap();
    assert_eq!((lowered.cap, lowered.live), (1, 1), "never below the live permits");
    let now = scripts::permit_plan(&s, &p, None).await.unwrap().now_ms;
    let late = scripts::permit_sync(&s, &p, 1, 2, now + 60_000, 0, 10_000, false).await.unwrap();
    assert_eq!(late, PermitSynced::Synced);
    assert_eq!(scripts::permit_plan(&s, &p, None).await.unwrap().state.unwrap().cap, 1);
    // An older seq is ignored; an apply at a seq the state left is stale.
    let older = scripts::permit_sync(&s, &p, 0, 3, now + 60_000, 0, 10_000, false).await.unwrap();
    assert_eq!(older, PermitSynced::Stale);
    assert!(!scripts::permit_apply(&s, &p, 5, 6, 3, now + 60_000, 10_000).await.unwrap());
    assert_eq!(
        scripts::permit_take(&s, &p, "c", 10_000, "").await.unwrap(),
        PermitTake::Full { live: 1, cap: 1 }
    );
    // The apply of the lowered request: the lease is never shortened by a
    // late answer (its end is absolute, from before the request left).
    let before = scripts::permit_plan(&s, &p, None).await.unwrap().state.unwrap().lease_in_ms;
    assert!(scripts::permit_apply(&s, &p, 1, 2, 1, now + 1_000, 10_000).await.unwrap());
    let after = scripts::permit_plan(&s, &p, None).await.unwrap().state.unwrap();
    assert_eq!(after.seq, 2);
    assert!(after.lease_in_ms >= before - 1_000, "{} then {}", before, after.lease_in_ms);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewals_stop_at_the_lease_and_at_a_state_the_server_cannot_vouch_for() {
    let redis = TestRedis::start();
    let s = store(&redis).await;
    let p = Keys::new("").permit_quota("acme", "export");
    // A lease of 5 s and permits of 2 s (the region's TTL, kept in its
    // state, wins over the TTL the caller passes).
    let origin = seeded(&s, &p, 2, 5_000, 2_000).await;
    match scripts::permit_take(&s, &p, "a", 60_000, "alice").await.unwrap() {
        PermitTake::Taken { expires_in_ms, .. } => assert_eq!(expires_in_ms, 2_000),
        other => panic!("{other:?}"),
    }
    // The TTL raised to 60 s by a later answer: no hand-out (it would
    // outlive the lease), and a renewal stops at the lease.
    assert!(scripts::permit_apply(&s, &p, 1, 2, 2, origin + 5_000, 60_000).await.unwrap());
    assert_eq!(
        scripts::permit_take(&s, &p, "b", 2_000, "").await.unwrap(),
        PermitTake::Lease { live: 1, cap: 2 }
    );
    match scripts::permit_return(&s, &p, "a", true, "alice").await.unwrap() {
        PermitReturn::Renewed { expires_in_ms } => assert!(expires_in_ms <= 5_000, "{expires_in_ms}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(scripts::permit_return(&s, &p, "a", true, "bob").await.unwrap(), PermitReturn::NotHolder);
    // The state hash is lost (evicted, or written on another server): the
    // permit is not renewed, and nothing is handed out until a sync.
    let mut c =
        redis::Client::open(redis.url.as_str()).unwrap().get_multiplexed_async_connection().await.unwrap();
    let _: i64 = redis::cmd("DEL").arg(format!("{p}pm")).query_async(&mut c).await.unwrap();
    assert_eq!(scripts::permit_return(&s, &p, "a", true, "alice").await.unwrap(), PermitReturn::Gone);
    assert_eq!(scripts::permit_take(&s, &p, "b", 2_000, "").await.unwrap(), PermitTake::Lost);
    // A conflict's answer applied to the lost state (however the caller
    // planned) blocks hand-outs from then on.
    let now = scripts::permit_plan(&s, &p, None).await.unwrap().now_ms;
    let synced = scripts::permit_sync(&s, &p, 3, 2, now + 60_000, 3_000, 2_000, false).await.unwrap();
    assert_eq!(synced, PermitSynced::Blocked);
    match scripts::permit_take(&s, &p, "b", 2_000, "").await.unwrap() {
        PermitTake::Blocked { ms } => assert!((1..=3_000).contains(&ms), "{ms}"),
        other => panic!("{other:?}"),
    }
    // A second replica's sync of the same answer, now that the state is
    // whole again, adds no block of its own.
    let again = scripts::permit_sync(&s, &p, 3, 2, now + 60_000, 30_000, 2_000, false).await.unwrap();
    assert_eq!(again, PermitSynced::Synced);
    let st = scripts::permit_plan(&s, &p, None).await.unwrap().state.unwrap();
    assert!(st.blocked_in_ms <= 3_000, "{}", st.blocked_in_ms);
    // The whole keyspace lost while an answer was on its way (the caller
    // planned on a whole state): applying it as a conflict blocks too.
    let _: () = redis::cmd("FLUSHALL").query_async(&mut c).await.unwrap();
    let late = scripts::permit_sync(&s, &p, 4, 2, now + 60_000, 3_000, 2_000, false).await.unwrap();
    assert_eq!(late, PermitSynced::Blocked);
    assert!(matches!(
        scripts::permit_take(&s, &p, "c", 2_000, "").await.unwrap(),
        PermitTake::Blocked { .. }
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_id_is_the_same_permit_for_its_holder_and_expired_permits_are_purged_in_steps() {
    let redis = TestRedis::start();
    let s = store(&redis).await;
    let p = Keys::new("").permit_quota("acme", "export");
    seeded(&s, &p, 3_000, 120_000, 60_000).await;
    let id = regional_agent::permits::new_id("acme", "export", Some("job-1"));
    assert!(taken(&scripts::permit_take(&s, &p, &id, 60_000, "alice").await.unwrap()));
    match scripts::permit_take(&s, &p, &id, 60_000, "alice").await.unwrap() {
        PermitTake::Taken { dup, .. } => assert!(dup),
        other => panic!("{other:?}"),
    }
    assert_eq!(scripts::permit_take(&s, &p, &id, 60_000, "bob").await.unwrap(), PermitTake::Mismatch);
    // 6,000 permits already expired (written directly, as a long pause
    // would leave them): one run purges 5,000 at most, never failing, the
    // next the rest, and their holders go with them.
    let mut c =
        redis::Client::open(redis.url.as_str()).unwrap().get_multiplexed_async_connection().await.unwrap();
    for chunk in 0..6 {
        let mut z = redis::cmd("ZADD");
        z.arg(format!("{p}pz"));
        let mut h = redis::cmd("HSET");
        h.arg(format!("{p}ph"));
        for i in chunk * 1_000..(chunk + 1) * 1_000 {
            z.arg(1).arg(format!("x{i}"));
            h.arg(format!("x{i}")).arg("k");
        }
        let _: i64 = z.query_async(&mut c).await.unwrap();
        let _: i64 = h.query_async(&mut c).await.unwrap();
    }
    let first = scripts::permit_plan(&s, &p, None).await.unwrap().state.unwrap();
    assert_eq!(first.live, 1 + 1_000, "5,000 purged by one run");
    let second = scripts::permit_plan(&s, &p, None).await.unwrap().state.unwrap();
    assert_eq!(second.live, 1, "only job-1's permit is left");
    let holders: i64 = redis::cmd("HLEN").arg(format!("{p}ph")).query_async(&mut c).await.unwrap();
    assert_eq!(holders, 1);
}
