-- Priority reserves (issue #30, item 2; seed 001): a policy may keep a
-- share of each window for the important priorities, a list of
-- {up_to_priority, pct}. Agents enforce it (a request of a less important
-- priority is refused once what is left of the window falls to the shares
-- kept for more important ones); grants carry it, read like on_stale from
-- the version the lease was granted under.
alter table policy add column reserve jsonb not null default '[]';
alter table policy_version add column reserve jsonb not null default '[]';
