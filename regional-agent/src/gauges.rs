//! Gauges computed at each scrape of `/metrics` for alerts and dashboards:
//! who this agent is (`agent_info{region, agent}`, to join the other series
//! on a region), each quota's mode and the policy version it enforces, and
//! the offset of this host's clock against the allocator's; and the
//! per-quota count of 429 and 503 answers (`agent_quota_refusals_total`).
//!
//! The per-quota families are rebuilt whole at every scrape, so a quota
//! that leaves the agent's registry (idle for five minutes) leaves them too;
//! their size follows the registry's (see [`crate::quotas`]).

use crate::quotas::{PolicyInfo, Quotas};
use crate::scripts::View;
use quota_shared::prom::Registry;
use quota_shared::wire::FailMode;

/// Every mode a quota can be in, as `GET /v1/status` names it.
pub const MODES: [&str; 4] = ["leased", "fallback", "strict", "exhausted"];

/// A quota's mode: `strict` or `fallback` while the allocator is
/// unreachable (by its fail mode), `exhausted` while the pool is empty,
/// else `leased`.
pub fn mode(reachable: bool, policy: Option<PolicyInfo>, view: &View) -> &'static str {
    match (reachable, policy.map(|p| p.fail_mode)) {
        (false, Some(FailMode::Strict)) => "strict",
        (false, _) => "fallback",
        (true, _) if view.exhausted_ms > 0 => "exhausted",
        _ => "leased",
    }
}

/// Answers of `POST /v1/acquire` counted per quota by
/// [`count_decision`]: the 429 and the 503s.
pub const REFUSALS: [&str; 4] =
    ["quota_exhausted", "allocator_unreachable", "store_unavailable", "policy_stale"];

/// Counters without labels that start at 0, so that `increase()` sees their
/// first event (a series that appears at 1 shows no increase).
const ZERO_AT_START: [&str; 5] = [
    "agent_fallback_admits_total",
    "agent_redis_rollbacks_total",
    "agent_outbox_sent_total",
    "agent_outbox_dead_letters_total",
    "agent_spend_runs_total",
];

/// Counts an answer for a quota whose policy the agent knows, by the
/// policy's version (so a stream of unknown names never makes a series:
/// the families follow the quota registry): every decision in
/// `agent_quota_decisions_total`, the 429 and 503s also in
/// `agent_quota_refusals_total`. Their ratio per version is what a bad
/// policy change shows as (alert `QuotaPolicyVersionRefusalStep`).
pub fn count_decision(m: &Registry, quota: &str, policy: Option<PolicyInfo>, outcome: &str) {
    let Some(p) = policy else { return };
    let version = p.version.to_string();
    m.inc("agent_quota_decisions_total", &[("quota", quota), ("version", &version)]);
    if let Some(code) = REFUSALS.iter().find(|c| **c == outcome) {
        m.inc("agent_quota_refusals_total", &[("quota", quota), ("code", code), ("version", &version)]);
    }
}

/// Declares the families of this module and starts the label-less
/// counters at 0.
pub fn describe(m: &Registry) {
    for name in ZERO_AT_START {
        m.inc_by(name, &[], 0.0);
    }
    m.describe(
        "agent_quota_refusals_total",
        "counter",
        "Acquires answered 429 quota_exhausted or 503 (allocator_unreachable, store_unavailable, policy_stale), per quota with a known policy and its version",
    );
    m.describe(
        "agent_quota_decisions_total",
        "counter",
        "Acquires answered, per quota with a known policy and the policy version that decided",
    );
    m.describe(
        "agent_info",
        "gauge",
        "Always 1; its labels name the agent's region and id (join on instance)",
    );
    m.describe(
        "agent_quota_mode",
        "gauge",
        "1 for the mode each quota is in (leased, fallback, strict, exhausted), 0 for the others",
    );
    m.describe("agent_policy_version", "gauge", "The policy version this agent enforces, per quota");
    m.describe(
        "agent_policy_age_seconds",
        "gauge",
        "Seconds since a grant answer last confirmed the quota's policy (this replica's or, through Redis, another's), per quota",
    );
    m.describe(
        "agent_policy_stale",
        "gauge",
        "1 while the quota's policy is older than --max-policy-age-secs and the allocator is unreachable (its on_stale applies), else 0",
    );
    m.counter_from_zero(
        "agent_stale_policy_decisions_total",
        "Decisions made on a stale policy, by what its on_stale applied: kept (the last version), enforced (bounded, shadow mode off), refused (strict: 503 policy_stale)",
        "applied",
        &["kept", "enforced", "refused"],
    );
    m.describe(
        "agent_allocator_clock_offset_seconds",
        "gauge",
        "The allocator's clock minus this host's, read off the last grant answer (windows never use this host's clock; a large offset points at a broken NTP)",
    );
}

