-- cut.lua: moves the region's unreported counts of one quota into one
-- report entry of this agent's outbox (I7). Prepended with prelude.lua:
-- counters of a rolled-back state are never cut (see strand).
--
-- KEYS[1]  P..'inc'
-- ARGV[1]  P; ARGV[2] agent; ARGV[3] report id (fresh, unique);
-- ARGV[4]  most entries the outbox may hold (bounded queue)
--
-- Returns the number of items cut (0 when nothing to report, the outbox
-- is full (counts then stay in their counters until the next cut) or the
-- server's history changed (the next spend or view strands the state)).
--
-- Why one script: a spend between reading and resetting a counter would be
-- lost or reported twice; GETDEL and the RPUSH happen as one step.
local P = ARGV[1]
if not same_server(P) then return 0 end
local ob = P .. 'ob:' .. ARGV[2]
if redis.call('LLEN', ob) >= tonumber(ARGV[4]) then return 0 end
local items = {}
for _, ws in ipairs(redis.call('SMEMBERS', P .. 'dirty')) do
  local c = tonumber(redis.call('GETDEL', P .. 'cons:' .. ws) or '0')
  local f = tonumber(redis.call('GETDEL', P .. 'fbr:' .. ws) or '0')
  local s = tonumber(redis.call('GETDEL', P .. 'shr:' .. ws) or '0')
  redis.call('SREM', P .. 'dirty', ws)
  -- The shadow count (requests a shadow-mode policy would have refused)
  -- only when there is one: an entry without it is one an agent before
  -- shadow mode reads too.
  if s > 0 then
    items[#items + 1] = {tonumber(ws), c, f, s}
  elseif c + f > 0 then
    items[#items + 1] = {tonumber(ws), c, f}
  end
  if #items >= 100 then break end
end
if #items == 0 then return 0 end
redis.call('RPUSH', ob, cjson.encode({k = 'rep', rid = ARGV[3], items = items}))
return #items
