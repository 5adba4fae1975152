-- One bounded batch of permit leases expired before $1: their permits are
-- long back in the pool, and a region that asks again starts from no lease
-- (its stale seq is answered as a conflict with seq 0 first).
delete from permit_lease
where (tenant, resource, region) in (
    select tenant, resource, region from permit_lease where expires_at < $1 order by expires_at limit $2
)
