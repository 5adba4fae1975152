-- The pool of one window and one region's row in it; either may not exist yet.
select p.limit_tokens, p.fallback_per_region, p.granted, p.returned, p.fallback_owed,
       -- "?": null when the region has no row yet (the macros cannot tell
       -- that from the outer join).
       r.granted as "r_granted?", r.returned as "r_returned?", r.consumed as "r_consumed?",
       r.fallback_admitted as "r_fallback?", r.demand_per_sec as "r_demand?", r.last_want as "r_last_want?",
       r.demand_at as "r_demand_at?"
from pool p
left join pool_region r
  on r.tenant = p.tenant and r.resource = p.resource
 and r.window_start = p.window_start and r.window_secs = p.window_secs and r.region = $5
where p.tenant = $1 and p.resource = $2 and p.window_start = $3 and p.window_secs = $4
