-- One bounded batch of pools whose window ended before the window-summary
-- horizon ($1, Unix seconds); their pool_region rows (and any lease left)
-- go with them by cascade. Nothing can recreate them: grants take only the
-- current or next window and reports of windows beyond the report horizon
-- (never longer than this one) are refused.
delete from pool
where (tenant, resource, window_start, window_secs) in (
    select tenant, resource, window_start, window_secs from pool
    where window_start + window_secs < $1
    order by window_start + window_secs
    limit $2)
