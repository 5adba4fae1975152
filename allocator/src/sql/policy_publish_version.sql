-- Puts version $3's fields (a policy_version row) in force as version $4:
-- a promoted rollout's candidate (then $4 = $3), or the version in force
-- when a halted rollout started, renumbered above its candidate.
update policy p
set limit_tokens = v.limit_tokens, window_secs = v.window_secs, chunk_min = v.chunk_min,
    chunk_max = v.chunk_max, lease_ttl_secs = v.lease_ttl_secs, fallback_per_region = v.fallback_per_region,
    fail_mode = v.fail_mode, per_key_rate_milli = v.per_key_rate_milli, per_key_burst = v.per_key_burst,
    enforce = v.enforce, on_stale = v.on_stale, reserve = v.reserve, version = $4, updated_at = $5,
    updated_by = $6
from policy_version v
where p.tenant = $1 and p.resource = $2 and v.tenant = $1 and v.resource = $2 and v.version = $3
returning p.tenant, p.resource, p.limit_tokens, p.window_secs, p.chunk_min, p.chunk_max, p.lease_ttl_secs,
          p.fallback_per_region, p.fail_mode, p.per_key_rate_milli, p.per_key_burst, p.enforce, p.on_stale,
          p.reserve, p.kind, p.permit_ttl_secs, p.version, p.updated_at
