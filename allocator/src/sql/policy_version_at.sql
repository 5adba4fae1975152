-- The version in force at an instant: the latest written at or before it,
-- leaving out the candidates of rollouts never promoted (they were in
-- force in their canary regions only; a promoted one's row says when it
-- was promoted).
select tenant, resource, limit_tokens, window_secs, chunk_min, chunk_max, lease_ttl_secs,
       fallback_per_region, fail_mode, per_key_rate_milli, per_key_burst, enforce, on_stale, reserve, kind,
       permit_ttl_secs, version, updated_at
from policy_version v
where tenant = $1 and resource = $2 and updated_at <= $3
  and not exists (select 1 from policy_rollout r
                  where r.tenant = $1 and r.resource = $2 and r.to_version = v.version and r.state <> 'promoted')
order by version desc
limit 1
