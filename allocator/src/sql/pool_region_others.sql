select demand_per_sec, last_want
from pool_region
where tenant = $1 and resource = $2 and window_start = $3 and window_secs = $4
  and region <> $5 and demand_at >= $6
