-- spend.lua: the admission decisions (I5) of one or more requests on one
-- quota, made one after the other in arrival order. Prepended with
-- prelude.lua.
--
-- KEYS[1]  P..'inc' (routes the call to the quota's slot; P is ARGV[1])
-- ARGV[1]  P, the quota prefix from keys.rs
-- ARGV[2]  incarnation token the agent knows ('' / '?' on first touch)
-- ARGV[3]  fresh token to install when the incarnation key is missing
-- ARGV[4]  request id ttl (ms)
-- ARGV[5]  '1' when fallback may be used (allocator unreachable, bounded)
-- ARGV[6]  window length W (s); the fallback window is taken from the
--          region's one clock (see fallback_window in the prelude)
-- ARGV[7]  fallback allowance per window for the region
-- ARGV[8]  ttl of counters (ms)
-- ARGV[9]  agent id, ARGV[10] agent epoch (0 when not registered yet)
-- ARGV[11] per-key bucket refill rate in milli-tokens per second ('0': the
--          policy has no per-key limit), ARGV[12] bucket size (tokens)
-- then four arguments per request, from ARGV[13]:
--   cost (tokens, >= 1); request id key suffix ('' when the request carries
--   none); '1' when the request counts toward demand (a request that waits
--   for a renewal and tries again is one request of demand, not several:
--   counted twice, a slow region's demand estimate jumps at every window
--   boundary and its leases strand tokens); the per-key bucket's key suffix
--   from keys.rs ('' when the request names no key)
--
-- Per-key buckets (P..'k:'..suffix, a hash {t, at}) hold integer
-- micro-tokens (a rate of r milli-tokens/s adds exactly r micro-tokens per
-- ms, so refill never rounds) and are refilled from the server's TIME, one
-- clock for every replica of the region whatever their own clocks say. A
-- request's bucket is checked first: a refused key spends nothing of the
-- quota and counts no demand; a quota that refuses leaves the bucket as it
-- was. Only an admit debits both.
--
-- Returns {'lost', token, flag} for all the requests when the incarnation
-- changed or is missing or the server's history changed (rollback, see
-- prelude), else {'ok', token, d1, d2, ...} with
-- one decision per request:
--   {'dup', 'src:ws:rem'}      request id seen: the first decision
--   {'lease', ws, remaining, key_left}     key_left: whole tokens left in
--   {'fallback', ws, remaining, key_left}  the request's bucket, -1: no key
--   {'none', wait_ms, exhausted_retry_ms (-1: not exhausted), available}
--   {'key', retry_ms, key_left}  the key's bucket is short by the cost:
--                                retry_ms until it refills enough
--
-- Why one script: expiry, epoch fence, balance check, debit, demand count,
-- consumption counter and request-id record must happen as one step across
-- replicas. MULTI/EXEC cannot branch on what it read, and a key can expire
-- between the commands of a MULTI but never in the middle of a script.
-- Why several requests: the leases are scanned once for all of them and
-- the counters written once, so a busy quota costs Redis one run per batch
-- instead of one per request; each decision still sees every debit before
-- it, exactly as if the requests had come in separate runs.
local P = ARGV[1]
local ttl = tonumber(ARGV[8])
local W = tonumber(ARGV[6])
local allowance = tonumber(ARGV[7])
local token, lost = incarnation(P, ARGV[2], ARGV[3], W, allowance, ARGV[9], tonumber(ARGV[10]))
if lost > 0 then
  return {'lost', token, lost}
end
local rid_ttl = tonumber(ARGV[4])
local pk_rate = tonumber(ARGV[11])
local pk_cap = tonumber(ARGV[12]) * 1000000
local MICRO = 1000000

-- The per-key buckets this run touched, by key name: {t, at, dirty}.
local buckets, now_ms = {}, false
local function bucket(k)
  local b = buckets[k]
  if b then return b end
  if not now_ms then
    local tm = redis.call('TIME')
    now_ms = tonumber(tm[1]) * 1000 + math.floor(tonumber(tm[2]) / 1000)
  end
  local v = redis.call('HMGET', k, 't', 'at')
  local t, at = tonumber(v[1]), tonumber(v[2])
  if not t or not at then
    t, at = pk_cap, now_ms
  elseif now_ms > at then
    -- Capped before multiplying, so the product stays exact in a double.
    if now_ms - at >= math.ceil((pk_cap - t) / pk_rate) then
      t = pk_cap
    else
      t = t + (now_ms - at) * pk_rate
    end
    at = now_ms
  end
  -- A server clock that went back refills nothing until it passes `at`.
  -- A bucket fuller than the policy's burst (the burst was lowered since)
  -- holds the new burst.
  if t > pk_cap then t = pk_cap end
  b = {t = t, at = at, dirty = false}
  buckets[k] = b
  return b
