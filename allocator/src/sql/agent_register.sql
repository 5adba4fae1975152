-- One statement: a new agent starts at epoch 1, a known one gets epoch + 1
-- under the row lock the upsert takes.
insert into agent (region, agent, epoch, registered_at)
values ($1, $2, 1, $3)
on conflict (region, agent) do update set epoch = agent.epoch + 1, registered_at = excluded.registered_at
returning epoch
