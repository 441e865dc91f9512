-- KEYS[1] lock key, KEYS[2] fence key (same hash tag)
-- ARGV[1] token, ARGV[2] ttl in ms
-- Returns {1, fence} when granted, {0, pttl} when held by another, {-1, type, i} when KEYS[i]
-- holds a foreign type (nothing written).
-- Each redis.call costs the server far more than the command itself, so the common path is
-- four calls: GET fence, SET NX GET, TIME, SET fence. pcall turns a foreign type into a report.
local stored = redis.pcall('GET', KEYS[2])
if type(stored) == 'table' and stored.err then
  -- Only WRONGTYPE means a foreign type; any other refusal (OOM, MISCONF, NOPERM) is passed on
  -- as the server's error, not reported as a type the key does not hold.
  if string.sub(stored.err, 1, 9) ~= 'WRONGTYPE' then return stored end
  return {-1, redis.call('TYPE', KEYS[2]).ok, 2}
end
-- SET NX GET (Redis 7+, Valkey): sets only when free and returns the value found either way.
local current = redis.pcall('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2], 'GET')
if type(current) == 'table' and current.err then
  if string.sub(current.err, 1, 9) ~= 'WRONGTYPE' then return current end
  return {-1, redis.call('TYPE', KEYS[1]).ok, 1}
end
if current == ARGV[1] then
  -- A retry of an acquire whose reply was lost: the grant is already ours, keep its fence.
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return {1, tonumber(stored or '0') or 0}
end
if current then
  return {0, redis.call('PTTL', KEYS[1])}
end
-- Wall-clock microseconds keep the fence rising even when the counter was lost (restart
-- without persistence, failover to a lagging replica), provided the clock does not step back.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local fence = math.max((tonumber(stored or '0') or 0) + 1, now)
redis.call('SET', KEYS[2], string.format('%d', fence))
return {1, fence}
