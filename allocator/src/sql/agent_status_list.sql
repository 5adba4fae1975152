-- The first $1 agents' latest statuses, by region and agent (the fleet pages of /ui).
select region, agent, epoch, allocator_reachable, outbox_depth, dead_letters, quotas_total,
       quotas as "quotas: Json<Vec<AgentQuotaStatus>>", last_seen
from agent_status
order by region, agent
limit $1
