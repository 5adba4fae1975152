-- The first $5 pools of the range with their region rows.
with p as (
    select tenant, resource, window_start, window_secs, limit_tokens, fallback_per_region, granted, returned, fallback_owed
    from pool
    where tenant = $1 and resource = $2 and window_start >= $3 and window_start < $4
    order by window_start, window_secs
    limit $5
)
select p.window_start, p.window_secs, p.limit_tokens, p.fallback_per_region, p.granted, p.returned, p.fallback_owed,
       -- "?": null for a pool without region rows (the macros cannot tell
       -- that from the outer join).
       r.region as "region?", r.granted as "r_granted?", r.returned as "r_returned?", r.consumed as "r_consumed?",
       r.fallback_admitted as "r_fallback?", r.demand_per_sec as "r_demand?",
       r.shadow_refused as "r_shadow_refused?"
from p
left join pool_region r
  on r.tenant = p.tenant and r.resource = p.resource
 and r.window_start = p.window_start and r.window_secs = p.window_secs
order by p.window_start, p.window_secs, r.region
