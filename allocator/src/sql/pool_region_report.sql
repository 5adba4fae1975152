insert into pool_region (tenant, resource, window_start, window_secs, region, consumed, fallback_admitted)
values ($1, $2, $3, $4, $5, $6, $7)
on conflict (tenant, resource, window_start, window_secs, region) do update
set consumed = pool_region.consumed + excluded.consumed,
    fallback_admitted = pool_region.fallback_admitted + excluded.fallback_admitted
