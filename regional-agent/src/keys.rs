//! The one audited function family that names Redis keys (DESIGN §5
//! Security). Every key of a quota starts with `q:{<tenant>/<resource>}:`
//! where both parts are length-prefixed (`q:{5:atlas/4:read}:`), so the
//! hash tag puts all of a quota's keys in one Redis Cluster slot (each
//! script touches one slot) and two quotas can never share a key, whatever
//! their names. Lua scripts receive the quota prefix from here and only
//! append fixed suffixes and ids to it.

/// TTL of the region's counters and lease books (and of the sets that
/// lead to them): long enough to outlive a long partition before the
/// counts are reported (F04, see the crate doc's key lifecycle).
pub const COUNTER_TTL_MS: i64 = 7 * 24 * 3600 * 1000;

/// Key names of one agent's Redis namespace.
#[derive(Debug, Clone)]
pub struct Keys {
    ns: String,
}

fn lp(s: &str) -> String {
    format!("{}:{s}", s.len())
}

impl Keys {
    /// Keys under the namespace prefix `ns` (checked brace-free by the config).
    pub fn new(ns: &str) -> Keys {
        debug_assert!(!ns.contains(['{', '}']));
        Keys { ns: ns.to_string() }
    }

    /// The prefix of every key of one quota; ends with `:`.
    pub fn quota(&self, tenant: &str, resource: &str) -> String {
        format!("{}q:{{{}/{}}}:", self.ns, lp(tenant), lp(resource))
    }

    /// The set of quotas an agent has touched (so a restarted agent finds
    /// its outboxes and old leases).
    pub fn agent_quotas(&self, region: &str, agent: &str) -> String {
        format!("{}a:{{{}/{}}}:quotas", self.ns, lp(region), lp(agent))
    }

    /// The region's incarnation key: missing at start means the region's
    /// Redis is new or lost its data while no agent watched.
    pub fn region_incarnation(&self, region: &str) -> String {
        format!("{}r:{{{}}}:inc", self.ns, lp(region))
    }

    /// A request id's claim, tenant-wide: which quota and cost the id was
    /// first used with, so a repeat naming another quota or cost is refused
    /// (`409 request_id_mismatch`) instead of answered with the first
    /// decision.
    pub fn request_id_claim(&self, tenant: &str, request_id: &str) -> String {
        format!("{}t:{{{}}}:rid:{}", self.ns, lp(tenant), lp(request_id))
    }

    /// An agent's liveness key (expires when the agent stops refreshing it):
    /// the region's other replicas adopt the outboxes of an agent whose
    /// liveness key is gone.
    pub fn agent_live(&self, region: &str, agent: &str) -> String {
        format!("{}a:{{{}/{}}}:live", self.ns, lp(region), lp(agent))
    }

    /// The set of agent ids that ever ran in the region (and may still have
    /// outbox entries); an id leaves it once its quota set expired.
    pub fn region_agents(&self, region: &str) -> String {
        format!("{}r:{{{}}}:agents", self.ns, lp(region))
    }

    /// The region's dead letters: outbox entries the allocator refused for
    /// a reason that can never change, kept for operators (capped list).
    pub fn region_dead_letters(&self, region: &str) -> String {
        format!("{}r:{{{}}}:dead", self.ns, lp(region))
    }

    /// A quota's incarnation key (`KEYS[1]` of every script: the key that
    /// routes a script to the quota's Cluster slot).
    pub fn incarnation(quota_prefix: &str) -> String {
        format!("{quota_prefix}inc")
    }

    /// A quota's cached policy (hash), shared by the region's replicas.
    pub fn policy(quota_prefix: &str) -> String {
        format!("{quota_prefix}pol")
    }

    /// A quota's renew lock (one replica renews at a time).
    pub fn renew_lock(quota_prefix: &str) -> String {
        format!("{quota_prefix}lock")
    }

    /// A quota's "the allocator said the pool is empty" mark.
    pub fn exhausted(quota_prefix: &str) -> String {
        format!("{quota_prefix}exh")
    }

    /// A quota's set of windows with counts not yet cut into an outbox.
    pub fn dirty(quota_prefix: &str) -> String {
        format!("{quota_prefix}dirty")
    }

    /// The outbox list of `agent` for the quota with prefix `quota_prefix`.
    pub fn outbox(quota_prefix: &str, agent: &str) -> String {
        format!("{quota_prefix}ob:{agent}")
    }

    /// The suffix a request id takes after the quota prefix.
    pub fn request_id_suffix(request_id: &str) -> String {
        lp(request_id)
    }

    /// The suffix of a principal's per-key bucket after the quota prefix
    /// and `k:` (length-prefixed, so no two keys share a bucket).
    pub fn per_key_suffix(key: &str) -> String {
        lp(key)
    }

    /// A principal's per-key bucket in a quota (a hash `{t, at}`, see
    /// `lua/spend.lua`, which appends `k:` and the suffix itself).
    pub fn per_key_bucket(quota_prefix: &str, key: &str) -> String {
        format!("{quota_prefix}k:{}", Self::per_key_suffix(key))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quota_keys_are_hash_tagged_and_unambiguous() {
        let k = Keys::new("");
        assert_eq!(k.quota("atlas", "read"), "q:{5:atlas/4:read}:");
        assert_ne!(k.quota("ab", "c"), k.quota("a", "bc"));
        assert_ne!(k.quota("a.b", "c"), k.quota("a", "b.c"));
        let ns = Keys::new("t1:");
        assert_eq!(ns.quota("a", "b"), "t1:q:{1:a/1:b}:");
        assert_eq!(ns.agent_quotas("eu", "eu-1"), "t1:a:{2:eu/4:eu-1}:quotas");
        assert_eq!(Keys::request_id_suffix("r-1"), "3:r-1");
        assert_eq!(Keys::per_key_suffix("alice@x"), "7:alice@x");
        assert_ne!(Keys::per_key_suffix("a:1"), Keys::per_key_suffix("a"));
        assert_eq!(Keys::per_key_bucket("q:{1:a/1:b}:", "u1"), "q:{1:a/1:b}:k:2:u1");
        assert_eq!(ns.request_id_claim("a", "r-1"), "t1:t:{1:a}:rid:3:r-1");
        assert_ne!(k.request_id_claim("a:1", "r"), k.request_id_claim("a", "1:r"));
        assert_eq!(ns.agent_live("eu", "eu-1"), "t1:a:{2:eu/4:eu-1}:live");
        assert_eq!(ns.region_agents("eu"), "t1:r:{2:eu}:agents");
        assert_eq!(ns.region_dead_letters("eu"), "t1:r:{2:eu}:dead");
        assert_eq!(Keys::outbox("q:{1:a/1:b}:", "eu-1"), "q:{1:a/1:b}:ob:eu-1");
        let p = k.quota("a", "b");
        let suffixes = [
            Keys::incarnation(&p),
            Keys::policy(&p),
            Keys::renew_lock(&p),
            Keys::exhausted(&p),
            Keys::dirty(&p),
        ];
        assert_eq!(
            suffixes,
            [
                "q:{1:a/1:b}:inc",
                "q:{1:a/1:b}:pol",
                "q:{1:a/1:b}:lock",
                "q:{1:a/1:b}:exh",
                "q:{1:a/1:b}:dirty"
            ]
        );
    }
}
