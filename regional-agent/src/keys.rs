//! The one audited function family that names Redis keys (DESIGN §5
//! Security). Every key of a quota starts with `q:{<tenant>}:<resource>:`
//! where both parts are length-prefixed (`q:{5:atlas}:4:read:`), so the
//! hash tag puts all of a tenant's keys in one Redis Cluster slot (a script
//! deciding several quotas of one tenant touches one slot) and two quotas
//! can never share a key, whatever their names. Lua scripts receive the
//! quota prefixes from here and only append fixed suffixes and ids to them.
//!
//! Key layouts: agents before multi-quota decisions used one slot per
//! quota (`q:{5:atlas/4:read}:`, [`Layout::Legacy`]). A new agent writes
//! the tenant layout and, during a rolling upgrade, honours what the old
//! one leaves (see `crate::legacy`): it reports and releases what sits
//! under the old prefixes and takes no fallback allowance in a window an
//! old agent may have spent it in (F34).

/// TTL of the region's counters and lease books (and of the sets that
/// lead to them): long enough to outlive a long partition before the
/// counts are reported (F04, see the crate doc's key lifecycle).
pub const COUNTER_TTL_MS: i64 = 7 * 24 * 3600 * 1000;

/// The fixed suffixes a quota's keys take after its prefix
/// ([`Keys::quota`]). The Lua scripts append the same suffixes themselves
/// (`P .. 'dirty'`); the test `lua_suffixes_are_the_exported_ones` holds
/// the two lists together, so a key renamed on one side cannot silently
/// split the state in two.
pub mod suffix {
    /// The incarnation token (`KEYS[1]` of every script).
    pub const INCARNATION: &str = "inc";
    /// The cached policy (hash; written by Rust only).
    pub const POLICY: &str = "pol";
    /// The renew lock (written by Rust only; released by `lua/unlock.lua`,
    /// which gets the key whole).
    pub const RENEW_LOCK: &str = "lock";
    /// "The allocator said the pool is empty" mark.
    pub const EXHAUSTED: &str = "exh";
    /// Windows with counts not yet cut into an outbox (set).
    pub const DIRTY: &str = "dirty";
    /// Live leases (sorted set, score the window start).
    pub const LEASE_INDEX: &str = "idx";
    /// Fallback counter of a window (`fb:<window start>`).
    pub const FALLBACK: &str = "fb:";
    /// An agent's outbox list (`ob:<agent>`).
    pub const OUTBOX: &str = "ob:";
    /// A principal's per-key bucket (`k:<length-prefixed key>`).
    pub const PER_KEY: &str = "k:";
    /// The region's fallback clock offset (scripts only).
    pub const CLOCK: &str = "clk";
    /// Counts of a window admitted from leases (`cons:<window start>`).
    pub const CONSUMED: &str = "cons:";
    /// Demand counter (scripts only).
    pub const DEMAND: &str = "dem";
    /// Counts of a window admitted from fallback (`fbr:<window start>`).
    pub const FALLBACK_REPORTED: &str = "fbr:";
    /// An agent's epoch fence (`fence:<agent>`).
    pub const FENCE: &str = "fence:";
    /// A lease's book (`l:<lease id>`).
    pub const LEASE: &str = "l:";
    /// A live lease's balance (`live:<lease id>`).
    pub const LIVE: &str = "live:";
    /// A lease's not-before time (`nb:<lease id>`).
    pub const NOT_BEFORE: &str = "nb:";
    /// A request id's answer within one quota (`rid:<request id>`).
    pub const REQUEST_ID: &str = "rid:";
    /// Shadow-mode refusals of a window (`shr:<window start>`).
    pub const SHADOW: &str = "shr:";
    /// The Redis server's run id the state was written on (rollback check).
    pub const SERVER: &str = "srv";
    /// Unleased tokens of a window's pool, the least a grant answer said
    /// (`room:<window start>`; for reserves).
    pub const POOL_ROOM: &str = "room:";
    /// A concurrency quota's permit lease in the region (hash; see
    /// `lua/permit.lua`).
    pub const PERMIT_LEASE: &str = "pm";
    /// Live permits (sorted set, score the expiry).
    pub const PERMITS: &str = "pz";
    /// Holders of the live permits (hash).
    pub const PERMIT_HOLDERS: &str = "ph";

