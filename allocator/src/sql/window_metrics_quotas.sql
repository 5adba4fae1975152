-- The $2 quotas with the most tokens granted in their open and previous
-- windows ($1 = now, Unix seconds, on the database clock), busiest first;
-- quotas with no pool in those two windows are left out.
with q as (
    select tenant, resource, window_secs, $1 - $1 % window_secs as open_start
    from policy
)
select q.tenant, q.resource, q.window_secs
from q
join pool p
  on p.tenant = q.tenant and p.resource = q.resource and p.window_secs = q.window_secs
 and p.window_start in (q.open_start, q.open_start - q.window_secs)
group by q.tenant, q.resource, q.window_secs
order by sum(p.granted) desc, q.tenant, q.resource
limit $2
