-- Maximum policy age (issue #31, item 3; seed 002 F24): a policy states
-- what an agent cut off from the allocator does once the version it holds
-- is older than the agent's `--max-policy-age-secs`: `keep` enforcing it
-- (what every agent did before, so the default) or `fail_mode` (fail as the
-- policy's fail mode says). Grants carry it to the agents; a grant's answer
-- reads it from the version the lease was granted under (policy_version),
-- so a replayed grant answers what the first answer said.
alter table policy add column on_stale text not null default 'keep'
    check (on_stale in ('keep', 'fail_mode'));
alter table policy_version add column on_stale text not null default 'keep'
    check (on_stale in ('keep', 'fail_mode'));
