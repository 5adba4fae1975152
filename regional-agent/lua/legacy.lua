-- legacy.lua: the region's legacy gate, refreshed at every heartbeat of an
-- agent of the tenant key layout (see the agent's `legacy` module).
--
-- KEYS[1]  the region's presence key (exists while a tenant-layout agent
--          heartbeats), KEYS[2] the gate (Redis clock, ms)
-- ARGV[1]  '1' when a legacy-layout agent of the region is alive now
-- ARGV[2]  how long an agent's liveness key lasts (ms)
-- ARGV[3]  ttl of the gate (ms)
--
-- A legacy agent counts the region's fallback allowance under its own keys,
-- which a tenant-layout agent cannot read in the same script (another
-- Cluster slot). So while one may be alive, and until its liveness would
-- have lapsed, the gate moves forward: the tenant-layout agents take no
-- fallback in a window that started before it. When no tenant-layout agent
-- was present (first start, or all of them stopped a while), the region's
-- history until now is unknown: the gate moves to now (no legacy agent is
-- alive now, or ARGV[1] would say so).
--
-- Returns the gate in force.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local live_ttl = tonumber(ARGV[2])
local gate = tonumber(redis.call('GET', KEYS[2]) or '0')
local to = false
if ARGV[1] == '1' then
  to = now + live_ttl
elseif redis.call('EXISTS', KEYS[1]) == 0 then
  to = now
end
if to and to > gate then
  gate = to
  redis.call('SET', KEYS[2], string.format('%d', gate), 'PX', ARGV[3])
end
redis.call('SET', KEYS[1], '1', 'PX', live_ttl)
return gate
