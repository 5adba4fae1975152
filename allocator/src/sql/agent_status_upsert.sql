-- Replaces an agent's status (see fleet.rs); $9 is the database's clock.
insert into agent_status (region, agent, epoch, allocator_reachable, outbox_depth, dead_letters,
                          quotas_total, quotas, last_seen)
values ($1, $2, $3, $4, $5, $6, $7, $8, $9)
on conflict (region, agent) do update
set epoch = excluded.epoch, allocator_reachable = excluded.allocator_reachable,
    outbox_depth = excluded.outbox_depth, dead_letters = excluded.dead_letters,
    quotas_total = excluded.quotas_total, quotas = excluded.quotas, last_seen = excluded.last_seen
