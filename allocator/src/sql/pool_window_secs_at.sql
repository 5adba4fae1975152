-- Prefer the current window length when a pool of it exists at this start.
select window_secs from pool
where tenant = $1 and resource = $2 and window_start = $3
order by (window_secs = $4) desc, created_at desc
limit 1
