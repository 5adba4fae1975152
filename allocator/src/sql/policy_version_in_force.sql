-- A promoted candidate is in force everywhere from now: its version row
-- says when and by whom (policy_version_at.sql reads it so).
update policy_version set updated_at = $4, updated_by = $5
where tenant = $1 and resource = $2 and version = $3
