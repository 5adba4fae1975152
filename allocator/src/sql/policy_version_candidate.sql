-- A staged rollout's candidate: a version written to policy_version only
-- (`policy` keeps the version in force until the rollout is promoted).
insert into policy_version (tenant, resource, version, limit_tokens, window_secs, chunk_min, chunk_max,
                            lease_ttl_secs, fallback_per_region, fail_mode, updated_at, updated_by,
                            per_key_rate_milli, per_key_burst, enforce, on_stale, reserve, kind, permit_ttl_secs)
values ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, 'rate', null)
