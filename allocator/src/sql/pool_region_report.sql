insert into pool_region (tenant, resource, window_start, window_secs, region, consumed, fallback_admitted,
                         shadow_refused)
values ($1, $2, $3, $4, $5, $6, $7, $8)
on conflict (tenant, resource, window_start, window_secs, region) do update
set consumed = pool_region.consumed + excluded.consumed,
    fallback_admitted = pool_region.fallback_admitted + excluded.fallback_admitted,
    shadow_refused = pool_region.shadow_refused + excluded.shadow_refused
