-- A version's stale behaviour and reserves, read on their own when the grant
-- statement's snapshot predates the version its lease was granted under
-- (a policy written while the grant waited on the agent row's lock).
select on_stale, reserve
from policy_version
where tenant = $1 and resource = $2 and version = $3
