-- The live rollouts for the watcher, oldest first.
select tenant, resource, to_version
from policy_rollout
where state = 'canary'
order by started_at
limit $1
