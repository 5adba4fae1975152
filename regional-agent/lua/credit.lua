-- credit.lua: credits one granted lease into the region's balance, and
-- records the offset of the allocator's clock to this server's (P..'clk',
-- the region's one clock for fallback windows, I8). Prepended with
-- prelude.lua.
--
-- KEYS[1]  P..'inc'
-- ARGV[1]  P; ARGV[2] known incarnation token; ARGV[3] epoch of the grant;
-- ARGV[4]  agent; ARGV[5] lease id; ARGV[6] tokens; ARGV[7] window start;
-- ARGV[8]  remaining life (ms, from the send instant, I2); ARGV[9] ms until
--          the lease's window opens (0 for the current window); ARGV[10]
--          book ttl (ms); ARGV[11] the allocator's clock now (Unix ms:
--          the answer's own instant plus the time since it arrived);
--          ARGV[12] what the pool of the lease's window holds unleased
--          after this grant (the answer's pool.available)
--
-- Returns {'ok'} | {'dup'} | {'expired'} | {'stale', fence} | {'lost', token}
--
-- Why one script: the incarnation check, the epoch fence (I4: a stale
-- epoch's lease is never credited) and the idempotency check by lease id
-- (I5) must hold at the instant the balance appears.
local P = ARGV[1]
local inc = redis.call('GET', KEYS[1])
if inc ~= ARGV[2] or not same_server(P) then return {'lost', inc or ''} end
local epoch = tonumber(ARGV[3])
local fence = raise_fence(P, ARGV[4], epoch)
if epoch < fence then return {'stale', tostring(fence)} end
local t = redis.call('TIME')
local server_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('SET', P .. 'clk', string.format('%d', tonumber(ARGV[11]) - server_ms), 'PX', tonumber(ARGV[10]))
-- What the window's pool still holds, for reserves (spend.lua): the least
-- any answer said, in the same step as the balance it moved from the pool
-- (answers of two replicas may arrive out of order; a release that refills
-- the pool is seen at the next window).
local rk = P .. 'room:' .. ARGV[7]
local room = tonumber(redis.call('GET', rk) or ARGV[12])
if tonumber(ARGV[12]) < room then room = tonumber(ARGV[12]) end
redis.call('SET', rk, string.format('%d', room), 'PX', tonumber(ARGV[10]))
local id = ARGV[5]
local lk = P .. 'l:' .. id
if redis.call('EXISTS', lk) == 1 then return {'dup'} end
local tokens = tonumber(ARGV[6])
local life = tonumber(ARGV[8])
redis.call('HSET', lk, 'tokens', tokens, 'spent', 0, 'ws', ARGV[7], 'agent', ARGV[4], 'epoch', epoch)
redis.call('PEXPIRE', lk, tonumber(ARGV[10]))
if life <= 0 then
  -- Expired on arrival: never spendable, all of it goes back. Its book is
  -- kept as a finished one's (BOOK_KEEP_MS, prelude.lua), long enough to
  -- know a replay of the grant, not the counters' week.
  redis.call('HSET', lk, 'done', '1')
  redis.call('PEXPIRE', lk, BOOK_KEEP_MS)
  if tokens > 0 then
    redis.call('RPUSH', P .. 'ob:' .. ARGV[4], cjson.encode({k = 'rel', id = id, u = tokens}))
  end
  return {'expired'}
end
redis.call('SET', P .. 'live:' .. id, '1', 'PX', life)
local nb = tonumber(ARGV[9])
if nb > 0 then redis.call('SET', P .. 'nb:' .. id, '1', 'PX', nb) end
redis.call('ZADD', P .. 'idx', tonumber(ARGV[7]), id)
-- The index lives as long as the books in it (F04), even when no view runs
-- after this credit (an agent stopped right after it).
if redis.call('PTTL', P .. 'idx') < tonumber(ARGV[10]) then
  redis.call('PEXPIRE', P .. 'idx', tonumber(ARGV[10]))
end
redis.call('DEL', P .. 'exh')
return {'ok'}
