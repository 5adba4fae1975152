-- The decisions of two versions of one quota: the agents' latest statuses
-- seen since $5 (each counts its open window under the version it holds),
-- summed per version; refused: 429 quota_exhausted and per_key_limited.
select coalesce(sum((q ->> 'admitted')::bigint) filter (where (q ->> 'policy_version')::bigint = $3), 0)::bigint
           as "new_admitted!",
       coalesce(sum((q ->> 'quota_exhausted')::bigint + coalesce((q ->> 'per_key_limited')::bigint, 0))
                filter (where (q ->> 'policy_version')::bigint = $3), 0)::bigint
           as "new_refused!",
       coalesce(sum((q ->> 'admitted')::bigint) filter (where (q ->> 'policy_version')::bigint = $4), 0)::bigint
           as "old_admitted!",
       coalesce(sum((q ->> 'quota_exhausted')::bigint + coalesce((q ->> 'per_key_limited')::bigint, 0))
                filter (where (q ->> 'policy_version')::bigint = $4), 0)::bigint
           as "old_refused!"
from agent_status s
cross join lateral jsonb_array_elements(s.quotas) q
where s.last_seen >= $5 and q ->> 'tenant' = $1 and q ->> 'resource' = $2
