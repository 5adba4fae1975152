-- What the watcher last compared, for the policy's GET.
update policy_rollout set measured = $4
where tenant = $1 and resource = $2 and to_version = $3 and state = 'canary'
