-- The policy of a permit lease request, its row locked until the commit:
-- the lock serialises the quota's lease requests (each reads every
-- region's lease and writes its own) and a policy write.
select kind, limit_tokens, permit_ttl_secs, fail_mode, version
from policy
where tenant = $1 and resource = $2
for update
