-- KEYS[1] gate key; ARGV[1] offered fence (canonical decimal string).
-- Returns {1, fence} when admitted (fence >= highest seen), {0, highest} when stale, fences as
-- decimal strings: Lua numbers are doubles, exact only up to 2^53, and fences go to 2^64 - 1.
-- {-1, what} when the key holds something that is not a gate: another type, or a string that
-- is not a fence (this script writes only canonical decimals up to 2^64 - 1). Nothing is
-- written then: a gate that cannot read its highest fence must refuse, not admit every writer
-- and overwrite what it found.
local kind = redis.call('TYPE', KEYS[1]).ok
if kind ~= 'none' and kind ~= 'string' then
  return {-1, kind}
end
local highest = redis.call('GET', KEYS[1])
if not highest then
  highest = '0'
elseif not (highest == '0' or string.match(highest, '^[1-9]%d*$'))
    or #highest > 20 or (#highest == 20 and highest > '18446744073709551615') then
  return {-1, 'string that is not a fence'}
end
local offered = ARGV[1]
-- Decimal strings without leading zeros compare by length, then lexically.
if #offered < #highest or (#offered == #highest and offered < highest) then
  return {0, highest}
end
redis.call('SET', KEYS[1], offered)
return {1, offered}
