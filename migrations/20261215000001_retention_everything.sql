-- Retention of everything (issue #15): report records, pools with their
-- region rows, and agents that are gone are deleted by the retention job,
-- without letting a report apply twice or an epoch go backwards.

-- The newest window a report counts (Unix seconds; the time it was received
-- for a report without items). The job deletes a report record only once
-- this is beyond the horizon, and the report endpoint refuses every item of
-- a window beyond the horizon, so a report replayed after its record was
-- deleted is refused (report_expired) instead of applied a second time.
alter table report add column newest_window_start bigint;
update report r
set newest_window_start = coalesce(
    (select max(extract(epoch from (i->>'window_start')::timestamptz))::bigint
     from jsonb_array_elements(r.body->'items') i),
    extract(epoch from r.received_at)::bigint);
alter table report alter column newest_window_start set not null;
create index report_by_newest_window on report (newest_window_start);
-- An agent is gone only when no lease and no report names it any more.
create index report_by_agent on report (region, agent);

-- Pools are deleted (with their pool_region rows, by cascade) when their
-- window ended before the window-summary horizon.
create index pool_by_window_end on pool ((window_start + window_secs));

-- Per region, the highest epoch of an agent row the retention job deleted.
-- A registration of an unknown agent starts above it, so an agent id that
-- comes back after its row was deleted never reuses an epoch it had (I4).
-- One row per region keeps this table as small as the set of regions,
-- whatever the churn of agent ids (pod names).
create table agent_epoch_floor (
    region text primary key,
    -- no agent of this region was ever deleted with an epoch above this
    epoch bigint not null constraint agent_epoch_floor_non_negative check (epoch >= 0)
);
