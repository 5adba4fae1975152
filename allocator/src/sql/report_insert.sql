insert into report (report_id, region, agent, epoch, body, accepted, received_at, newest_window_start)
values ($1, $2, $3, $4, $5, $6, $7, $8)
on conflict (report_id) do nothing
returning accepted
