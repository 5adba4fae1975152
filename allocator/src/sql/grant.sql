-- One grant in one statement, sent in autocommit (see the migration that
-- defines quota_grant): the pool row is locked only inside the server. The
-- stale behaviour and the reserves are read from the version the lease was
-- granted under (see the migrations that add them), so a replay answers
-- the same.
select outcome as "outcome!", now_at as "now_at?", current_epoch as "current_epoch?", opens_at as "opens_at?",
       lease_id as "lease_id?", tenant as "tenant?", resource as "resource?", region as "region?",
       agent as "agent?", epoch as "epoch?", seq as "seq?", window_start as "window_start?",
       window_secs as "window_secs?", want as "want?", demand_per_sec as "demand_per_sec?",
       window_sel as "window_sel?", tokens as "tokens?", issued_at as "issued_at?", expires_at as "expires_at?",
       policy_version as "policy_version?", fallback_allowance as "fallback_allowance?",
       fail_mode as "fail_mode?", pool_limit as "pool_limit?", pool_granted as "pool_granted?",
       pool_available as "pool_available?", retry_after_ms, unspent, returned, released_at,
       per_key_rate_milli, per_key_burst, enforce as "enforce?",
       (select v.on_stale from policy_version v
        where v.tenant = g.tenant and v.resource = g.resource and v.version = g.policy_version) as on_stale,
       (select v.reserve from policy_version v
        where v.tenant = g.tenant and v.resource = g.resource and v.version = g.policy_version) as reserve
from quota_grant($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11) g
