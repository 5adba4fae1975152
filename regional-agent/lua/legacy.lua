-- legacy.lua: the region's legacy gate, moved at every heartbeat of an
-- agent of the tenant key layout that sees a legacy-layout agent alive
-- (see the agent's `legacy` module).
--
-- KEYS[1]  the gate (Redis clock, ms)
-- ARGV[1]  '1' when a legacy-layout agent of the region is alive now
-- ARGV[2]  how long an agent's liveness key lasts (ms)
-- ARGV[3]  ttl of the gate (ms)
--
-- A legacy agent counts the region's fallback allowance under its own keys,
-- which a tenant-layout agent cannot read in the same script (another
-- Cluster slot) and which keep changing while it runs. So while one may be
-- alive, and until its liveness would have lapsed, the gate moves forward:
-- the tenant-layout agents take no fallback before it. Once no legacy
-- agent is alive its counters no longer change, and the spend script adds
-- the window's to the tenant layout's (see spend.lua).
--
-- Returns the gate in force (0: none).
local gate = tonumber(redis.call('GET', KEYS[1]) or '0')
if ARGV[1] == '1' then
  local t = redis.call('TIME')
  local to = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[2])
  if to > gate then
    gate = to
    redis.call('SET', KEYS[1], string.format('%d', gate), 'PX', ARGV[3])
  end
end
return gate
