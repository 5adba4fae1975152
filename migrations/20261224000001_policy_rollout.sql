-- Staged policy rollouts (issue 31, allocator/src/rollout.rs): a policy
-- change published to canary regions first. The candidate version is a
-- row of policy_version only; `policy` keeps the version every other
-- region is on until the rollout is promoted (the candidate's row is
-- copied into `policy`) or halted (the version in force is published
-- again under a newer number, so versions only move forward). At most
-- one rollout per quota is live (state 'canary').
create table policy_rollout (
    tenant text not null,
    resource text not null,
    -- the candidate (a policy_version row) and the version in force when it started
    to_version bigint not null,
    from_version bigint not null,
    canary_regions text[] not null
        constraint policy_rollout_canary_count check (cardinality(canary_regions) between 1 and 16),
    soak_secs integer not null constraint policy_rollout_soak_in_range check (soak_secs between 1 and 86400),
    halt_factor double precision not null
        constraint policy_rollout_factor_in_range check (halt_factor >= 1 and halt_factor <= 1000),
    min_decisions bigint not null
        constraint policy_rollout_min_decisions_in_range check (min_decisions between 1 and 1000000000),
    state text not null
        constraint policy_rollout_state_known check (state in ('canary', 'promoted', 'halted', 'superseded')),
    started_at timestamptz not null,
    started_by text not null,
    ended_at timestamptz,
    ended_by text,
    -- why it ended, in words
    reason text,
    -- the version a halt published (the one in force when it started, renumbered)
    halted_to_version bigint,
    -- the last counts the watcher compared: {"at", "new": {...}, "old": {...}}
    measured jsonb,
    primary key (tenant, resource, to_version),
    constraint policy_rollout_forward check (to_version > from_version)
);
create unique index policy_rollout_one_live on policy_rollout (tenant, resource) where state = 'canary';
-- The watcher's scan of the live rollouts.
create index policy_rollout_live on policy_rollout (started_at) where state = 'canary';

