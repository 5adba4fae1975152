-- The policy of a permit view (no lock: a read).
select kind, limit_tokens, permit_ttl_secs, fail_mode, version
from policy
where tenant = $1 and resource = $2
