-- spend.lua: one admission decision (I5). Prepended with prelude.lua.
--
-- KEYS[1]  P..'inc' (routes the call to the quota's slot; P is ARGV[1])
-- ARGV[1]  P, the quota prefix from keys.rs
-- ARGV[2]  incarnation token the agent knows ('' / '?' on first touch)
-- ARGV[3]  fresh token to install when the incarnation key is missing
-- ARGV[4]  cost (tokens, >= 1)
-- ARGV[5]  request id key suffix ('' when the request carries none)
-- ARGV[6]  request id ttl (ms)
-- ARGV[7]  '1' when fallback may be used (allocator unreachable, bounded)
-- ARGV[8]  fallback window start (Unix s, the agent's UTC clock)
-- ARGV[9]  fallback allowance per window for the region
-- ARGV[10] ttl of counters (ms)
-- ARGV[11] agent id, ARGV[12] agent epoch (0 when not registered yet)
-- ARGV[13] '1' when this call counts toward demand: a request that waits
--          for a renewal and tries again is one request of demand, not
--          several (counted twice, a slow region's demand estimate jumps
--          at every window boundary and its leases strand tokens)
--
-- Returns {code, token, a, b, c}:
--   {'lost', token, flag}           incarnation changed or missing (see prelude)
--   {'dup', token, 'src:ws:rem'}    request id seen: the first decision
--   {'lease', token, ws, remaining}
--   {'fallback', token, ws, remaining}
--   {'none', token, wait_ms, exhausted_retry_ms (-1: not exhausted), available}
--
-- Why one script: expiry, epoch fence, balance check, debit, demand count,
-- consumption counter and request-id record must happen as one step across
-- replicas. MULTI/EXEC cannot branch on what it read, and a key can expire
-- between the commands of a MULTI but never in the middle of a script.
local P = ARGV[1]
local cost = tonumber(ARGV[4])
local ttl = tonumber(ARGV[10])
local token, lost = incarnation(P, ARGV[2], ARGV[3], ARGV[8], tonumber(ARGV[9]), ARGV[11], tonumber(ARGV[12]), ttl)
if lost > 0 then
  return {'lost', token, lost}
end
local rid = false
if ARGV[5] ~= '' then
  rid = P .. 'rid:' .. ARGV[5]
  local seen = redis.call('GET', rid)
  if seen then return {'dup', token, seen} end
end
if ARGV[13] == '1' then redis.call('INCRBY', P .. 'dem', cost) end

local ws, avail, cand, rem, _, _, _, wait = scan(P)
if ws and avail >= cost then
  local left = cost
  for i, id in ipairs(cand) do
    local take = math.min(left, rem[i])
    redis.call('HINCRBY', P .. 'l:' .. id, 'spent', take)
    if take == rem[i] then finish(P, id) end
    left = left - take
    if left == 0 then break end
  end
  redis.call('INCRBY', P .. 'cons:' .. ws, cost)
  redis.call('PEXPIRE', P .. 'cons:' .. ws, ttl)
  redis.call('SADD', P .. 'dirty', ws)
  if rid then redis.call('SET', rid, 'lease:' .. ws .. ':' .. (avail - cost), 'PX', tonumber(ARGV[6])) end
  return {'lease', token, tonumber(ws), avail - cost}
end

if ARGV[7] == '1' then
  local fws = ARGV[8]
  local allowance = tonumber(ARGV[9])
  local fk = P .. 'fb:' .. fws
  local used = tonumber(redis.call('GET', fk) or '0')
  if used + cost <= allowance then
    redis.call('INCRBY', fk, cost)
    redis.call('PEXPIRE', fk, ttl)
    redis.call('INCRBY', P .. 'fbr:' .. fws, cost)
    redis.call('PEXPIRE', P .. 'fbr:' .. fws, ttl)
    redis.call('SADD', P .. 'dirty', fws)
    local r = allowance - used - cost
    if rid then redis.call('SET', rid, 'fallback:' .. fws .. ':' .. r, 'PX', tonumber(ARGV[6])) end
    return {'fallback', token, tonumber(fws), r}
  end
end
return {'none', token, wait, tonumber(redis.call('GET', P .. 'exh') or '-1'), avail}
