insert into lease (lease_id, tenant, resource, region, agent, epoch, seq, window_start, window_secs, want,
                   demand_per_sec, window_sel, tokens, issued_at, expires_at, policy_version,
                   fallback_allowance, fail_mode, pool_limit, pool_granted, pool_available, retry_after_ms)
values ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18, $19, $20, $21, $22)
returning lease_id, tenant, resource, region, agent, epoch, seq, window_start, window_secs, want, demand_per_sec,
          window_sel, tokens, issued_at, expires_at, policy_version, fallback_allowance, fail_mode, pool_limit,
          pool_granted, pool_available, retry_after_ms, unspent, returned, released_at
