insert into policy (tenant, resource, limit_tokens, window_secs, chunk_min, chunk_max, lease_ttl_secs,
                    fallback_per_region, fail_mode, version, updated_at, updated_by, per_key_rate_milli,
                    per_key_burst, enforce, on_stale, reserve, kind, permit_ttl_secs)
values ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18, $19)
on conflict (tenant, resource) do update set
    limit_tokens = excluded.limit_tokens,
    window_secs = excluded.window_secs,
    chunk_min = excluded.chunk_min,
    chunk_max = excluded.chunk_max,
    lease_ttl_secs = excluded.lease_ttl_secs,
    fallback_per_region = excluded.fallback_per_region,
    fail_mode = excluded.fail_mode,
    version = excluded.version,
    updated_at = excluded.updated_at,
    updated_by = excluded.updated_by,
    per_key_rate_milli = excluded.per_key_rate_milli,
    per_key_burst = excluded.per_key_burst,
    enforce = excluded.enforce,
    on_stale = excluded.on_stale,
    reserve = excluded.reserve,
    kind = excluded.kind,
    permit_ttl_secs = excluded.permit_ttl_secs
returning tenant, resource, limit_tokens, window_secs, chunk_min, chunk_max, lease_ttl_secs,
          fallback_per_region, fail_mode, per_key_rate_milli, per_key_burst, enforce, on_stale, reserve, kind,
          permit_ttl_secs, version, updated_at
