-- Pools of one quota breaking I1, or whose granted differs from the sum of
-- their leases (a double debit or a lost lease row).
select p.window_start, p.limit_tokens, p.granted, p.returned, coalesce(sum(l.tokens), 0)::bigint as "lease_tokens!"
from pool p
left join lease l
  on (l.tenant, l.resource, l.window_start, l.window_secs) = (p.tenant, p.resource, p.window_start, p.window_secs)
where p.tenant = $1 and p.resource = $2
group by p.window_start, p.window_secs, p.limit_tokens, p.granted, p.returned
having p.granted - p.returned > p.limit_tokens or p.granted <> coalesce(sum(l.tokens), 0)
