-- credit.lua: credits one granted lease into the region's balance.
--
-- KEYS[1]  P..'inc'
-- ARGV[1]  P; ARGV[2] known incarnation token; ARGV[3] epoch of the grant;
-- ARGV[4]  agent; ARGV[5] lease id; ARGV[6] tokens; ARGV[7] window start;
-- ARGV[8]  remaining life (ms, from the send instant, I2); ARGV[9] ms until
--          the lease's window opens (0 for the current window); ARGV[10]
--          book ttl (ms)
--
-- Returns {'ok'} | {'dup'} | {'expired'} | {'stale', fence} | {'lost', token}
--
-- Why one script: the incarnation check, the epoch fence (I4: a stale
-- epoch's lease is never credited) and the idempotency check by lease id
-- (I5) must hold at the instant the balance appears.
local P = ARGV[1]
local inc = redis.call('GET', KEYS[1])
if inc ~= ARGV[2] then return {'lost', inc or ''} end
local epoch = tonumber(ARGV[3])
local fk = P .. 'fence:' .. ARGV[4]
local fence = tonumber(redis.call('GET', fk) or '0')
if epoch < fence then return {'stale', tostring(fence)} end
if epoch > fence then redis.call('SET', fk, epoch) end
local id = ARGV[5]
local lk = P .. 'l:' .. id
if redis.call('EXISTS', lk) == 1 then return {'dup'} end
local tokens = tonumber(ARGV[6])
local life = tonumber(ARGV[8])
redis.call('HSET', lk, 'tokens', tokens, 'spent', 0, 'ws', ARGV[7], 'agent', ARGV[4], 'epoch', epoch)
redis.call('PEXPIRE', lk, tonumber(ARGV[10]))
if life <= 0 then
  -- Expired on arrival: never spendable, all of it goes back.
  redis.call('HSET', lk, 'done', '1')
  if tokens > 0 then
    redis.call('RPUSH', P .. 'ob:' .. ARGV[4], cjson.encode({k = 'rel', id = id, u = tokens}))
  end
  return {'expired'}
end
redis.call('SET', P .. 'live:' .. id, '1', 'PX', life)
local nb = tonumber(ARGV[9])
if nb > 0 then redis.call('SET', P .. 'nb:' .. id, '1', 'PX', nb) end
redis.call('ZADD', P .. 'idx', tonumber(ARGV[7]), id)
redis.call('DEL', P .. 'exh')
return {'ok'}
