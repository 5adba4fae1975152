insert into policy_version (tenant, resource, version, limit_tokens, window_secs, chunk_min, chunk_max,
                            lease_ttl_secs, fallback_per_region, fail_mode, updated_at, updated_by,
                            per_key_rate_milli, per_key_burst, enforce, on_stale, reserve, kind, permit_ttl_secs)
select tenant, resource, version, limit_tokens, window_secs, chunk_min, chunk_max,
       lease_ttl_secs, fallback_per_region, fail_mode, updated_at, updated_by,
       per_key_rate_milli, per_key_burst, enforce, on_stale, reserve, kind, permit_ttl_secs
from policy
where tenant = $1 and resource = $2 and version = $3
