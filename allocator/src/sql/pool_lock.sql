-- Creates the pool on first use and, in the same statement, takes the row
-- lock that serialises every grant of this pool and keeps its limit and
-- allowance current (I1, I9).
insert into pool (tenant, resource, window_start, window_secs, limit_tokens, fallback_per_region, created_at)
values ($1, $2, $3, $4, $5, $6, $7)
on conflict (tenant, resource, window_start, window_secs) do update
set limit_tokens = excluded.limit_tokens, fallback_per_region = excluded.fallback_per_region
returning granted, returned, fallback_owed
