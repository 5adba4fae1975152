-- The live rollouts for the watcher, in random order (a bound per round
-- that never starves the same ones), with what it decides from.
select tenant, resource, to_version, from_version, soak_secs, halt_factor, min_decisions, started_at
from policy_rollout
where state = 'canary'
order by random()
limit $1
