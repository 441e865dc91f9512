-- KEYS[1] lock key, KEYS[2] fence key (same hash tag)
-- ARGV[1] token, ARGV[2] ttl in ms
-- Returns {1, fence} when granted, {0, pttl} when held by another, {-1, type} on a foreign type.
local kind = redis.call('TYPE', KEYS[1]).ok
if kind ~= 'none' and kind ~= 'string' then
  return {-1, kind}
end
local fkind = redis.call('TYPE', KEYS[2]).ok
if fkind ~= 'none' and fkind ~= 'string' then
  return {-1, fkind}
end
local current = redis.call('GET', KEYS[1])
if current == ARGV[1] then
  -- A retry of an acquire whose reply was lost: the grant is already ours, keep its fence.
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return {1, tonumber(redis.call('GET', KEYS[2]) or '0')}
end
if current then
  return {0, redis.call('PTTL', KEYS[1])}
end
-- Wall-clock microseconds keep the fence rising even when the counter was lost (restart
-- without persistence, failover to a lagging replica), provided the clock does not step back.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local stored = tonumber(redis.call('GET', KEYS[2]) or '0') or 0
local fence = math.max(stored + 1, now)
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('SET', KEYS[2], string.format('%d', fence))
return {1, fence}
