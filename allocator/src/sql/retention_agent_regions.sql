-- Regions with an agent row registered before the horizon: the candidates
-- of retention_agent.sql, one region (and one advisory lock) at a time.
select distinct region from agent where registered_at < $1 order by region
