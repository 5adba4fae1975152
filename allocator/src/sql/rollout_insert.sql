-- A staged rollout starts (the one live rollout of the quota: the unique
-- index policy_rollout_one_live).
insert into policy_rollout (tenant, resource, to_version, from_version, canary_regions, soak_secs, halt_factor,
                            min_decisions, state, started_at, started_by)
values ($1, $2, $3, $4, $5, $6, $7, $8, 'canary', $9, $10)
