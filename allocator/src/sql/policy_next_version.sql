-- The version a new write of the quota takes: above every version written,
-- including a rollout's candidate (a row of policy_version only). Run
-- under the policy row's lock (policy_lock_version.sql).
select greatest(
           coalesce((select max(v.version) from policy_version v where v.tenant = $1 and v.resource = $2), 0),
           coalesce((select p.version from policy p where p.tenant = $1 and p.resource = $2), 0)
       ) + 1 as "version!"
