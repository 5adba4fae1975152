-- view.lua: what the renewer needs to decide (DESIGN §4), and the sweep
-- that retires expired leases into the outbox. Prepended with prelude.lua.
--
-- KEYS[1]  P..'inc'
-- ARGV[1]  P; ARGV[2] known token; ARGV[3] fresh token; ARGV[4] window
--          length W (s); ARGV[5] allowance; ARGV[6] agent; ARGV[7] epoch;
--          ARGV[8] counters ttl (ms); ARGV[9] life (ms) a lease must have
--          left for its tokens to count as lasting
--
-- Returns {code, token, ws|-1, available, life_ms, pending, wait_ms,
--          demand_total, exhausted_pttl, lasting}; code is 'ok' or 'lost'
--          (then the third element is the loss flag).
--
-- Why one script: the scan retires leases and writes release entries; a
-- lease must be retired exactly once even when replicas sweep together.
--
-- Key lifecycle (F04): the renewer runs this at least once a second for
-- every quota an agent holds, so it keeps the quota's long-lived keys
-- alive for the counters' ttl; a quota no agent holds any more lets them
-- expire.
local P = ARGV[1]
local ttl = tonumber(ARGV[8])
local token, lost = incarnation(P, ARGV[2], ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6], tonumber(ARGV[7]))
if lost > 0 then
  return {'lost', token, lost}
end
for _, k in ipairs({'inc', 'srv', 'clk', 'pol', 'dem', 'idx'}) do
  redis.call('PEXPIRE', P .. k, ttl)
end
local ws, avail, _, rem, lives, life, pending, wait = scan(P)
local lasting = 0
for i, l in ipairs(lives) do
  if l >= tonumber(ARGV[9]) then lasting = lasting + rem[i] end
end
local dem = tonumber(redis.call('GET', P .. 'dem') or '0')
return {'ok', token, tonumber(ws or '-1'), avail, life, pending, wait, dem, redis.call('PTTL', P .. 'exh'), lasting}
