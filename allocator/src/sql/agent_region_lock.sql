-- Registration (shared) and the retention job's agent deletion (exclusive)
-- of one region serialise on this lock, so a registration reads the epoch
-- floor after any deletion of its region has committed (I4).
select pg_advisory_xact_lock_shared(hashtextextended('quota.agent_region:' || $1, 0))
