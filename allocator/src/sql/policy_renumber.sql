-- Publishes the version in force again under a newer number: a halted
-- rollout's canary goes back to it while versions only move forward.
update policy
set version = $3, updated_at = $4, updated_by = $5
where tenant = $1 and resource = $2
returning tenant, resource, limit_tokens, window_secs, chunk_min, chunk_max, lease_ttl_secs,
          fallback_per_region, fail_mode, per_key_rate_milli, per_key_burst, enforce, on_stale, reserve, kind,
          permit_ttl_secs, version, updated_at