end
local function whole(b)
  if not b then return -1 end
  return math.floor(b.t / MICRO)
end

local ws, avail, cand, rem, _, _, _, wait = scan(P)
-- Debits are taken from the candidates in order (soonest to expire first)
-- and written once at the end.
local first, took = 1, {}
for i = 1, #cand do took[i] = 0 end
local demand, consumed, fb_used, fb_taken, exh = 0, 0, false, 0, false
-- The fallback window and the time to its end, read once when needed.
local fws, fb_end = false, 0
local out = {'ok', token}
for at = 13, #ARGV - 3, 4 do
  local cost = tonumber(ARGV[at])
  local rid, seen = false, false
  if ARGV[at + 1] ~= '' then
    rid = P .. 'rid:' .. ARGV[at + 1]
    seen = redis.call('GET', rid)
  end
  local b = false
  if not seen and pk_rate > 0 and ARGV[at + 3] ~= '' then
    b = bucket(P .. 'k:' .. ARGV[at + 3])
  end
  if seen then
    out[#out + 1] = {'dup', seen}
  elseif b and b.t < cost * MICRO then
    out[#out + 1] = {'key', math.ceil((cost * MICRO - b.t) / pk_rate), whole(b)}
  else
    if ARGV[at + 2] == '1' then demand = demand + cost end
    if ws and avail >= cost then
      local left = cost
      while left > 0 do
        local take = math.min(left, rem[first])
        rem[first] = rem[first] - take
        took[first] = took[first] + take
        left = left - take
        if rem[first] == 0 then first = first + 1 end
      end
      avail = avail - cost
      consumed = consumed + cost
      if rid then redis.call('SET', rid, 'lease:' .. ws .. ':' .. avail, 'PX', rid_ttl) end
      if b then b.t = b.t - cost * MICRO; b.dirty = true end
      out[#out + 1] = {'lease', tonumber(ws), avail, whole(b)}
    else
      local admitted = false
      if ARGV[5] == '1' then
        if not fb_used then
          fws, fb_end = fallback_window(P, W)
          fb_used = tonumber(redis.call('GET', P .. 'fb:' .. fws) or '0')
        end
        if fb_used + cost <= allowance then
          fb_used = fb_used + cost
          fb_taken = fb_taken + cost
          local r = allowance - fb_used
          if rid then redis.call('SET', rid, 'fallback:' .. fws .. ':' .. r, 'PX', rid_ttl) end
          if b then b.t = b.t - cost * MICRO; b.dirty = true end
          out[#out + 1] = {'fallback', tonumber(fws), r, whole(b)}
          admitted = true
        end
      end
      if not admitted then
        if not exh then exh = tonumber(redis.call('GET', P .. 'exh') or '-1') end
        out[#out + 1] = {'none', wait, exh, avail}
      end
    end
  end
end

if demand > 0 then redis.call('INCRBY', P .. 'dem', demand) end
for i, id in ipairs(cand) do
  if took[i] > 0 then
    redis.call('HINCRBY', P .. 'l:' .. id, 'spent', took[i])
    if rem[i] == 0 then finish(P, id) end
  end
end
if consumed > 0 then
  redis.call('INCRBY', P .. 'cons:' .. ws, consumed)
  redis.call('PEXPIRE', P .. 'cons:' .. ws, ttl)
  redis.call('SADD', P .. 'dirty', ws)
  redis.call('PEXPIRE', P .. 'dirty', ttl)
end
if fb_taken > 0 then
  -- The allowance counter matters only until its window ends; the
  -- report counter (fbr) waits for the outbox as long as the others.
  redis.call('INCRBY', P .. 'fb:' .. fws, fb_taken)
  redis.call('PEXPIRE', P .. 'fb:' .. fws, fb_end + 60000)
  redis.call('INCRBY', P .. 'fbr:' .. fws, fb_taken)
  redis.call('PEXPIRE', P .. 'fbr:' .. fws, ttl)
  redis.call('SADD', P .. 'dirty', fws)
  redis.call('PEXPIRE', P .. 'dirty', ttl)
end
-- A bucket lives until it would be full again, plus a minute of slack
-- (F04): a key that comes back later starts full, which is what the
-- bucket would hold by then anyway.
for k, b in pairs(buckets) do
  if b.dirty then
    redis.call('HSET', k, 't', string.format('%.0f', b.t), 'at', string.format('%.0f', b.at))
    redis.call('PEXPIRE', k, string.format('%.0f', math.ceil((pk_cap - b.t) / pk_rate) + 60000))
  end
end
return out
