-- Pools whose window has not ended take the new limit and allowance (I9).
update pool
set limit_tokens = $3, fallback_per_region = $4
where tenant = $1 and resource = $2 and window_start + window_secs > $5
