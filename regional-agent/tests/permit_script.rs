//! `lua/permit.lua` on a real Redis, rule by rule: a region never hands
//! out more than its cap, a late answer cannot raise a cap lowered since
//! or stretch the lease, a renewal never outlives the lease nor a state
//! the server cannot vouch for, a lost state blocks hand-outs, expired
//! permits are purged in bounded steps, and a retried request id gets the
//! same permit only for the same holder.

use quota_tests::redis::TestRedis;
use regional_agent::client::TlsFiles;
use regional_agent::keys::Keys;
use regional_agent::scripts::{self, PermitReturn, PermitTake};
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
    assert!(scripts::permit_sync(s, p, 1, cap, plan.now_ms + lease_ms, 0, ttl_ms, false).await.unwrap());
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
    assert!(scripts::permit_sync(&s, &p, 1, 2, now + 60_000, 0, 10_000, false).await.unwrap());
    assert_eq!(scripts::permit_plan(&s, &p, None).await.unwrap().state.unwrap().cap, 1);
    // An older seq is ignored; an apply at a seq the state left is stale.
    assert!(!scripts::permit_sync(&s, &p, 0, 3, now + 60_000, 0, 10_000, false).await.unwrap());
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
    // A lease of 5 s and permits of 60 s: no hand-out (it would outlive the lease).
    seeded(&s, &p, 2, 5_000, 60_000).await;
    assert_eq!(
        scripts::permit_take(&s, &p, "a", 60_000, "").await.unwrap(),
        PermitTake::Lease { live: 0, cap: 2 }
    );
    // Permits of 2 s fit; a renewal by the kept TTL (60 s) stops at the lease.
    assert!(taken(&scripts::permit_take(&s, &p, "a", 2_000, "alice").await.unwrap()));
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
    // A sync after a loss with a block: hand-outs wait for it.
    let now = scripts::permit_plan(&s, &p, None).await.unwrap().now_ms;
    assert!(scripts::permit_sync(&s, &p, 3, 2, now + 60_000, now + 3_000, 2_000, false).await.unwrap());
    match scripts::permit_take(&s, &p, "b", 2_000, "").await.unwrap() {
        PermitTake::Blocked { ms } => assert!((2_000..=3_000).contains(&ms), "{ms}"),
        other => panic!("{other:?}"),
    }
    // A second replica's sync of the same answer, now that the state is
    // whole again, adds no block of its own.
    assert!(scripts::permit_sync(&s, &p, 3, 2, now + 60_000, now + 30_000, 2_000, false).await.unwrap());
    let st = scripts::permit_plan(&s, &p, None).await.unwrap().state.unwrap();
    assert!(st.blocked_in_ms <= 3_000, "{}", st.blocked_in_ms);
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
    // 2,000 permits of 1 ms expire at once: purged 5,000 per run at most,
    // never failing, and their holders go with them.
    for i in 0..2_000 {
        assert!(taken(&scripts::permit_take(&s, &p, &format!("x{i}"), 1, "k").await.unwrap()), "{i}");
    }
    // Their 1 ms pass: only job-1's permit is left.
    quota_tests::wait::until("the 1 ms permits purged", Duration::from_secs(5), || async {
        let st = scripts::permit_plan(&s, &p, None).await.unwrap().state.unwrap();
        (st.live == 1).then_some(())
    })
    .await;
    let mut c =
        redis::Client::open(redis.url.as_str()).unwrap().get_multiplexed_async_connection().await.unwrap();
    let holders: i64 = redis::cmd("HLEN").arg(format!("{p}ph")).query_async(&mut c).await.unwrap();
    assert_eq!(holders, 1);
}
