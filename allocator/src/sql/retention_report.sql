-- One bounded batch of report records whose newest window started before
-- the horizon ($1, Unix seconds). Safe: the report endpoint refuses items
-- of such windows, so a replay of a deleted report cannot apply again.
delete from report
where report_id in (select report_id from report where newest_window_start < $1
                    order by newest_window_start limit $2)
