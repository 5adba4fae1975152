-- For the first $2 quotas by tenant and resource (as policy_list.sql), the
-- pool of the window open at $1 (Unix seconds, on the database clock) with
-- its regions' admits summed and the regions that admitted from their
-- fallback allowance: the open-window columns of the /ui index.
-- Quotas without a pool in that window have no row.
with p as (
    select tenant, resource, window_secs, $1 - $1 % window_secs as open_start
    from policy
    order by tenant, resource
    limit $2
)
select o.tenant, o.resource, o.limit_tokens, o.fallback_per_region,
       count(r.region)::bigint as "regions!",
       coalesce(sum(r.consumed), 0)::bigint as "consumed!",
       coalesce(sum(r.fallback_admitted), 0)::bigint as "fallback_admitted!",
       coalesce(array_agg(r.region order by r.region) filter (where r.fallback_admitted > 0), '{}') as "fallback_regions!"
from p
join pool o
  on o.tenant = p.tenant and o.resource = p.resource
 and o.window_secs = p.window_secs and o.window_start = p.open_start
left join pool_region r
  on r.tenant = o.tenant and r.resource = o.resource
 and r.window_start = o.window_start and r.window_secs = o.window_secs
group by o.tenant, o.resource, o.window_start, o.window_secs, o.limit_tokens, o.fallback_per_region
