-- unlock.lua: releases the renew lock only if this agent still holds it.
--
-- KEYS[1]  the lock key (P..'lock')
-- ARGV[1]  the holder's token
--
-- Returns 1 when released, 0 when the lock had expired or changed hands.
--
-- Why a script: GET then DEL as two commands could delete a lock another
-- replica took after ours expired.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
