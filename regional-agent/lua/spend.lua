-- spend.lua: the admission decisions (I5) of one or more requests, each on
-- one or more quotas of one tenant, made one after the other in arrival
-- order. Prepended with prelude.lua.
--
-- KEYS     P..'inc' of every quota (routes the call to the quotas' slot:
--          one tenant's quotas share it, see keys.rs)
-- ARGV[1]  request id ttl (ms), ARGV[2] ttl of counters (ms)
-- ARGV[3]  agent id, ARGV[4] agent epoch (0 when not registered yet)
-- ARGV[5]  legacy gate: the region's fallback may not be used until this
--          instant (server clock, ms): an agent of the legacy key layout
--          may be using its own counter until then (F34); 0 for none
-- ARGV[6]  m, the number of quotas, then ten arguments per quota:
--   P, the quota prefix from keys.rs; incarnation token the agent knows
--   ('' / '?' on first touch); fresh token to install when the
--   incarnation key is missing; '1' when fallback may be used (allocator
--   unreachable, bounded); window length W (s), the fallback window taken
--   from the region's one clock (fallback_window in the prelude);
--   fallback allowance per window; per-key bucket refill rate in
--   milli-tokens per second ('0': no per-key limit); bucket size (tokens);
--   the window start the legacy layout's fallback count below is for
--   ('-1': none), and that count: a legacy agent's admits from the
--   allowance, under keys of another slot, frozen since none is alive
--   (the legacy gate covers the time one is); added to this layout's in
--   that window, and no fallback in another window (a clock at a boundary)
-- then 3 + 2m arguments per request:
--   request id key suffix ('' when the request carries none); '1' when the
--   request counts toward demand (a request that waits for a renewal and
--   tries again is one request of demand, not several: counted twice, a
--   slow region's demand estimate jumps at every window boundary and its
--   leases strand tokens); the per-key bucket's key suffix from keys.rs
--   ('' when the request names no key); its cost on each quota (tokens,
--   0 when it does not spend that quota); then on each quota the tokens it
--   may not take: the reserves kept for priorities more important than the
--   request's (0: none). A lease pays such a request only while the
--   region's balance plus what the window's pool still holds
--   (P..'room:'..ws, the least a grant answer said, credit.lua) keeps them
--   after its cost; the fallback allowance is not reserved.
--
-- Per-key buckets (P..'k:'..suffix, a hash {t, at}) hold integer
-- micro-tokens (a rate of r milli-tokens/s adds exactly r micro-tokens per
-- ms, so refill never rounds) and are refilled from the server's TIME, one
-- clock for every replica of the region whatever their own clocks say.
-- A request's buckets are checked first, then every quota it names: only
-- when every limit allows is anything debited, and then every limit is
-- (F08, F18). A refused key spends nothing of any quota and counts no
-- demand.
--
-- Returns {'lost', i, token, flag} when quota i's incarnation changed or is
-- missing or the server's history changed (rollback, see prelude); nothing
-- was decided. Else {'ok', {token per quota}, d1, d2, ...} with one
-- decision per request:
--   {'dup', {record per quota named}}  request id seen: the first decision
--                                      ('src:ws:rem' per quota)
--   {'admit', {{src, ws, remaining, key_left} per quota named}}
--       src 'lease' or 'fallback'; key_left: whole tokens left in the
--       request's bucket of that quota, -1 without one
--   {'none', i, wait_ms, exhausted_retry_ms (-1: not exhausted), available}
--       quota i had no token for it (the first that refused)
--   {'key', i, retry_ms, key_left}  the key's bucket of quota i is short
--                                   by the cost: retry_ms until it refills
--   {'reserve', i, available, room} quota i keeps what is left for more
--                                   important priorities; its demand is
--                                   not counted (it would fetch leases
--                                   only the reserve's priorities may use)
--
-- Why one script: expiry, epoch fence, balance check, debit, demand count,
-- consumption counter and request-id record must happen as one step across
-- replicas and across the quotas of a request. MULTI/EXEC cannot branch on
-- what it read, and a key can expire between the commands of a MULTI but
-- never in the middle of a script.
-- Why several requests: the leases are scanned once for all of them and
-- the counters written once, so a busy quota costs Redis one run per batch
-- instead of one per request; each decision still sees every debit before
-- it, exactly as if the requests had come in separate runs.
local MICRO = 1000000
local rid_ttl = tonumber(ARGV[1])
local ttl = tonumber(ARGV[2])
local agent, epoch = ARGV[3], tonumber(ARGV[4])
local legacy_until = tonumber(ARGV[5])
local m = tonumber(ARGV[6])

local Q, tokens = {}, {}
for i = 1, m do
  local b = 7 + (i - 1) * 10
  local q = {
    P = ARGV[b], fallback = ARGV[b + 3] == '1', W = tonumber(ARGV[b + 4]),
    allowance = tonumber(ARGV[b + 5]), rate = tonumber(ARGV[b + 6]),
    cap = tonumber(ARGV[b + 7]) * MICRO,
    legacy_ws = tonumber(ARGV[b + 8]), legacy_used = tonumber(ARGV[b + 9]),
  }
  local token, lost = incarnation(q.P, ARGV[b + 1], ARGV[b + 2], q.W, q.allowance, agent, epoch)
  if lost > 0 then
    return {'lost', i, token, lost}
  end
  tokens[i] = token
  Q[i] = q
end
for _, q in ipairs(Q) do
  q.ws, q.avail, q.cand, q.rem, _, _, _, q.wait = scan(q.P)
  -- Debits are taken from the candidates in order (soonest to expire
  -- first) and written once at the end.
  q.first, q.took = 1, {}
  for i = 1, #q.cand do q.took[i] = 0 end
  q.demand, q.consumed, q.fb_used, q.fb_taken, q.exh, q.room = 0, 0, false, 0, false, false
  -- The fallback window, the time to its end and whether the legacy gate
  -- lets it be used, read once when needed.
  q.fws, q.fb_end, q.fb_open = false, 0, false
end

-- The per-key buckets this run touched, by key name: {t, at, dirty}.
local buckets, now_ms = {}, false
local function bucket(q, k)
  local b = buckets[k]
  if b then return b end
  if not now_ms then
    local tm = redis.call('TIME')
    now_ms = tonumber(tm[1]) * 1000 + math.floor(tonumber(tm[2]) / 1000)
  end
  local v = redis.call('HMGET', k, 't', 'at')
  local t, at = tonumber(v[1]), tonumber(v[2])
  if not t or not at then
    t, at = q.cap, now_ms
  elseif now_ms > at then
    -- Capped before multiplying, so the product stays exact in a double.
    if now_ms - at >= math.ceil((q.cap - t) / q.rate) then
      t = q.cap
    else
      t = t + (now_ms - at) * q.rate
    end
    at = now_ms
  end
  -- A server clock that went back refills nothing until it passes `at`.
  -- A bucket fuller than the policy's burst (the burst was lowered since)
  -- holds the new burst.
  if t > q.cap then t = q.cap end
  b = {t = t, at = at, dirty = false, q = q}
  buckets[k] = b
  return b
end
local function whole(b)
  if not b then return -1 end
  return math.floor(b.t / MICRO)
end

-- What the pool of q's lease window still holds unleased, read once.
local function room(q)
  if not q.room then q.room = tonumber(redis.call('GET', q.P .. 'room:' .. q.ws) or '0') end
  return q.room
end

-- How quota q can pay `cost` now: 'lease', 'fallback' or false.
local function payable(q, cost)
  if q.ws and q.avail >= cost then return 'lease' end
  if not q.fallback then return false end
  if not q.fws then
    local now_srv
    q.fws, q.fb_end, now_srv = fallback_window(q.P, q.W)
    q.fb_open = now_srv > legacy_until
    q.fb_used = tonumber(redis.call('GET', q.P .. 'fb:' .. q.fws) or '0')
    if q.legacy_ws >= 0 then
      if tonumber(q.fws) == q.legacy_ws then
        q.fb_used = q.fb_used + q.legacy_used
      else
        q.fb_open = false
      end
    end
  end
  if q.fb_open and q.fb_used + cost <= q.allowance then return 'fallback' end
  return false
end

-- Debits `cost` from q by `how`; returns the record {src, ws, remaining}.
local function pay(q, cost, how)
  if how == 'lease' then
    local left = cost
    while left > 0 do
      local take = math.min(left, q.rem[q.first])
      q.rem[q.first] = q.rem[q.first] - take
      q.took[q.first] = q.took[q.first] + take
      left = left - take
      if q.rem[q.first] == 0 then q.first = q.first + 1 end
    end
    q.avail = q.avail - cost
    q.consumed = q.consumed + cost
    return 'lease', q.ws, q.avail
  end
  q.fb_used = q.fb_used + cost
  q.fb_taken = q.fb_taken + cost
  return 'fallback', q.fws, q.allowance - q.fb_used
end

local out = {'ok', tokens}
local first_ask = 7 + 10 * m
for at = first_ask, #ARGV - (2 + 2 * m), 3 + 2 * m do
  local rid, counts, key = ARGV[at], ARGV[at + 1] == '1', ARGV[at + 2]
  local costs, held, named = {}, {}, {}
  for i = 1, m do
    costs[i] = tonumber(ARGV[at + 2 + i])
    held[i] = tonumber(ARGV[at + 2 + m + i])
    if costs[i] > 0 then named[#named + 1] = i end
  end
  -- A request id's record is written in every quota it names, in the
  -- same run: one present means the request was decided.
  local seen, recs = false, {}
  if rid ~= '' then
    for j, i in ipairs(named) do
      recs[j] = redis.call('GET', Q[i].P .. 'rid:' .. rid) or ''
      if recs[j] ~= '' then seen = true end
    end
  end
  local refused, bs = false, {}
  if seen then
    out[#out + 1] = {'dup', recs}
  else
    if key ~= '' then
      for _, i in ipairs(named) do
        local q = Q[i]
        if q.rate > 0 then
          local b = bucket(q, q.P .. 'k:' .. key)
          bs[i] = b
          if b.t < costs[i] * MICRO then
            refused = {'key', i, math.ceil((costs[i] * MICRO - b.t) / q.rate), whole(b)}
            break
          end
        end
      end
    end
    if not refused then
      -- A quota with no token wins over a reserve's refusal: the request
      -- may wait for its renewal, and its demand must be seen.
      local how, none, reserved = {}, false, false
      for _, i in ipairs(named) do
        local q = Q[i]
        if counts then q.demand = q.demand + costs[i] end
        how[i] = payable(q, costs[i])
        if not how[i] then
          if not none then
            if not q.exh then q.exh = tonumber(redis.call('GET', q.P .. 'exh') or '-1') end
            none = {'none', i, q.wait, q.exh, q.avail}
          end
        elseif how[i] == 'lease' and held[i] > 0 and not reserved
            and q.avail + room(q) - costs[i] < held[i] then
          reserved = {'reserve', i, q.avail, room(q)}
        end
      end
      refused = none or reserved
      if not none and reserved and counts then
        local i = reserved[2]
        Q[i].demand = Q[i].demand - costs[i]
      end
      if not refused then
        local parts = {}
        for j, i in ipairs(named) do
          local q = Q[i]
          local src, ws, left = pay(q, costs[i], how[i])
          local b = bs[i]
          if b then b.t = b.t - costs[i] * MICRO; b.dirty = true end
          if rid ~= '' then
            redis.call('SET', q.P .. 'rid:' .. rid, src .. ':' .. ws .. ':' .. left, 'PX', rid_ttl)
          end
          parts[j] = {src, tonumber(ws), left, whole(b)}
        end
        out[#out + 1] = {'admit', parts}
      end
    end
    if refused then out[#out + 1] = refused end
  end
end

for _, q in ipairs(Q) do
  local P = q.P
  if q.demand > 0 then redis.call('INCRBY', P .. 'dem', q.demand) end
  for i, id in ipairs(q.cand) do
    if q.took[i] > 0 then
      redis.call('HINCRBY', P .. 'l:' .. id, 'spent', q.took[i])
      if q.rem[i] == 0 then finish(P, id) end
    end
  end
  if q.consumed > 0 then
    redis.call('INCRBY', P .. 'cons:' .. q.ws, q.consumed)
    redis.call('PEXPIRE', P .. 'cons:' .. q.ws, ttl)
    redis.call('SADD', P .. 'dirty', q.ws)
    redis.call('PEXPIRE', P .. 'dirty', ttl)
  end
  if q.fb_taken > 0 then
    -- The allowance counter matters only until its window ends; the
    -- report counter (fbr) waits for the outbox as long as the others.
    redis.call('INCRBY', P .. 'fb:' .. q.fws, q.fb_taken)
    redis.call('PEXPIRE', P .. 'fb:' .. q.fws, q.fb_end + 60000)
    redis.call('INCRBY', P .. 'fbr:' .. q.fws, q.fb_taken)
    redis.call('PEXPIRE', P .. 'fbr:' .. q.fws, ttl)
    redis.call('SADD', P .. 'dirty', q.fws)
    redis.call('PEXPIRE', P .. 'dirty', ttl)
  end
end
-- A bucket lives until it would be full again, plus a minute of slack
-- (F04): a key that comes back later starts full, which is what the
-- bucket would hold by then anyway.
for k, b in pairs(buckets) do
  if b.dirty then
    redis.call('HSET', k, 't', string.format('%.0f', b.t), 'at', string.format('%.0f', b.at))
    redis.call('PEXPIRE', k, string.format('%.0f', math.ceil((b.q.cap - b.t) / b.q.rate) + 60000))
  end
end
return out
