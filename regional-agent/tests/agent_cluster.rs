//! The agent against a local 3-master Redis Cluster (started by the
//! harness): every quota's keys share one slot, so each script runs on one
//! node, and I5 holds as with a single server.

mod common;

use common::World;

/// I5 on Redis Cluster: two replicas of one region pointed at the cluster
/// node list, 64 concurrent clients: exactly as many 200s as tokens the
/// allocator granted to the region, none spent twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_two_replicas_and_64_clients_admit_exactly_the_tokens_granted() {
    let w = World::start_cluster().await;
    assert_eq!(w.redis_url().split(',').count(), 3, "{}", w.redis_url());
    common::i5_two_replicas_64_clients(&w).await;
    // The agents' state lives in the cluster, not in the single server.
    let sizes = w.cluster.as_ref().expect("cluster").dbsizes();
    assert!(sizes.iter().sum::<u64>() > 0, "no keys in the cluster: {sizes:?}");
    let single = std::process::Command::new("redis-cli")
        .args(["-p", &w.redis.port().to_string(), "dbsize"])
        .output()
        .expect("redis-cli");
    assert_eq!(String::from_utf8_lossy(&single.stdout).trim(), "0", "the single Redis stays unused");
}

/// Several quotas of one tenant in one decision on a 3-master Cluster: the
/// tenant's keys share a slot, so one script run decides both (a
/// cross-slot run would fail every request).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_two_quotas_are_debited_together_or_not_at_all() {
    let w = World::start_cluster().await;
    common::multi_quota_all_or_nothing(&w).await;
}