-- quota_grant (migration 20261223000001, unchanged but for the rollout
-- lookup and the pool's limit and allowance during a rollout).
create or replace function quota_grant(
    p_lease_id uuid, p_tenant text, p_resource text, p_region text, p_agent text, p_epoch bigint,
    p_seq bigint, p_want bigint, p_demand double precision, p_window_sel text, clock_shift_us bigint)
returns table (
    outcome text, now_at timestamptz, current_epoch bigint, opens_at timestamptz,
    lease_id uuid, tenant text, resource text, region text, agent text, epoch bigint, seq bigint,
    window_start bigint, window_secs bigint, want bigint, demand_per_sec double precision, window_sel text,
    tokens bigint, issued_at timestamptz, expires_at timestamptz, policy_version bigint,
    fallback_allowance bigint, fail_mode text, pool_limit bigint, pool_granted bigint, pool_available bigint,
    retry_after_ms bigint, unspent bigint, returned bigint, released_at timestamptz,
    per_key_rate_milli bigint, per_key_burst bigint, enforce boolean)
language plpgsql volatile
as $$
-- The answer's column names (tenant, epoch, ...) are also the tables'
-- column names; in a statement they mean the column.
#variable_conflict use_column
declare
    cur bigint;
    floor_epoch bigint;
    t timestamptz;
    l lease%rowtype;
    pol policy%rowtype;
    allowance bigint;
    cur_start bigint;
    win_start bigint;
    p_granted bigint;
    p_returned bigint;
    p_owed bigint;
    r_granted bigint;
    r_returned bigint;
    o_demand double precision[];
    o_want bigint[];
    avail bigint;
    n_tokens bigint;
    life_from timestamptz;
    win_end timestamptz;
    retry bigint;
    ro policy_rollout%rowtype;
    cand policy_version%rowtype;
    pool_lim bigint;
    pool_allow bigint;
begin
    -- I4: the share lock on the agent row lasts to the commit, so a
    -- registration cannot slip between this check and the lease.
    select a.epoch into cur from agent a where a.region = p_region and a.agent = p_agent for share;
    if not found then
        -- An agent row the retention job deleted: an epoch at or below the
        -- region's floor is over (stale_epoch tells the agent to register).
        select f.epoch into floor_epoch from agent_epoch_floor f where f.region = p_region;
        if floor_epoch is not null and p_epoch <= floor_epoch then
            cur := floor_epoch + 1;
        end if;
    end if;
    if cur is null then
        return query select 'unknown_agent'::text, null::timestamptz, null::bigint, null::timestamptz,
            null::uuid, null::text, null::text, null::text, null::text, null::bigint, null::bigint, null::bigint,
            null::bigint, null::bigint, null::double precision, null::text, null::bigint, null::timestamptz,
            null::timestamptz, null::bigint, null::bigint, null::text, null::bigint, null::bigint, null::bigint,
            null::bigint, null::bigint, null::bigint, null::timestamptz, null::bigint, null::bigint, null::boolean;
        return;
    end if;
    if p_epoch <> cur then
        return query select case when p_epoch < cur then 'stale_epoch' else 'epoch_not_issued' end,
            null::timestamptz, cur, null::timestamptz,
            null::uuid, null::text, null::text, null::text, null::text, null::bigint, null::bigint, null::bigint,
            null::bigint, null::bigint, null::double precision, null::text, null::bigint, null::timestamptz,
            null::timestamptz, null::bigint, null::bigint, null::text, null::bigint, null::bigint, null::bigint,
            null::bigint, null::bigint, null::bigint, null::timestamptz, null::bigint, null::bigint, null::boolean;
        return;
    end if;
    -- Read after the fence (which may wait on a registration's row lock), so
    -- the window is decided as late as possible on the one clock (I8).
    t := clock_timestamp() + clock_shift_us * interval '1 microsecond';

    -- I3: a known key replays its lease, or refuses a different body.
    select * into l from lease x where x.region = p_region and x.agent = p_agent and x.epoch = p_epoch
        and x.seq = p_seq;
    if found then
        if l.tenant = p_tenant and l.resource = p_resource and l.want = p_want
           and l.demand_per_sec = p_demand and l.window_sel = p_window_sel then
            insert into ledger_event (at, kind, tenant, resource, region, agent, epoch, seq, lease_id, tokens)
            values (t, 'replayed', p_tenant, p_resource, p_region, p_agent, p_epoch, p_seq, l.lease_id, l.tokens);
            outcome := 'replayed';
        else
            outcome := 'idempotency_mismatch';
        end if;
        return query select outcome, t, null::bigint, null::timestamptz,
            l.lease_id, l.tenant, l.resource, l.region, l.agent, l.epoch, l.seq, l.window_start, l.window_secs,
            l.want, l.demand_per_sec, l.window_sel, l.tokens, l.issued_at, l.expires_at, l.policy_version,
            l.fallback_allowance, l.fail_mode, l.pool_limit, l.pool_granted, l.pool_available, l.retry_after_ms,
            l.unspent, l.returned, l.released_at, l.per_key_rate_milli, l.per_key_burst, l.enforce;
        return;
    end if;

    -- A concurrency policy is no policy for a grant (see above).
    select * into pol from policy x where x.tenant = p_tenant and x.resource = p_resource and x.kind = 'rate';
    if not found then
        return query select 'unknown_quota'::text, t, null::bigint, null::timestamptz,
            null::uuid, null::text, null::text, null::text, null::text, null::bigint, null::bigint, null::bigint,
            null::bigint, null::bigint, null::double precision, null::text, null::bigint, null::timestamptz,
            null::timestamptz, null::bigint, null::bigint, null::text, null::bigint, null::bigint, null::bigint,
            null::bigint, null::bigint, null::bigint, null::timestamptz, null::bigint, null::bigint, null::boolean;
        return;
    end if;
    -- A staged rollout (allocator/src/rollout.rs): the canary regions'
    -- grants follow the candidate version, every other region's the
    -- version in force; the pool's limit and allowance are the larger of
    -- the two, so each grant still checks the pool against its own
    -- version's limit and the window's granted total never passes
    -- max(G_old, G_new), the bound an immediate change has too (I9).
    select * into ro from policy_rollout r where r.tenant = p_tenant and r.resource = p_resource
        and r.state = 'canary';
    if found then
        select * into cand from policy_version v where v.tenant = p_tenant and v.resource = p_resource
            and v.version = ro.to_version;
    end if;
    pool_lim := pol.limit_tokens;
    pool_allow := case when pol.fail_mode = 'bounded' then pol.fallback_per_region else 0 end;
    if cand.version is not null then
        pool_lim := greatest(pol.limit_tokens, cand.limit_tokens);
        pool_allow := greatest(pool_allow,
                               case when cand.fail_mode = 'bounded' then cand.fallback_per_region else 0 end);
        if p_region = any(ro.canary_regions) then
            pol.limit_tokens := cand.limit_tokens;
            pol.chunk_min := cand.chunk_min;
            pol.chunk_max := cand.chunk_max;
            pol.lease_ttl_secs := cand.lease_ttl_secs;
            pol.fallback_per_region := cand.fallback_per_region;
            pol.fail_mode := cand.fail_mode;
            pol.version := cand.version;
            pol.per_key_rate_milli := cand.per_key_rate_milli;
            pol.per_key_burst := cand.per_key_burst;
            pol.enforce := cand.enforce;
        end if;
    end if;
    -- Windows are [k·W, (k+1)·W) in whole Unix seconds.
    cur_start := floor(extract(epoch from t))::bigint;
    cur_start := cur_start - mod(cur_start, pol.window_secs);
    win_start := cur_start;
    if p_window_sel = 'next' then
        -- "next" only within the last lease_ttl_secs of the current window.
        opens_at := to_timestamp((cur_start + pol.window_secs - pol.lease_ttl_secs)::double precision);
        if t < opens_at then
            return query select 'next_too_early'::text, t, null::bigint, opens_at,
                null::uuid, null::text, null::text, null::text, null::text, null::bigint, null::bigint,
                null::bigint, null::bigint, null::bigint, null::double precision, null::text, null::bigint,
                null::timestamptz, null::timestamptz, null::bigint, null::bigint, null::text, null::bigint,
                null::bigint, null::bigint, null::bigint, null::bigint, null::bigint, null::timestamptz,
                null::bigint, null::bigint, null::boolean;
            return;
        end if;
        win_start := cur_start + pol.window_secs;
    end if;
    allowance := case when pol.fail_mode = 'bounded' then pol.fallback_per_region else 0 end;

    -- From here to the end of the statement the pool row is locked (I1):
    -- nothing below waits on the network. Each row is written once: the
    -- pool and the region are read here and written with the grant below
    -- (a hot pool's lock is held for as few row versions as possible).
    select x.granted, x.returned, x.fallback_owed into p_granted, p_returned, p_owed
    from pool x
    where x.tenant = p_tenant and x.resource = p_resource and x.window_start = win_start
      and x.window_secs = pol.window_secs
    for update;
    if not found then
        -- The window's first grant creates the pool (or, racing another
        -- first grant, waits for it and locks the row it made).
        insert into pool as x (tenant, resource, window_start, window_secs, limit_tokens, fallback_per_region,
                               created_at)
        values (p_tenant, p_resource, win_start, pol.window_secs, pool_lim, pool_allow, t)
        on conflict (tenant, resource, window_start, window_secs) do update
        set limit_tokens = excluded.limit_tokens
        returning x.granted, x.returned, x.fallback_owed into p_granted, p_returned, p_owed;
    end if;

    -- The region's row is written only by grants, which the pool lock
    -- serialises, and by releases and reports, which only add to what it
    -- returned or consumed.
    select x.granted, x.returned into r_granted, r_returned
    from pool_region x
    where x.tenant = p_tenant and x.resource = p_resource and x.window_start = win_start
      and x.window_secs = pol.window_secs and x.region = p_region;
    r_granted := coalesce(r_granted, 0);
    r_returned := coalesce(r_returned, 0);

    select coalesce(array_agg(o.demand_per_sec), '{}'), coalesce(array_agg(o.last_want), '{}')
    into o_demand, o_want
    from pool_region o
    where o.tenant = p_tenant and o.resource = p_resource and o.window_start = win_start
      and o.window_secs = pol.window_secs and o.region <> p_region
      and o.demand_at >= t - greatest(pol.lease_ttl_secs, 1) * interval '1 second';

    avail := quota_available(pol.limit_tokens, p_granted, p_returned, p_owed);
    n_tokens := quota_share_tokens(p_want, p_demand, pol.chunk_min, pol.chunk_max, pol.limit_tokens, avail,
                                   r_granted - r_returned, o_demand, o_want);
    -- A lease's life starts when its window opens: a lease prefetched for
    -- the next window would otherwise expire before that window ends and
    -- strand its tokens. Either way it never outlives its window (I2).
    win_end := to_timestamp((win_start + pol.window_secs)::double precision);
    life_from := greatest(t, to_timestamp(win_start::double precision));
    retry := case when n_tokens = 0
                  then least(greatest(trunc(extract(epoch from (win_end - t)) * 1000)::bigint, 1), 60000) end;
    -- While a rollout is live, a refusal is retried within a second: the
    -- agents' negative caches and renewers wait out this hint, and a halt
    -- must reach the canary (or a promotion everyone) at once, not at the
    -- window's end.
    if cand.version is not null and retry is not null then
        retry := least(retry, 1000);
    end if;

    insert into lease as x (lease_id, tenant, resource, region, agent, epoch, seq, window_start, window_secs,
                            want, demand_per_sec, window_sel, tokens, issued_at, expires_at, policy_version,
                            fallback_allowance, fail_mode, pool_limit, pool_granted, pool_available,
                            retry_after_ms, per_key_rate_milli, per_key_burst, enforce)
    values (p_lease_id, p_tenant, p_resource, p_region, p_agent, p_epoch, p_seq, win_start, pol.window_secs,
            p_want, p_demand, p_window_sel, n_tokens, t,
            least(life_from + pol.lease_ttl_secs * interval '1 second', win_end), pol.version, allowance,
            pol.fail_mode, pol.limit_tokens, p_granted + n_tokens,
            quota_available(pol.limit_tokens, p_granted + n_tokens, p_returned, p_owed), retry,
            pol.per_key_rate_milli, pol.per_key_burst, pol.enforce)
    returning x.* into l;
    -- The debit, and the policy's limit and allowance kept current (I9;
    -- during a rollout the larger of the two versions', see above).
    update pool x
    set granted = x.granted + n_tokens, limit_tokens = pool_lim, fallback_per_region = pool_allow
    where x.tenant = p_tenant and x.resource = p_resource and x.window_start = win_start
      and x.window_secs = pol.window_secs;
    -- The region's debit and its latest demand and want (the share's input).
    insert into pool_region as x (tenant, resource, window_start, window_secs, region, granted, demand_per_sec,
                                  last_want, demand_at)
    values (p_tenant, p_resource, win_start, pol.window_secs, p_region, n_tokens, p_demand, p_want, t)
    on conflict (tenant, resource, window_start, window_secs, region) do update
    set granted = x.granted + excluded.granted, demand_per_sec = excluded.demand_per_sec,
        last_want = excluded.last_want, demand_at = excluded.demand_at;
    insert into ledger_event (at, kind, tenant, resource, region, agent, epoch, seq, lease_id, tokens)
    values (t, 'granted', p_tenant, p_resource, p_region, p_agent, p_epoch, p_seq, l.lease_id, l.tokens);

    return query select 'granted'::text, t, null::bigint, null::timestamptz,
        l.lease_id, l.tenant, l.resource, l.region, l.agent, l.epoch, l.seq, l.window_start, l.window_secs,
        l.want, l.demand_per_sec, l.window_sel, l.tokens, l.issued_at, l.expires_at, l.policy_version,
        l.fallback_allowance, l.fail_mode, l.pool_limit, l.pool_granted, l.pool_available, l.retry_after_ms,
        l.unspent, l.returned, l.released_at, l.per_key_rate_milli, l.per_key_burst, l.enforce;
end
$$;
