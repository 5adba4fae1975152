-- Per-key limits (issue #17, item 1): a policy may carry a token bucket per
-- principal, `per_key_burst` tokens refilled at `per_key_rate_milli`
-- milli-tokens per second. Both or neither. Enforced by the regions (each
-- on its own traffic, in its Redis); the allocator stores the policy, keeps
-- its history and tells the agents with every grant, so a lease carries the
-- bucket of the policy version it was granted under (a replayed grant
-- answers exactly as first granted).
alter table policy
    add column per_key_rate_milli bigint,
    add column per_key_burst bigint,
    add constraint policy_per_key_whole check (
        (per_key_rate_milli is null) = (per_key_burst is null)
        and coalesce(per_key_rate_milli, 1) between 1 and 1000000000000
        and coalesce(per_key_burst, 1) between 1 and 1000000000);
alter table policy_version
    add column per_key_rate_milli bigint,
    add column per_key_burst bigint;
alter table lease
    add column per_key_rate_milli bigint,
    add column per_key_burst bigint;

-- Shadow mode (issue #17, item 4): a policy with `enforce = false` decides
-- and counts exactly as an enforced one but refuses nobody; the agents
-- report the requests it would have refused (`shadow_refused`, requests,
-- not tokens) per window and region, next to what they admitted.
alter table policy add column enforce boolean not null default true;
alter table policy_version add column enforce boolean not null default true;
alter table lease add column enforce boolean not null default true;
alter table pool_region add column shadow_refused bigint not null default 0
    constraint pool_region_shadow_refused_non_negative check (shadow_refused >= 0);
