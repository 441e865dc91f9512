-- KEYS[1] gate key; ARGV[1] offered fence.
-- Returns {1, fence} when admitted (fence >= highest seen), {0, highest} when stale.
local kind = redis.call('TYPE', KEYS[1]).ok
if kind ~= 'none' and kind ~= 'string' then
  return {-1, kind}
end
local highest = tonumber(redis.call('GET', KEYS[1]) or '0') or 0
local offered = tonumber(ARGV[1])
if offered < highest then
  return {0, highest}
end
redis.call('SET', KEYS[1], ARGV[1])
return {1, offered}