    /// Every suffix the scripts append (all but the Rust-only ones).
    pub const IN_SCRIPTS: &[&str] = &[
        INCARNATION,
        EXHAUSTED,
        DIRTY,
        LEASE_INDEX,
        FALLBACK,
        OUTBOX,
        PER_KEY,
        CLOCK,
        CONSUMED,
        DEMAND,
        FALLBACK_REPORTED,
        FENCE,
        LEASE,
        LIVE,
        NOT_BEFORE,
        REQUEST_ID,
        SHADOW,
        SERVER,
        POOL_ROOM,
        PERMIT_LEASE,
        PERMITS,
        PERMIT_HOLDERS,
    ];
}

/// Which hash tag a quota's keys share.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// `q:{<tenant>}:<resource>:`: a tenant's quotas share one slot (the
    /// default, needed for a decision over several quotas on a Cluster).
    Tenant,
    /// `q:{<tenant>/<resource>}:`: the layout of agents before multi-quota
    /// decisions, kept so that an upgrade can be rehearsed and rolled back
    /// (`--key-layout legacy` behaves as those agents did).
    Legacy,
}

/// Key names of one agent's Redis namespace.
#[derive(Debug, Clone)]
pub struct Keys {
    ns: String,
    layout: Layout,
}

fn lp(s: &str) -> String {
    format!("{}:{s}", s.len())
}

impl Keys {
    /// Keys under the namespace prefix `ns` (checked brace-free by the config).
    pub fn new(ns: &str) -> Keys {
        Keys::with_layout(ns, Layout::Tenant)
    }

    /// Keys under `ns` in `layout`.
    pub fn with_layout(ns: &str, layout: Layout) -> Keys {
        debug_assert!(!ns.contains(['{', '}']));
        Keys { ns: ns.to_string(), layout }
    }

    /// The prefix of a concurrency quota's keys (`lua/permit.lua`): the
    /// tenant layout whatever this agent writes for rate quotas, since no
    /// agent of the legacy layout ever wrote permits, so that replicas of
    /// a region on either layout share one permit state.
    pub fn permit_quota(&self, tenant: &str, resource: &str) -> String {
        format!("{}q:{{{}}}:{}:", self.ns, lp(tenant), lp(resource))
    }

    /// The layout this agent writes.
    pub fn layout(&self) -> Layout {
        self.layout
    }

    /// The prefix of every key of one quota; ends with `:`.
    pub fn quota(&self, tenant: &str, resource: &str) -> String {
        match self.layout {
            Layout::Tenant => self.permit_quota(tenant, resource),
            Layout::Legacy => self.legacy_quota(tenant, resource),
        }
    }

    /// The prefix the same quota had in the legacy layout.
    pub fn legacy_quota(&self, tenant: &str, resource: &str) -> String {
        format!("{}q:{{{}/{}}}:", self.ns, lp(tenant), lp(resource))
    }

