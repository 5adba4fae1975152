-- prelude.lua: helpers prepended to spend.lua and view.lua (not a script on
-- its own). Every key is built from P, the quota prefix made by the agent's
-- one audited key function (keys.rs): all share the quota's hash tag, so a
-- script touches a single Redis Cluster slot.
--
-- Lease layout: P..'idx' (zset of live lease ids, score = window start),
-- P..'l:'..id (hash tokens/spent/ws/agent/epoch/done, the lease book),
-- P..'live:'..id (exists while the lease may be spent; relative PX TTL),
-- P..'nb:'..id (exists until a next-window lease may be spent).

-- Takes a lease out of the live set. Its book stays a while so that a
-- replayed grant of the same lease id (a resent request is answered with
-- the same lease) is still recognised; replays come within the agent's
-- resend window (seconds), so ten minutes is ample, and a book kept for the
-- counters' week would hold one hash per lease ever granted (a busy quota
-- renews every second or so).
local BOOK_KEEP_MS = 600000
local function finish(P, id)
  redis.call('ZREM', P .. 'idx', id)
  redis.call('HSET', P .. 'l:' .. id, 'done', '1')
  redis.call('PEXPIRE', P .. 'l:' .. id, BOOK_KEEP_MS)
  redis.call('DEL', P .. 'live:' .. id, P .. 'nb:' .. id)
end

-- Retires a lease that expired or whose epoch is fenced: its unspent tokens
-- become a release entry in the outbox of the agent that holds the lease
-- (only that agent may release it at the allocator), exactly once, because
-- the book is marked done in the same script.
local function retire(P, id, l)
  local tokens, spent = tonumber(l[1]), tonumber(l[2])
  local unspent = tokens - spent
  if unspent > 0 then
    redis.call('RPUSH', P .. 'ob:' .. l[4], cjson.encode({k = 'rel', id = id, u = unspent}))
  end
  finish(P, id)
end

-- Scans the live leases (at most 64): retires the dead ones and returns
-- the spendable leases of the earliest open window with their balance,
-- soonest to expire first (spending those first leaves the least to
-- release when a lease dies before its window ends).
-- Returns ws (or false), total available, {ids}, {remaining}, {life ms},
-- the smallest remaining life (ms) of those leases, pending next-window
-- tokens and the smallest wait (ms) until such a lease becomes spendable.
local function scan(P)
  local ids = redis.call('ZRANGE', P .. 'idx', 0, 63)
  local ws, avail, cand, rem, lives, life = false, 0, {}, {}, {}, -1
  local pending, wait = 0, -1
  for _, id in ipairs(ids) do
    local l = redis.call('HMGET', P .. 'l:' .. id, 'tokens', 'spent', 'ws', 'agent', 'epoch', 'done')
    if not l[1] or l[6] then
      redis.call('ZREM', P .. 'idx', id)
    else
      local fence = tonumber(redis.call('GET', P .. 'fence:' .. l[4]) or '0')
      local pttl = redis.call('PTTL', P .. 'live:' .. id)
      if pttl <= 0 or tonumber(l[5]) < fence then
        retire(P, id, l)
      else
        local left = tonumber(l[1]) - tonumber(l[2])
        if left <= 0 then
          -- Spent out: nothing to release, and leaving it live would make
          -- every later decision scan it until it expires.
          finish(P, id)
        elseif redis.call('EXISTS', P .. 'nb:' .. id) == 1 then
          pending = pending + left
          local w = redis.call('PTTL', P .. 'nb:' .. id)
          if wait < 0 or w < wait then wait = w end
        elseif not ws or ws == l[3] then
          ws = l[3]
          avail = avail + left
          -- Insertion by remaining life: a handful of leases at most.
          local at = #cand + 1
          while at > 1 and lives[at - 1] > pttl do
            cand[at], rem[at], lives[at] = cand[at - 1], rem[at - 1], lives[at - 1]
            at = at - 1
          end
          cand[at], rem[at], lives[at] = id, left, pttl
          if life < 0 or pttl < life then life = pttl end
        end
      end
    end
  end
  return ws, avail, cand, rem, lives, life, pending, wait
end

-- Checks the quota's incarnation key against the token the agent knows.
-- known = '' : first touch by this process, a missing key is a new quota;
-- known = '?': first touch on a region found empty at start, a missing key
--              may be data loss; any other value: the token seen before.
-- A missing key is re-created with `fresh`. On (possible) loss the current
-- window's fallback is marked spent (I6 across Redis data loss) and, on a
-- certain loss, the agent's fence is raised above its epoch so its in-flight
-- grants are never credited (it registers a new epoch). Returns the token in force and a loss flag: 0 none, 1 possible
-- (first touch of an empty region), 2 certain (the agent re-registers).
local function incarnation(P, known, fresh, fb_ws, allowance, agent, epoch, ttl)
  local inc = redis.call('GET', P .. 'inc')
  if inc and (known == '' or known == '?' or known == inc) then
    return inc, 0
  end
  if inc then
    return inc, 2
  end
  redis.call('SET', P .. 'inc', fresh)
  if known == '' then
    return fresh, 0
  end
  local fk = P .. 'fb:' .. fb_ws
  local cur = tonumber(redis.call('GET', fk) or '0')
  if cur < allowance then
    redis.call('SET', fk, allowance, 'PX', ttl)
  end
  if known ~= '?' and agent ~= '' then
    local f = P .. 'fence:' .. agent
    local cur_fence = tonumber(redis.call('GET', f) or '0')
    if cur_fence < epoch + 1 then redis.call('SET', f, epoch + 1) end
  end
  if known == '?' then return fresh, 1 end
  return fresh, 2
end
