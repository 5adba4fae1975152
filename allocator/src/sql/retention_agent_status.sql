-- One bounded batch of agent statuses not refreshed since the horizon ($1):
-- agents that stopped reporting (a live agent rewrites its row every few
-- seconds).
delete from agent_status
where (region, agent) in (
    select region, agent from agent_status
    where last_seen < $1
    order by last_seen
    limit $2
    for update skip locked)
