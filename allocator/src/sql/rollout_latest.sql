-- The quota's latest rollout, with its candidate's limit.
select r.state, r.to_version, r.from_version, v.limit_tokens as "limit_tokens?", r.canary_regions,
       r.soak_secs, r.halt_factor, r.min_decisions, r.started_at, r.started_by, r.ended_at, r.ended_by,
       r.reason, r.halted_to_version, r.measured
from policy_rollout r
left join policy_version v on v.tenant = r.tenant and v.resource = r.resource and v.version = r.to_version
where r.tenant = $1 and r.resource = $2
order by r.to_version desc
limit 1
