-- One round trip while the pool row is locked: insert the lease, debit the
-- pool and the region, append the `granted` ledger event.
with l as (
    insert into lease (lease_id, tenant, resource, region, agent, epoch, seq, window_start, window_secs, want,
                       demand_per_sec, window_sel, tokens, issued_at, expires_at, policy_version,
                       fallback_allowance, fail_mode, pool_limit, pool_granted, pool_available, retry_after_ms,
                       per_key_rate_milli, per_key_burst, enforce)
    values ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18, $19, $20, $21, $22,
            $23, $24, $25)
    returning *
), p as (
    update pool set granted = granted + $13
    where tenant = $2 and resource = $3 and window_start = $8 and window_secs = $9
), r as (
    update pool_region set granted = granted + $13
    where tenant = $2 and resource = $3 and window_start = $8 and window_secs = $9 and region = $4
), e as (
    insert into ledger_event (at, kind, tenant, resource, region, agent, epoch, seq, lease_id, tokens)
    select issued_at, 'granted', tenant, resource, region, agent, epoch, seq, lease_id, tokens from l
)
select lease_id, tenant, resource, region, agent, epoch, seq, window_start, window_secs, want, demand_per_sec,
       window_sel, tokens, issued_at, expires_at, policy_version, fallback_allowance, fail_mode, pool_limit,
       pool_granted, pool_available, retry_after_ms, unspent, returned, released_at,
       per_key_rate_milli, per_key_burst, enforce
from l
