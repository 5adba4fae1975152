-- The quota's current version, kind and window, its row locked until the
-- writer's commit.
select version, kind, window_secs from policy where tenant = $1 and resource = $2 for update
