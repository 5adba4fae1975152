-- The region's epoch floor (see retention_agent.sql): an epoch at or below
-- it belongs to an agent row the retention job deleted.
select epoch from agent_epoch_floor where region = $1
