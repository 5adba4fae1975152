-- One bounded batch of one region's agents that are gone: registered
-- before the horizon ($1) and named by no lease and no report any more
-- (both are deleted beyond the same horizon, so this is "no grant, release
-- or report for longer than the horizon"). The highest deleted epoch
-- raises the region's floor in the same statement (I4, see
-- agent_register.sql); the caller holds the region's advisory lock
-- exclusively. Answers the number of agent rows deleted.
with gone as (
    delete from agent a
    where a.region = $3 and (a.region, a.agent) in (
        select g.region, g.agent from agent g
        where g.region = $3 and g.registered_at < $1
          and not exists (select 1 from lease l where l.region = g.region and l.agent = g.agent)
          and not exists (select 1 from report r where r.region = g.region and r.agent = g.agent)
        order by g.registered_at
        limit $2
        for update skip locked)
    returning a.region, a.epoch
), floor as (
    insert into agent_epoch_floor (region, epoch)
    select region, max(epoch) from gone group by region
    on conflict (region) do update set epoch = greatest(agent_epoch_floor.epoch, excluded.epoch)
)
select count(*)::bigint as "deleted!" from gone
