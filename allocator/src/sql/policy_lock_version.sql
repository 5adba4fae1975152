-- The quota's current version and kind, its row locked until the writer's
-- commit.
select version, kind from policy where tenant = $1 and resource = $2 for update
