select version, limit_tokens as "limit", window_secs, chunk_min, chunk_max, lease_ttl_secs, fallback_per_region,
       fail_mode, per_key_rate_milli, per_key_burst, enforce, on_stale, reserve, kind, permit_ttl_secs,
       updated_at as changed_at, updated_by as changed_by
from policy_version
where tenant = $1 and resource = $2
order by version
limit $3
