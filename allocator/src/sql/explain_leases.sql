-- One region's leases of one window issued up to an instant.
select lease_id, tenant, resource, region, agent, epoch, seq, window_start, window_secs, want, demand_per_sec,
       window_sel, tokens, issued_at, expires_at, policy_version, fallback_allowance, fail_mode, pool_limit,
       pool_granted, pool_available, retry_after_ms, unspent, returned, released_at,
       per_key_rate_milli, per_key_burst, enforce
from lease
where tenant = $1 and resource = $2 and window_start = $3 and window_secs = $4 and region = $5
  and issued_at <= $6
order by issued_at, seq
limit $7
