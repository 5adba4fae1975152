-- The retention job's side of agent_region_lock.sql: no registration of the
-- region runs while its gone agents are deleted and its epoch floor raised.
select pg_advisory_xact_lock(hashtextextended('quota.agent_region:' || $1, 0))
