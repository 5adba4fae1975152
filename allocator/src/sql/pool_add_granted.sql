with p as (
    update pool set granted = granted + $6
    where tenant = $1 and resource = $2 and window_start = $3 and window_secs = $4
)
update pool_region set granted = granted + $6
where tenant = $1 and resource = $2 and window_start = $3 and window_secs = $4 and region = $5
