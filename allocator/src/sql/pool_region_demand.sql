insert into pool_region (tenant, resource, window_start, window_secs, region, demand_per_sec, last_want, demand_at)
values ($1, $2, $3, $4, $5, $6, $7, $8)
on conflict (tenant, resource, window_start, window_secs, region) do update
set demand_per_sec = excluded.demand_per_sec, last_want = excluded.last_want, demand_at = excluded.demand_at
returning granted, returned
