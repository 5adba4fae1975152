update pool
set limit_tokens = $5, fallback_per_region = $6
where tenant = $1 and resource = $2 and window_start = $3 and window_secs = $4
returning granted, returned
