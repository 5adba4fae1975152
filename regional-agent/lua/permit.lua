-- permit.lua: the permits of a concurrency quota in one region (a global
-- semaphore, see permits/mod.rs). Prepended with prelude.lua (server_stamp).
--
-- State, under the quota's permit prefix P (always the tenant key layout):
--   P..'pm'  hash: seq (the allocator lease's sequence number this region
--            applied), cap (permits the allocator holds for the region),
--            exp (server ms the lease ends, less a margin), blk (server ms
--            before which nothing is handed out: permits this Redis forgot
--            may still be held), ttl (the permit TTL of the last answer,
--            ms: renewals use it), srv (server stamp the state was written
--            on)
--   P..'pz'  sorted set: permit id -> expiry (server ms)
--   P..'ph'  hash: permit id -> holder (the acquire's key, '' for none)
--
-- The bound: live permits (members of pz not yet expired) <= cap <= what
-- the allocator holds for the region, and no permit outlives exp, so the
-- allocator may give the region's permits to another region once its
-- lease ended. cap only rises after the allocator granted (apply/sync),
-- and falls here before the allocator is told (lower). exp is absolute,
-- from this server's clock read before the request left (plan/lower
-- return it), so however late an answer is applied it cannot stretch the
-- lease.
--
-- KEYS[1]  P..'inc' (routes the call to the quota's slot)
-- ARGV[1]  P, ARGV[2] the operation, then its arguments:
--   acquire id ttl_ms holder -> {'ok', expires_in_ms, left} | {'dup', expires_in_ms, left}
--       (ttl_ms: the agent's TTL, used only until an answer wrote the
--       region's own in pm, which every replica then follows)
--                               | {'mismatch'} | {'lost'} | {'blocked', ms}
--                               | {'lease', live, cap} | {'full', live, cap}
--       ('dup': a retried acquire with the same request id, same holder;
--       'mismatch': the id was handed out to another holder)
--   release id holder        -> {'released'} | {'gone'} | {'not_holder'}
--   renew id holder          -> {'renewed', expires_in_ms} | {'gone'} | {'not_holder'}
--       (by the TTL kept in pm, never past exp; 'gone' too when the state
--       is lost: a permit this Redis cannot vouch for is not extended)
--   plan                     -> {'lost', now} | {'state', seq, cap, live, exp_in_ms, blk_in_ms, now}
--   lower target             -> the same, after lowering cap to target
--                               (never below the live permits)
--   apply seq new_seq held exp ttl_ms
--                            -> {'applied'} | {'stale'}
--   sync new_seq held exp block_ms ttl_ms force
--                            -> {'synced'} | {'blocked'} | {'stale'}
--       (a conflict's answer, or the first after a lost state: taken when
--       its sequence number is newer than the state's; at the same one the
--       cap only falls (a late answer must not undo a lower made since);
--       force '1' takes it whatever the state says: the allocator's lease
--       went back, so this region's record is the one that is wrong. A
--       block of block_ms from now (after the answer) is set only while
--       the state is lost here, whatever the caller saw when it planned: a
--       replica that synced meanwhile made it whole again, and a state lost
--       while the call was on its way is blocked all the same; 'blocked'
--       says one was set)
-- 'lost': no state, or state written on another server history (restart,
-- failover, restored snapshot, eviction): the agent syncs with the
-- allocator and blocks hand-outs while forgotten permits may be held.
local P, op = ARGV[1], ARGV[2]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local M, Z, H = P .. 'pm', P .. 'pz', P .. 'ph'

-- Expired permits go, a bounded number per run (the rest count as live
-- until the next run: the safe side).
local function purge()
  for _ = 1, 10 do
    local gone = redis.call('ZRANGEBYSCORE', Z, '-inf', now, 'LIMIT', 0, 500)
    if #gone == 0 then break end
    redis.call('ZREM', Z, unpack(gone))
    redis.call('HDEL', H, unpack(gone))
    if #gone < 500 then break end
  end
  return redis.call('ZCARD', Z)
end

local function state()
  local v = redis.call('HMGET', M, 'seq', 'cap', 'exp', 'blk', 'srv', 'ttl')
  if not v[1] or v[5] ~= server_stamp() then
    return nil
  end
  return {seq = tonumber(v[1]), cap = tonumber(v[2]), exp = tonumber(v[3]), blk = tonumber(v[4] or '0'),
    ttl = tonumber(v[6] or '0')}
end

local function answer(s, live)
  return {'state', s.seq, s.cap, live, s.exp - now, s.blk - now, now}
end

-- Keys live as long as the lease could matter, and then some.
local KEEP = 7 * 24 * 3600 * 1000
local function keep()
  redis.call('PEXPIRE', M, KEEP)
  redis.call('PEXPIRE', Z, KEEP)
  redis.call('PEXPIRE', H, KEEP)
end

local function holder_of(id, holder)
  local h = redis.call('HGET', H, id)
  if h and h ~= '' and holder ~= '' and h ~= holder then return false end
  return true
end

if op == 'acquire' then
  local id, ttl, holder = ARGV[3], tonumber(ARGV[4]), ARGV[5]
  local s = state()
  if not s then return {'lost'} end
  if s.ttl > 0 then ttl = s.ttl end
  local live = purge()
  local at = redis.call('ZSCORE', Z, id)
  if at then
    if redis.call('HGET', H, id) ~= holder then return {'mismatch'} end
    return {'dup', tonumber(at) - now, s.cap - live}
  end
  if now < s.blk then return {'blocked', s.blk - now} end
  if s.exp - now < ttl then return {'lease', live, s.cap} end
  if live >= s.cap then return {'full', live, s.cap} end
  redis.call('ZADD', Z, now + ttl, id)
  redis.call('HSET', H, id, holder)
  keep()
  return {'ok', ttl, s.cap - live - 1}
elseif op == 'release' or op == 'renew' then
  local id, holder = ARGV[3], ARGV[4]
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
  if not s then return {'gone'} end
  local exp = now + s.ttl
  if s.exp < exp then exp = s.exp end
  if exp < tonumber(at) then exp = tonumber(at) end
  redis.call('ZADD', Z, exp, id)
  return {'renewed', exp - now}
elseif op == 'plan' or op == 'lower' then
  local s = state()
  if not s then return {'lost', now} end
  local live = purge()
  if op == 'lower' then
    local target = tonumber(ARGV[3])
    if target < live then target = live end
    if target < s.cap then
      s.cap = target
      redis.call('HSET', M, 'cap', target)
    end
  end
  return answer(s, live)
elseif op == 'apply' then
  local s = state()
  if not s or s.seq ~= tonumber(ARGV[3]) then return {'stale'} end
  local exp = tonumber(ARGV[6])
  -- The allocator never shortens a live lease; neither does the region.
  if s.exp > exp then exp = s.exp end
  redis.call('HSET', M, 'seq', ARGV[4], 'cap', ARGV[5], 'exp', exp, 'ttl', ARGV[7])
  keep()
  return {'applied'}
elseif op == 'sync' then
  local s = state()
  local seq, held, exp = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
  local force = ARGV[8] == '1'
  if s and not force then
    if s.seq > seq then return {'stale'} end
    if s.seq == seq then
      if held < s.cap then redis.call('HSET', M, 'cap', held) end
      return {'synced'}
    end
  end
  local blk, blocked = 0, false
  if not s and tonumber(ARGV[6]) > 0 then
    blk, blocked = now + tonumber(ARGV[6]), true
  end
  if s and s.blk > blk then blk = s.blk end
  redis.call('HSET', M, 'seq', seq, 'cap', held, 'exp', exp, 'blk', blk, 'ttl', ARGV[7],
    'srv', server_stamp())
  keep()
  if blocked then return {'blocked'} end
  return {'synced'}
end
return redis.error_reply('permit.lua: unknown operation ' .. tostring(op))
