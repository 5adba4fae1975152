//! `lua/credit.lua` on a real Redis: a lease that arrives expired is never
//! spendable, its tokens go back through the outbox, a replay of it is
//! still known, and its book is kept only as long as a finished one's
//! (ten minutes), not for the counters' week.

use quota_tests::redis::TestRedis;
use regional_agent::client::TlsFiles;
use regional_agent::keys::Keys;
use regional_agent::scripts::{self, Caller, Credit, Lease, On, Outcome, ViewArgs};
use regional_agent::store::Store;
use std::time::Duration;

/// prelude.lua's BOOK_KEEP_MS.
const BOOK_KEEP_MS: i64 = 600_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_expired_on_arrival_goes_back_and_its_book_is_kept_ten_minutes() {
    let redis = TestRedis::start();
    let store = Store::connect(
        std::slice::from_ref(&redis.url),
        false,
        None,
        &TlsFiles::default(),
        Duration::from_secs(2),
    )
    .await
    .expect("store");
    let prefix = Keys::new("").quota("acme", "search");
    let by = Caller { agent: "eu-1", epoch: 1 };
    let first = scripts::view(
        &store,
        On { prefix: &prefix, token: "" },
        by,
        ViewArgs { window_secs: 60, allowance: 0, lasting_ms: 0 },
    )
    .await
    .expect("view");
    let Outcome::Ran { token, .. } = first else {
        panic!("a first view installs the incarnation: {first:?}")
    };
    let ws = chrono::Utc::now().timestamp() / 60 * 60;
    let lease = Lease {
        id: "lease-1".into(),
        epoch: 1,
        tokens: 7,
        window_start: ws,
        life_ms: -3,
        nb_ms: 0,
        alloc_now_ms: chrono::Utc::now().timestamp_millis(),
        pool_available: 100,
    };
    let on = On { prefix: &prefix, token: &token };
    let r = scripts::credit(&store, on, "eu-1", &lease).await.expect("credit");
    assert!(matches!(r, Outcome::Ran { value: Credit::Expired, .. }), "{r:?}");

    let mut c =
        redis::Client::open(redis.url.as_str()).unwrap().get_multiplexed_async_connection().await.unwrap();
    let book = format!("{prefix}l:lease-1");
    let pttl: i64 = redis::cmd("PTTL").arg(&book).query_async(&mut c).await.unwrap();
    assert!(0 < pttl && pttl <= BOOK_KEEP_MS, "the expired lease's book lives {pttl} ms");
    let live: i64 =
        redis::cmd("EXISTS").arg(format!("{prefix}live:lease-1")).query_async(&mut c).await.unwrap();
    assert_eq!(live, 0, "an expired lease is never spendable");
    let outbox: Vec<String> = redis::cmd("LRANGE")
        .arg(format!("{prefix}ob:eu-1"))
        .arg(0)
        .arg(-1)
        .query_async(&mut c)
        .await
        .unwrap();
    assert_eq!(outbox.len(), 1, "{outbox:?}");
    let entry: serde_json::Value = serde_json::from_str(&outbox[0]).unwrap();
    assert_eq!((entry["k"].as_str(), entry["u"].as_i64()), (Some("rel"), Some(7)), "{entry}");
    // A replay of the same grant is known, and releases nothing twice.
    let again = scripts::credit(&store, on, "eu-1", &lease).await.expect("credit again");
    assert!(matches!(again, Outcome::Ran { value: Credit::Replayed, .. }), "{again:?}");
    let n: i64 = redis::cmd("LLEN").arg(format!("{prefix}ob:eu-1")).query_async(&mut c).await.unwrap();
    assert_eq!(n, 1);
}
