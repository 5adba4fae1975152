-- fence.lua: raises the agent's epoch fence in one quota after it
-- registered a new epoch (I4); the leases of older epochs are then retired
-- by the next scan and their unspent tokens released.
--
-- KEYS[1]  P..'inc'
-- ARGV[1]  P; ARGV[2] agent; ARGV[3] new epoch
--
-- Returns the fence in force.
--
-- Why a script: read-compare-raise must not lower a fence another
-- incarnation raised meanwhile.
local fk = ARGV[1] .. 'fence:' .. ARGV[2]
local epoch = tonumber(ARGV[3])
local cur = tonumber(redis.call('GET', fk) or '0')
if epoch > cur then
  redis.call('SET', fk, epoch)
  return epoch
end
return cur
