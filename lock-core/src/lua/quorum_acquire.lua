-- One member's vote in a quorum acquire. Unlike acquire.lua it does not advance the fence: the
-- client reads every granting member's fence, picks the next one and writes it back with
-- quorum_fence.lua (see backend/quorum.rs for why that keeps fences increasing).
-- KEYS[1] lock key, KEYS[2] fence key (same hash tag); ARGV[1] token, ARGV[2] ttl in ms.
-- Returns {1, stored fence (decimal string), seconds, microseconds} when granted, also when this
-- token already holds the key (a retry); {0, pttl} when another holds it; {-1, type, i} when
-- KEYS[i] holds a foreign type (nothing written).
-- The fence travels as a string: Lua numbers are doubles and would round fences above 2^53.
local stored = redis.pcall('GET', KEYS[2])
if type(stored) == 'table' and stored.err then
  -- Only WRONGTYPE means a foreign type; any other refusal (OOM, MISCONF, NOPERM) is passed on
  -- as the server's error, not reported as a type the key does not hold.
  if string.sub(stored.err, 1, 9) ~= 'WRONGTYPE' then return stored end
  return {-1, redis.call('TYPE', KEYS[2]).ok, 2}
end
local current = redis.pcall('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2], 'GET')
if type(current) == 'table' and current.err then
  if string.sub(current.err, 1, 9) ~= 'WRONGTYPE' then return current end
  return {-1, redis.call('TYPE', KEYS[1]).ok, 1}
end
if current == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
elseif current then
  return {0, redis.call('PTTL', KEYS[1])}
end
local t = redis.call('TIME')
return {1, stored or '0', tonumber(t[1]), tonumber(t[2])}
