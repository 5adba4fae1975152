-- Every region's permit lease of a quota, by region.
select region, held, seq, expires_at, updated_at
from permit_lease
where tenant = $1 and resource = $2
order by region
