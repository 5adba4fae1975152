insert into pool (tenant, resource, window_start, window_secs, limit_tokens, fallback_per_region, created_at)
values ($1, $2, $3, $4, $5, $6, $7)
on conflict do nothing
