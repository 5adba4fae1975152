-- Fallback admits repaid at heal (issue #17, item 5): what regions reported
-- admitting from their fallback allowance while the window was still open.
-- Grants see it as taken from the pool, so the window overshoots its limit
-- only by what the pool could no longer cover when the report arrived.
alter table pool add column fallback_owed bigint not null default 0
    constraint pool_fallback_owed_non_negative check (fallback_owed >= 0);
