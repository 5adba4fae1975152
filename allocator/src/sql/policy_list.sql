select tenant, resource, limit_tokens, window_secs, chunk_min, chunk_max, lease_ttl_secs,
       fallback_per_region, fail_mode, per_key_rate_milli, per_key_burst, enforce, on_stale, reserve, kind,
       permit_ttl_secs, version, updated_at
from policy
order by tenant, resource
limit $1
