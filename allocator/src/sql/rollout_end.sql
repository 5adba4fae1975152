-- Ends the quota's live rollout of candidate $3.
update policy_rollout
set state = $4, ended_at = $5, ended_by = $6, reason = $7, halted_to_version = $8,
    measured = coalesce($9, measured)
where tenant = $1 and resource = $2 and to_version = $3 and state = 'canary'
