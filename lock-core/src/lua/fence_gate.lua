-- KEYS[1] gate key; ARGV[1] offered fence (canonical decimal string).
-- Returns {1, fence} when admitted (fence >= highest seen), {0, highest} when stale, fences as
-- decimal strings: Lua numbers are doubles, exact only up to 2^53, and fences go to 2^64 - 1.
local kind = redis.call('TYPE', KEYS[1]).ok
if kind ~= 'none' and kind ~= 'string' then
  return {-1, kind}
end
local highest = redis.call('GET', KEYS[1])
-- Anything but a canonical decimal (absent, or written by something else) counts as none.
if not highest or not string.match(highest, '^[1-9]%d*$') then highest = '0' end
local offered = ARGV[1]
-- Decimal strings without leading zeros compare by length, then lexically.
if #offered < #highest or (#offered == #highest and offered < highest) then
  return {0, highest}
end
redis.call('SET', KEYS[1], offered)
return {1, offered}
