-- The live rollouts for the watcher, in random order (a bound per round
-- that never starves the same ones).
select tenant, resource, to_version
from policy_rollout
where state = 'canary'
order by random()
limit $1
