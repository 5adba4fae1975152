-- What each agent last said about itself (PUT /v1/agents/{region}/{agent}/status),
-- for the fleet pages of /ui: one row per agent, replaced at each report.
-- The retention job deletes rows not refreshed within its horizon.
create table agent_status (
    -- the agent, validated against ^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$
    region text not null,
    agent text not null,
    -- the epoch the status was sent under (fenced like every agent call, I4)
    epoch bigint not null constraint agent_status_epoch_positive check (epoch >= 1),
    -- whether the agent's circuit breaker counted the allocator as reachable
    allocator_reachable boolean not null,
    -- outbox entries waiting for the allocator, as of the agent's last drain round
    outbox_depth bigint not null constraint agent_status_outbox_non_negative check (outbox_depth >= 0),
    -- entries in the region's dead-letter list; null when the agent could not read it
    dead_letters bigint constraint agent_status_dead_letters_non_negative check (dead_letters >= 0),
    -- quotas the agent holds (quotas below lists at most 200 of them)
    quotas_total bigint not null constraint agent_status_quotas_total_non_negative check (quotas_total >= 0),
    -- [{tenant, resource, mode, window_start, quota_exhausted, unavailable}]
    quotas jsonb not null,
    -- the database's clock when the status was last written
    last_seen timestamptz not null,
    primary key (region, agent)
);
-- The retention job's batches, oldest first.
create index agent_status_by_last_seen on agent_status (last_seen);
