-- The quota's live rollout, locked until the writer's commit (taken after
-- the policy row's lock, in that order everywhere).
select to_version, from_version, soak_secs, halt_factor, min_decisions, started_at
from policy_rollout
where tenant = $1 and resource = $2 and state = 'canary'
for update
