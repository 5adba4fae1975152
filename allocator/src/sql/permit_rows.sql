-- Every region's permit lease of a quota, by region.
select region, held, seq, expires_at, ttl_secs, updated_at
from permit_lease
where tenant = $1 and resource = $2
order by region
