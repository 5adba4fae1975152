update lease set unspent = $2, returned = $3, released_at = $4
where lease_id = $1
returning lease_id, tenant, resource, region, agent, epoch, seq, window_start, window_secs, want, demand_per_sec,
          window_sel, tokens, issued_at, expires_at, policy_version, fallback_allowance, fail_mode, pool_limit,
          pool_granted, pool_available, retry_after_ms, unspent, returned, released_at,
          per_key_rate_milli, per_key_burst, enforce
