-- The allocator's state: policies, agents and their epochs, pools per UTC
-- window, leases, reports and the append-only ledger. Windows are stored as
-- Unix seconds (`window_start`, `window_secs`) because all window math is
-- integer math on the allocator's UTC clock (I8).

-- The policy in force for each quota.
create table policy (
    -- quota identity, validated against ^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$
    tenant text not null,
    resource text not null,
    -- G: tokens per window
    limit_tokens bigint not null constraint policy_limit_positive check (limit_tokens > 0),
    -- window length; divides a UTC day so windows align with days
    window_secs bigint not null constraint policy_window_divides_day check (window_secs > 0 and 86400 % window_secs = 0),
    -- smallest chunk granted while tokens remain
    chunk_min bigint not null constraint policy_chunk_min_positive check (chunk_min > 0),
    -- largest chunk one grant carries
    chunk_max bigint not null,
    -- longest lease life before the window clamp
    lease_ttl_secs bigint not null constraint policy_lease_ttl_positive check (lease_ttl_secs > 0),
    -- tokens a region may admit per window without a lease while partitioned
    fallback_per_region bigint not null constraint policy_fallback_non_negative check (fallback_per_region >= 0),
    -- 'bounded' or 'strict'
    fail_mode text not null constraint policy_fail_mode_known check (fail_mode in ('bounded', 'strict')),
    -- strictly increasing per quota
    version bigint not null,
    -- when and by whom (token name) the policy was last written
    updated_at timestamptz not null,
    updated_by text not null,
    primary key (tenant, resource),
    constraint policy_chunks_ordered check (chunk_min <= chunk_max and chunk_max <= limit_tokens)
);

-- Every version a policy ever had (I9 history).
create table policy_version (
    tenant text not null,
    resource text not null,
    version bigint not null,
    limit_tokens bigint not null,
    window_secs bigint not null,
    chunk_min bigint not null,
    chunk_max bigint not null,
    lease_ttl_secs bigint not null,
    fallback_per_region bigint not null,
    fail_mode text not null,
    updated_at timestamptz not null,
    updated_by text not null,
    primary key (tenant, resource, version)
);

-- One row per agent identity; `epoch` is the latest incarnation issued (I4).
create table agent (
    region text not null,
    agent text not null,
    -- strictly increasing per (region, agent), across restarts of the allocator
    epoch bigint not null constraint agent_epoch_positive check (epoch > 0),
    registered_at timestamptz not null,
    primary key (region, agent)
);

-- The global pool of one quota in one UTC window (I1).
create table pool (
    tenant text not null,
    resource text not null,
    -- window start, Unix seconds, a multiple of window_secs
    window_start bigint not null,
    window_secs bigint not null,
    -- the policy's limit, kept current while the window is open (I9)
    limit_tokens bigint not null,
    -- the policy's fallback allowance per region, kept current like the limit
    fallback_per_region bigint not null,
    -- tokens put into leases
    granted bigint not null default 0 constraint pool_granted_non_negative check (granted >= 0),
    -- unspent tokens given back while the window was open
    returned bigint not null default 0 constraint pool_returned_in_range check (returned >= 0 and returned <= granted),
    created_at timestamptz not null,
    primary key (tenant, resource, window_start, window_secs)
);

-- One region's share of a pool: what it holds, spent and reported, and the
-- demand it last stated (the input of the demand-weighted share, DESIGN §4).
create table pool_region (
    tenant text not null,
    resource text not null,
    window_start bigint not null,
    window_secs bigint not null,
    region text not null,
    granted bigint not null default 0,
    returned bigint not null default 0,
    -- tokens admitted from leases, as reported by the region's agents
    consumed bigint not null default 0,
    -- tokens admitted from the fallback allowance, as reported
    fallback_admitted bigint not null default 0,
    -- the demand and want of the region's latest grant request
    demand_per_sec double precision not null default 0,
    last_want bigint not null default 0,
    demand_at timestamptz,
    primary key (tenant, resource, window_start, window_secs, region),
    foreign key (tenant, resource, window_start, window_secs) references pool on delete cascade
);

-- Leases: chunks of one pool held by one agent incarnation.
create table lease (
    lease_id uuid primary key,
    tenant text not null,
    resource text not null,
    region text not null,
    agent text not null,
    epoch bigint not null,
    seq bigint not null,
    window_start bigint not null,
    window_secs bigint not null,
    -- the request, kept to tell a replay from a different body under one key (I3)
    want bigint not null,
    demand_per_sec double precision not null,
    window_sel text not null,
    tokens bigint not null constraint lease_tokens_non_negative check (tokens >= 0),
    issued_at timestamptz not null,
    -- I2: no lease outlives its window
    expires_at timestamptz not null,
    policy_version bigint not null,
    fallback_allowance bigint not null,
    fail_mode text not null,
    -- pool as seen right after the grant, replayed verbatim
    pool_limit bigint not null,
    pool_granted bigint not null,
    pool_available bigint not null,
    retry_after_ms bigint,
    -- release: unspent as the agent reported it, and what went back to the pool
    unspent bigint,
    returned bigint,
    released_at timestamptz,
    constraint lease_idempotency_key unique (region, agent, epoch, seq),
    constraint lease_clamped_to_window check (expires_at <= to_timestamp((window_start + window_secs)::double precision)),
    foreign key (tenant, resource, window_start, window_secs) references pool on delete cascade
);
create index lease_by_quota on lease (tenant, resource, window_start);

-- Reports already applied, by report id (I7: exactly once).
create table report (
    report_id text primary key,
    region text not null,
    agent text not null,
    epoch bigint not null,
    -- the whole body, to refuse a different body under a known id
    body jsonb not null,
    accepted bigint not null,
    received_at timestamptz not null
);

-- The append-only ledger. `id` orders events and is the pagination cursor.
create table ledger_event (
    id bigserial primary key,
    at timestamptz not null,
    -- registered, granted, replayed, refused, released, reported, policy_changed
    kind text not null,
    tenant text,
    resource text,
    region text,
    agent text,
    epoch bigint,
    seq bigint,
    lease_id uuid,
    tokens bigint,
    -- why a request was refused (stale_epoch, idempotency_mismatch, ...)
    reason text,
    detail jsonb
);
create index ledger_event_by_quota on ledger_event (tenant, resource, id);
create index ledger_event_by_region on ledger_event (region, id);
