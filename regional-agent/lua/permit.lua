-- permit.lua: the permits of a concurrency quota in one region (a global
-- semaphore, see permits.rs). Prepended with prelude.lua (server_stamp).
--
-- State, under the quota prefix P:
--   P..'pm'  hash: seq (the allocator lease's sequence number this region
--            applied), cap (permits the allocator holds for the region),
--            exp (server ms the lease ends, less a margin), blk (server ms
--            before which nothing is handed out: permits this Redis forgot
--            may still be held), srv (server stamp the state was written on)
--   P..'pz'  sorted set: permit id -> expiry (server ms)
--   P..'ph'  hash: permit id -> holder (the acquire's key, '' for none)
--
-- The bound: live permits (members of pz not yet expired) <= cap <= what
-- the allocator holds for the region, and no permit outlives exp, so the
-- allocator may give the region's permits to another region once its
-- lease ended. cap only rises after the allocator granted (apply/sync),
-- and falls here before the allocator is told (lower).
--
-- KEYS[1]  P..'inc' (routes the call to the quota's slot)
-- ARGV[1]  P, ARGV[2] the operation, then its arguments:
--   acquire id ttl_ms holder -> {'ok', expires_in_ms, left} | {'dup', expires_in_ms, left}
--                               | {'lost'} | {'blocked', ms} | {'lease', live, cap}
--                               | {'full', live, cap}
--   release id holder        -> {'released'} | {'gone'} | {'not_holder'}
--   renew id ttl_ms holder   -> {'renewed', expires_in_ms} | {'gone'} | {'not_holder'}
--   plan                     -> {'lost'} | {'state', seq, cap, live, exp_in_ms, blk_in_ms}
--   lower target             -> {'state', seq, cap, live, exp_in_ms, blk_in_ms}
--   apply seq new_seq held lease_ms
--                            -> {'applied'} | {'stale'}
--   sync new_seq held lease_ms block_ms force
--                            -> {'synced'} | {'stale'}
--       (a conflict's answer: taken unless the state already applied a
--       newer sequence number, which a late answer must not undo; force
--       '1' takes it whatever the state says: the allocator's lease went
--       back, so this region's own record is the one that is wrong)
-- 'lost': no state, or state written on another server history (restart,
-- failover, restored snapshot, eviction): the agent syncs with the
-- allocator and blocks hand-outs for a permit TTL.
local P, op = ARGV[1], ARGV[2]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local M, Z, H = P .. 'pm', P .. 'pz', P .. 'ph'

local function purge()
  local gone = redis.call('ZRANGEBYSCORE', Z, '-inf', now)
  if #gone > 0 then
    redis.call('ZREMRANGEBYSCORE', Z, '-inf', now)
    redis.call('HDEL', H, unpack(gone))
  end
  return redis.call('ZCARD', Z)
end

local function state()
  local v = redis.call('HMGET', M, 'seq', 'cap', 'exp', 'blk', 'srv')
  if not v[1] or v[5] ~= server_stamp() then
    return nil
  end
  return {seq = tonumber(v[1]), cap = tonumber(v[2]), exp = tonumber(v[3]), blk = tonumber(v[4] or '0')}
end

local function answer(s, live)
  return {'state', s.seq, s.cap, live, s.exp - now, s.blk - now}
end

-- Keys live as long as the lease could matter, and then some.
local function keep(ms)
  redis.call('PEXPIRE', M, ms)
  redis.call('PEXPIRE', Z, ms)
  redis.call('PEXPIRE', H, ms)
end
local KEEP = 7 * 24 * 3600 * 1000

local function holder_of(id, holder)
  local h = redis.call('HGET', H, id)
  if h and h ~= '' and holder ~= '' and h ~= holder then return false end
  return true
end

if op == 'acquire' then
  local id, ttl, holder = ARGV[3], tonumber(ARGV[4]), ARGV[5]
  local s = state()
  if not s then return {'lost'} end
  local live = purge()
  local at = redis.call('ZSCORE', Z, id)
  if at then
    -- A retried acquire with the same request id: the same permit.
    return {'dup', tonumber(at) - now, s.cap - live}
  end
  if now < s.blk then return {'blocked', s.blk - now} end
  if s.exp - now < ttl then return {'lease', live, s.cap} end
  if live >= s.cap then return {'full', live, s.cap} end
  redis.call('ZADD', Z, now + ttl, id)
  redis.call('HSET', H, id, holder)
  keep(KEEP)
  return {'ok', ttl, s.cap - live - 1}
elseif op == 'release' or op == 'renew' then
  local id = ARGV[3]
  local holder = op == 'release' and ARGV[4] or ARGV[5]
  purge()
  local at = redis.call('ZSCORE', Z, id)
  if not at then return {'gone'} end
  if not holder_of(id, holder) then return {'not_holder'} end
  if op == 'release' then
    redis.call('ZREM', Z, id)
    redis.call('HDEL', H, id)
    return {'released'}
  end
  -- A renewal never takes the permit past the lease: a region cut off
  -- from the allocator gives shorter lives, never longer ones.
  local s = state()
  local exp = now + tonumber(ARGV[4])
  if s and s.exp < exp then exp = s.exp end
  if exp < tonumber(at) then exp = tonumber(at) end
  redis.call('ZADD', Z, exp, id)
  return {'renewed', exp - now}
elseif op == 'plan' then
  local s = state()
  if not s then return {'lost'} end
  return answer(s, purge())
elseif op == 'lower' then
  local s = state()
  if not s then return {'lost'} end
  local live = purge()
  local target = tonumber(ARGV[3])
  if target < live then target = live end
  if target < s.cap then
    s.cap = target
    redis.call('HSET', M, 'cap', target)
  end
  return answer(s, live)
elseif op == 'apply' then
  local s = state()
  if not s or s.seq ~= tonumber(ARGV[3]) then return {'stale'} end
  redis.call('HSET', M, 'seq', ARGV[4], 'cap', ARGV[5], 'exp', now + tonumber(ARGV[6]))
  keep(KEEP)
  return {'applied'}
elseif op == 'sync' then
  local s = state()
  if s and ARGV[7] ~= '1' and s.seq > tonumber(ARGV[3]) then return {'stale'} end
  local blk = 0
  if tonumber(ARGV[6]) > 0 then blk = now + tonumber(ARGV[6]) end
  if s and s.blk > blk then blk = s.blk end
  redis.call('HSET', M, 'seq', ARGV[3], 'cap', ARGV[4], 'exp', now + tonumber(ARGV[5]),
    'blk', blk, 'srv', server_stamp())
  keep(KEEP)
  return {'synced'}
end
return redis.error_reply('permit.lua: unknown operation ' .. tostring(op))
