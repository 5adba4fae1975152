-- shadow.lua: counts one request a shadow-mode policy (`enforce: false`)
-- would have refused, in the window it was decided in, for the outbox to
-- report (cut.lua) like the window's admits.
--
-- KEYS[1]  P..'inc' (routes the call to the quota's slot; P is ARGV[1])
-- ARGV[1]  P, the quota prefix from keys.rs
-- ARGV[2]  window start (Unix s)
-- ARGV[3]  ttl of counters (ms)
--
-- Why a script: the counter and the dirty set that leads cut.lua to it
-- must change together, or a count could wait forever unreported.
local P, ws, ttl = ARGV[1], ARGV[2], tonumber(ARGV[3])
redis.call('INCR', P .. 'shr:' .. ws)
redis.call('PEXPIRE', P .. 'shr:' .. ws, ttl)
redis.call('SADD', P .. 'dirty', ws)
redis.call('PEXPIRE', P .. 'dirty', ttl)
return 1
