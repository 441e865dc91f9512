-- KEYS[1] lock key, KEYS[2] fence key (same hash tag)
-- ARGV[1] token, ARGV[2] ttl in ms
-- Returns {1, fence} when granted, {0, pttl} when held by another, {-1, type} on a foreign type.
-- GET fails on a non-string key; pcall turns that into a report instead of an aborted script,
-- and TYPE runs only on that rare path so the common path stays short.
local current = redis.pcall('GET', KEYS[1])
if type(current) == 'table' and current.err then
  return {-1, redis.call('TYPE', KEYS[1]).ok}
end
if current == ARGV[1] then
  -- A retry of an acquire whose reply was lost: the grant is already ours, keep its fence.
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return {1, tonumber(redis.call('GET', KEYS[2]) or '0')}
end
if current then
  return {0, redis.call('PTTL', KEYS[1])}
end
local stored = redis.pcall('GET', KEYS[2])
if type(stored) == 'table' and stored.err then
  return {-1, redis.call('TYPE', KEYS[2]).ok}
end
-- Wall-clock microseconds keep the fence rising even when the counter was lost (restart
-- without persistence, failover to a lagging replica), provided the clock does not step back.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local fence = math.max((tonumber(stored or '0') or 0) + 1, now)
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('SET', KEYS[2], string.format('%d', fence))
return {1, fence}