type Series = Vec<(Vec<(&'static str, String)>, f64)>;

/// Who the agent is, for `agent_info`.
pub struct Identity<'a> {
    pub region: &'a str,
    pub agent: &'a str,
}

/// What the policy ages are measured against.
pub struct Ages {
    /// `--max-policy-age-secs` (`None`: never stale).
    pub max: Option<std::time::Duration>,
    /// Wall-clock Unix ms now.
    pub now_ms: i64,
}

/// Rebuilds the families (called by `GET /metrics`) from the quotas the
/// agent holds, whether the allocator is `reachable`, the allocator's
/// clock `offset` to this host's, and the policies' ages.
pub fn refresh(
    m: &Registry,
    who: Identity<'_>,
    quotas: &Quotas,
    reachable: bool,
    offset: Option<chrono::Duration>,
    ages: Ages,
) {
    m.set_family(
        "agent_info",
        vec![(vec![("region", who.region.to_string()), ("agent", who.agent.to_string())], 1.0)],
    );
    let (mut modes, mut versions, mut age_series, mut stale): (Series, Series, Series, Series) =
        Default::default();
    for q in quotas.all() {
        let quota = format!("{}/{}", q.tenant, q.resource);
        let policy = q.policy();
        let now = mode(reachable, policy, &q.view.lock().unwrap());
        for md in MODES {
            modes.push((
                vec![("quota", quota.clone()), ("mode", md.to_string())],
                f64::from(u8::from(md == now)),
            ));
        }
        if let Some(ms) = q.confirmed.age_ms(ages.now_ms) {
            age_series.push((vec![("quota", quota.clone())], ms as f64 / 1000.0));
        }
        if let Some(p) = policy {
            let is_stale = q.confirmed.stale(ages.now_ms, ages.max, reachable);
            stale.push((vec![("quota", quota.clone())], f64::from(u8::from(is_stale))));
            versions.push((vec![("quota", quota)], p.version as f64));
        }
    }
    m.set_family("agent_quota_mode", modes);
    m.set_family("agent_policy_version", versions);
    m.set_family("agent_policy_age_seconds", age_series);
    m.set_family("agent_policy_stale", stale);
    if let Some(off) = offset {
        m.set("agent_allocator_clock_offset_seconds", &[], off.num_milliseconds() as f64 / 1000.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decisions_and_refusals_are_counted_per_known_quota_and_version() {
        let m = Registry::default();
        let v = |version| PolicyInfo {
            limit: 1,
            window_secs: 60,
            fail_mode: FailMode::Strict,
            fallback_allowance: 0,
            version,
            per_key: None,
            enforce: true,
            on_stale: Default::default(),
            held: [0; 5],
        };
        count_decision(&m, "atlas/read", Some(v(3)), "quota_exhausted");
        count_decision(&m, "atlas/read", Some(v(3)), "lease");
        count_decision(&m, "atlas/read", Some(v(4)), "lease");
        count_decision(&m, "nosuch/quota", None, "store_unavailable");
        let text = m.render();
        for line in [
            "agent_quota_refusals_total{quota=\"atlas/read\",code=\"quota_exhausted\",version=\"3\"} 1",
            "agent_quota_decisions_total{quota=\"atlas/read\",version=\"3\"} 2",
            "agent_quota_decisions_total{quota=\"atlas/read\",version=\"4\"} 1",
        ] {
            assert!(text.contains(line), "{line}: {text}");
        }
        assert!(!text.contains("nosuch"), "{text}");
        assert!(!text.contains("code=\"lease\""), "{text}");
    }

    #[test]
    fn mode_follows_reachability_fail_mode_and_exhaustion() {
        let p = |fail_mode| PolicyInfo {
            limit: 1,
            window_secs: 60,
            fail_mode,
            fallback_allowance: 0,
            version: 1,
            per_key: None,
            enforce: true,
            on_stale: Default::default(),
            held: [0; 5],
        };
        let idle = View::default();
        let empty = View { exhausted_ms: 500, ..View::default() };
        assert_eq!(mode(true, Some(p(FailMode::Bounded)), &idle), "leased");
        assert_eq!(mode(true, Some(p(FailMode::Bounded)), &empty), "exhausted");
        assert_eq!(mode(false, Some(p(FailMode::Bounded)), &empty), "fallback");
        assert_eq!(mode(false, Some(p(FailMode::Strict)), &idle), "strict");
        assert_eq!(mode(false, None, &idle), "fallback");
    }
}
