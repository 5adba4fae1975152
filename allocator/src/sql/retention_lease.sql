-- One bounded batch of leases whose life ended before the horizon. A lease
-- expires no later than its window ends, so only closed windows lose rows;
-- their pool and pool_region rows stay as the window's summary.
delete from lease
where lease_id in (select lease_id from lease where expires_at < $1 order by expires_at limit $2)
