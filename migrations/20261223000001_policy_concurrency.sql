-- Concurrency policies (a global semaphore): a quota may limit the permits
-- held at once instead of the tokens spent per window. Such a policy lives
-- in the same `policy` row, with kind = 'concurrency': its limit_tokens is
-- max_in_flight, its window and chunk columns are fixed placeholders
-- (86400, 1, 1, lease_ttl 30, no fallback, enforced, keep, no reserves),
-- and permit_ttl_secs is the life of a permit neither released nor renewed.
-- The kind of a quota never changes once written.
alter table policy add column kind text not null default 'rate'
    constraint policy_kind_known check (kind in ('rate', 'concurrency'));
alter table policy add column permit_ttl_secs integer
    constraint policy_permit_ttl_in_range check (permit_ttl_secs between 1 and 86400);
alter table policy add constraint policy_permit_ttl_of_concurrency
    check ((kind = 'concurrency') = (permit_ttl_secs is not null));
alter table policy_version add column kind text not null default 'rate'
    constraint policy_version_kind_known check (kind in ('rate', 'concurrency'));
alter table policy_version add column permit_ttl_secs integer;

-- Each region's permit lease of a concurrency quota: the permits it holds
-- until `expires_at` (after which they count as returned, whatever `held`
-- says), and `seq`, the compare-and-set counter every applied lease request
-- raises (allocator/src/permits.rs). Written under the policy row's lock,
-- which serialises the quota's lease requests.
create table permit_lease (
    tenant text not null,
    resource text not null,
    region text not null,
    held bigint not null constraint permit_lease_held_non_negative check (held >= 0),
    seq bigint not null,
    expires_at timestamptz not null,
    -- The longest permit TTL the live lease was renewed under: a permit
    -- the region handed out under it may live that long (a TTL lowered
    -- while permits are out does not shorten them).
    ttl_secs integer not null constraint permit_lease_ttl_positive check (ttl_secs > 0),
    updated_at timestamptz not null default now(),
    primary key (tenant, resource, region)
);
-- Retention deletes the rows expired for long (retention_permit_lease.sql).
create index permit_lease_expires_at on permit_lease (expires_at);

-- Grants are for rate policies only: `quota_grant` (migration
-- 20261220000001, unchanged but for the policy lookup) reads a policy of
-- another kind as no policy, so the grant statement stays one statement;
-- the allocator tells `unknown_quota` from a concurrency quota afterwards,
-- on that miss path only.
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
        values (p_tenant, p_resource, win_start, pol.window_secs, pol.limit_tokens, allowance, t)
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
    -- The debit, and the policy's limit and allowance kept current (I9).
    update pool x
    set granted = x.granted + n_tokens, limit_tokens = pol.limit_tokens, fallback_per_region = allowance
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
