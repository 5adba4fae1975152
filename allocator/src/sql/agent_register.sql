-- One statement: a new agent starts above its region's epoch floor (the
-- highest epoch of a deleted agent row, see retention_agent.sql), a known
-- one gets epoch + 1 under the row lock the upsert takes.
insert into agent (region, agent, epoch, registered_at)
values ($1, $2, coalesce((select epoch from agent_epoch_floor where region = $1), 0) + 1, $3)
on conflict (region, agent) do update set epoch = agent.epoch + 1, registered_at = excluded.registered_at
returning epoch