    /// Every prefix the quota's keys may sit under in this region: this
    /// agent's, then (tenant layout) the legacy one an older agent wrote.
    pub fn quota_prefixes(&self, tenant: &str, resource: &str) -> Vec<String> {
        match self.layout {
            Layout::Tenant => vec![self.quota(tenant, resource), self.legacy_quota(tenant, resource)],
            Layout::Legacy => vec![self.legacy_quota(tenant, resource)],
        }
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

    /// The set of agent ids of this agent's layout that ever ran in the
    /// region (and may still have outbox entries); an id leaves it once its
    /// quota set expired. Agents of the tenant layout keep a set of their
    /// own: an older agent, which knows only legacy prefixes, would find a
    /// gone new agent's outboxes empty and drop it from the set before a
    /// new agent sent them.
    pub fn region_agents(&self, region: &str) -> String {
        match self.layout {
            Layout::Tenant => format!("{}r:{{{}}}:agents:2", self.ns, lp(region)),
            Layout::Legacy => self.legacy_region_agents(region),
        }
    }

    /// The legacy layout's agent set (its agents' ids).
    pub fn legacy_region_agents(&self, region: &str) -> String {
        format!("{}r:{{{}}}:agents", self.ns, lp(region))
    }

    /// Every agent set whose gone agents this agent adopts.
    pub fn agent_sets(&self, region: &str) -> Vec<String> {
        match self.layout {
            Layout::Tenant => vec![self.region_agents(region), self.legacy_region_agents(region)],
            Layout::Legacy => vec![self.legacy_region_agents(region)],
        }
    }

    /// Until when (Redis clock, ms) a legacy agent may have admitted from
    /// the fallback allowance in the region (see `crate::legacy`).
    pub fn region_legacy_until(&self, region: &str) -> String {
        format!("{}r:{{{}}}:legacy", self.ns, lp(region))
    }

    /// The region's dead letters: outbox entries the allocator refused for
    /// a reason that can never change, kept for operators (capped list).
    pub fn region_dead_letters(&self, region: &str) -> String {
        format!("{}r:{{{}}}:dead", self.ns, lp(region))
    }

    /// A quota's incarnation key (`KEYS[1]` of every script: the key that
    /// routes a script to the quota's Cluster slot).
    pub fn incarnation(quota_prefix: &str) -> String {
        format!("{quota_prefix}{}", suffix::INCARNATION)
    }

    /// A quota's cached policy (hash), shared by the region's replicas.
    pub fn policy(quota_prefix: &str) -> String {
        format!("{quota_prefix}{}", suffix::POLICY)
    }

    /// A quota's renew lock (one replica renews at a time).
    pub fn renew_lock(quota_prefix: &str) -> String {
        format!("{quota_prefix}{}", suffix::RENEW_LOCK)
    }

    /// A quota's "the allocator said the pool is empty" mark.
    pub fn exhausted(quota_prefix: &str) -> String {
        format!("{quota_prefix}{}", suffix::EXHAUSTED)
    }

    /// What a quota's pool of the window starting at `ws` still held
    /// unleased, the least a grant answer said.
    pub fn pool_room(quota_prefix: &str, ws: i64) -> String {
        format!("{quota_prefix}{}{ws}", suffix::POOL_ROOM)
    }

    /// A quota's set of windows with counts not yet cut into an outbox.
    pub fn dirty(quota_prefix: &str) -> String {
        format!("{quota_prefix}{}", suffix::DIRTY)
    }

    /// A quota's demand counter (tokens asked, see `lua/spend.lua`).
    pub fn demand(quota_prefix: &str) -> String {
        format!("{quota_prefix}{}", suffix::DEMAND)
    }

    /// A quota's index of live leases (sorted set of lease ids, score the
    /// window start; kept by the scripts, see `lua/prelude.lua`).
    pub fn lease_index(quota_prefix: &str) -> String {
        format!("{quota_prefix}{}", suffix::LEASE_INDEX)
    }

    /// A quota's fallback counter of the window starting at `window_start`
    /// (written by `lua/prelude.lua`'s fallback path).
    pub fn fallback_counter(quota_prefix: &str, window_start: i64) -> String {
        format!("{quota_prefix}{}{window_start}", suffix::FALLBACK)
    }

    /// The outbox list of `agent` for the quota with prefix `quota_prefix`.
    pub fn outbox(quota_prefix: &str, agent: &str) -> String {
        format!("{quota_prefix}{}{agent}", suffix::OUTBOX)
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
        format!("{quota_prefix}{}{}", suffix::PER_KEY, Self::per_key_suffix(key))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quota_keys_are_hash_tagged_and_unambiguous() {
        let k = Keys::new("");
        assert_eq!(k.quota("atlas", "read"), "q:{5:atlas}:4:read:");
        assert_ne!(k.quota("ab", "c"), k.quota("a", "bc"));
        assert_ne!(k.quota("a.b", "c"), k.quota("a", "b.c"));
        assert_ne!(k.quota("a}", "c"), k.quota("a", "}c"));
        let ns = Keys::new("t1:");
        assert_eq!(ns.quota("a", "b"), "t1:q:{1:a}:1:b:");
        assert_eq!(ns.agent_quotas("eu", "eu-1"), "t1:a:{2:eu/4:eu-1}:quotas");
        assert_eq!(Keys::request_id_suffix("r-1"), "3:r-1");
        assert_eq!(Keys::per_key_suffix("alice@x"), "7:alice@x");
        assert_ne!(Keys::per_key_suffix("a:1"), Keys::per_key_suffix("a"));
        assert_eq!(Keys::per_key_bucket("q:{1:a/1:b}:", "u1"), "q:{1:a/1:b}:k:2:u1");
        assert_eq!(ns.request_id_claim("a", "r-1"), "t1:t:{1:a}:rid:3:r-1");
        assert_ne!(k.request_id_claim("a:1", "r"), k.request_id_claim("a", "1:r"));
        assert_eq!(ns.agent_live("eu", "eu-1"), "t1:a:{2:eu/4:eu-1}:live");
        assert_eq!(ns.region_agents("eu"), "t1:r:{2:eu}:agents:2");
        assert_eq!(ns.region_dead_letters("eu"), "t1:r:{2:eu}:dead");
        assert_eq!(Keys::outbox("q:{1:a/1:b}:", "eu-1"), "q:{1:a/1:b}:ob:eu-1");
        let p = Keys::new("").legacy_quota("a", "b");
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

    #[test]
    fn the_legacy_layout_names_keys_as_agents_before_it_did() {
        // These strings are what the previous release wrote: an upgrade
        // finds its state only if they never change.
        let old = Keys::with_layout("t1:", Layout::Legacy);
        assert_eq!(old.quota("atlas", "read"), "t1:q:{5:atlas/4:read}:");
        assert_eq!(old.region_agents("eu"), "t1:r:{2:eu}:agents");
        assert_eq!(old.agent_sets("eu"), ["t1:r:{2:eu}:agents"]);
        assert_eq!(old.quota_prefixes("a", "b"), ["t1:q:{1:a/1:b}:"]);
        let new = Keys::new("t1:");
        assert_eq!(new.quota_prefixes("a", "b"), ["t1:q:{1:a}:1:b:", "t1:q:{1:a/1:b}:"]);
        assert_eq!(new.agent_sets("eu"), ["t1:r:{2:eu}:agents:2", "t1:r:{2:eu}:agents"]);
        // Two quotas of one tenant share the hash tag (one Cluster slot).
        let tag = |p: &str| p[p.find('{').unwrap()..=p.find('}').unwrap()].to_string();
        assert_eq!(tag(&new.quota("atlas", "read")), tag(&new.quota("atlas", "write")));
        assert_eq!(tag(&new.quota("atlas", "read")), tag(&new.request_id_claim("atlas", "r")));
    }

    /// The suffixes the Lua scripts append (`P .. '<suffix>'`) are exactly
    /// the ones `suffix::IN_SCRIPTS` exports.
    #[test]
    fn lua_suffixes_are_the_exported_ones() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("lua");
        let mut in_lua = std::collections::BTreeSet::new();
        for e in std::fs::read_dir(&dir).unwrap() {
            let text = std::fs::read_to_string(e.unwrap().path()).unwrap();
            // Code only: comments name keys too (`P..'lock'` in unlock.lua).
            for code in text.lines().map(|l| l.split("--").next().unwrap_or_default()) {
                for part in code.split("P .. '").skip(1) {
                    in_lua.insert(part.split('\'').next().unwrap().to_string());
                }
            }
        }
        let exported: std::collections::BTreeSet<String> =
            suffix::IN_SCRIPTS.iter().map(|s| s.to_string()).collect();
        assert_eq!(in_lua, exported);
        for rust_only in [suffix::POLICY, suffix::RENEW_LOCK] {
            assert!(!in_lua.contains(rust_only), "{rust_only} is written by Rust only");
        }
    }
}
