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

-- The identity of the server this script runs on and of its history:
-- `run_id` changes at every restart of the process (also one that loads
-- the same snapshot or AOF again) and differs on a promoted replica;
-- `evicted_keys` rises when the server evicted anything. The quota keeps
-- the stamp it last ran under in P..'srv'; a stamp that differs means the
-- keyspace may have gone back in time (restored snapshot, failover to a
-- replica that missed writes, eviction): a rollback (DESIGN I6).
-- Every decision needs it (a rollback between two runs is caught by the
-- second), so it is read in every run, and cheaply: the fields are found
-- with a plain search and read with a pattern anchored where they start.
-- An unanchored pattern tried at every offset of the ~1.9 KB text cost
-- about 9 us of Redis CPU per run, more than generating the text.
local function info_field(info, name, pat)
  local at = string.find(info, name, 1, true)
  return at and string.match(info, pat, at + #name)
end
local function server_stamp()
  local info = redis.call('INFO', 'server', 'stats')
  local run_id = info_field(info, '\nrun_id:', '^(%x+)') or '?'
  local evicted = info_field(info, '\nevicted_keys:', '^(%d+)') or '0'
  return run_id .. ':' .. evicted
end

-- The fallback window (start, ms to its end) from one clock for the whole
-- region (I8): the server's TIME corrected by the offset to the allocator's
-- clock that the last credited grant measured (P..'clk', see credit.lua),
-- never an agent's own wall clock, so replicas whose clocks differ share
-- one fallback counter per real window. Without a measured offset the
-- server's clock alone is used (still one clock for all replicas).
-- Returns the window start (allocator s, text), ms to its end, and the
-- server's clock (ms).
local function fallback_window(P, W)
  local t = redis.call('TIME')
  local srv_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local now_ms = srv_ms + tonumber(redis.call('GET', P .. 'clk') or '0')
  local now_s = math.floor(now_ms / 1000)
  local ws = now_s - (now_s % W)
  local to_end = (ws + W) * 1000 - now_ms
  return string.format('%d', ws), to_end, srv_ms
end

-- Marks the open fallback window's allowance as spent (the counter of a
-- lost or rolled-back state cannot be trusted: I6). The counter lives until
-- its window ends plus a minute.
local function spend_fallback(P, W, allowance)
  if allowance <= 0 then return end
  local fws, to_end = fallback_window(P, W)
  local fk = P .. 'fb:' .. fws
  local cur = tonumber(redis.call('GET', fk) or '0')
  if cur < allowance then
    redis.call('SET', fk, allowance, 'PX', to_end + 60000)
  end
end

-- Raises an agent's epoch fence to at least `epoch`. Fences expire after
-- FENCE_KEEP_MS: no lease outlives its window (at most a day), so a fence
-- older than that guards nothing, and fences of agents that are gone
-- would otherwise stay forever (F04).
local FENCE_KEEP_MS = 2 * 86400 * 1000
local function raise_fence(P, agent, epoch)
  local f = P .. 'fence:' .. agent
  local cur = tonumber(redis.call('GET', f) or '0')
  if cur < epoch then
    redis.call('SET', f, epoch, 'PX', FENCE_KEEP_MS)
    return epoch
  end
  redis.call('PEXPIRE', f, FENCE_KEEP_MS)
  return cur
end

-- Strands everything a rolled-back state holds: live leases are finished
-- without a release (their `spent` may be older than what was really
-- spent, so neither spending nor releasing their balance is safe), and
-- unreported counters are dropped (they may have been cut and reported
-- after the snapshot was taken; reporting them again would count admits
-- twice, while dropping them can only under-count). Outbox entries stay:
-- report ids and lease releases are idempotent at the allocator.
local function strand(P)
  for _, id in ipairs(redis.call('ZRANGE', P .. 'idx', 0, -1)) do
    finish(P, id)
  end
  for _, ws in ipairs(redis.call('SMEMBERS', P .. 'dirty')) do
    redis.call('DEL', P .. 'cons:' .. ws, P .. 'fbr:' .. ws)
  end
  redis.call('DEL', P .. 'dirty', P .. 'exh')
end

-- Checks the quota's incarnation key against the token the agent knows,
-- and the server stamp against the one the quota last ran under.
-- known = '' : first touch by this process, a missing key is a new quota;
-- known = '?': first touch on a region found empty at start, a missing key
--              may be data loss; any other value: the token seen before.
-- A missing key is re-created with `fresh`. On (possible) loss the current
-- window's fallback is marked spent (I6 across Redis data loss) and, on a
-- certain loss, the agent's fence is raised above its epoch so its
-- in-flight grants are never credited (it registers a new epoch). On a
-- rollback (stamp changed while the keys survived) the state is stranded
-- first and a fresh token installed, so every replica sees a changed
-- incarnation before it decides anything. Returns the token in force and a
-- loss flag: 0 none, 1 possible (first touch of an empty region), 2
-- certain (the agent re-registers), 3 rollback (certain, state stranded).
local function incarnation(P, known, fresh, W, allowance, agent, epoch)
  local stamp = server_stamp()
  local inc = redis.call('GET', P .. 'inc')
  local srv = redis.call('GET', P .. 'srv')
  if inc and srv and srv ~= stamp then
    strand(P)
    spend_fallback(P, W, allowance)
    redis.call('SET', P .. 'inc', fresh)
    redis.call('SET', P .. 'srv', stamp)
    if agent ~= '' then raise_fence(P, agent, epoch + 1) end
    return fresh, 3
  end
  if inc and not srv then
    -- Written by an agent before stamps existed: adopt the server's.
    redis.call('SET', P .. 'srv', stamp)
  end
  if inc and (known == '' or known == '?' or known == inc) then
    return inc, 0
  end
  if inc then
    return inc, 2
  end
  redis.call('SET', P .. 'inc', fresh)
  redis.call('SET', P .. 'srv', stamp)
  if known == '' then
    return fresh, 0
  end
  spend_fallback(P, W, allowance)
  if known ~= '?' and agent ~= '' then
    raise_fence(P, agent, epoch + 1)
  end
  if known == '?' then return fresh, 1 end
  return fresh, 2
end

-- Whether the quota's state may be used by a script that does not decide
-- (credit, cut): the server stamp is the one the quota last ran under.
-- A mismatch is handled (stranded) by the next spend or view run.
local function same_server(P)
  local srv = redis.call('GET', P .. 'srv')
  return srv == false or srv == server_stamp()
end
