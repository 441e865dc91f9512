-- Writes a quorum grant's fence back to one member, only while the member's lock key still
-- holds the grant's token: a write that lands after the lease moved on would let the fence key
-- claim a fence the new holder never read.
-- KEYS[1] lock key, KEYS[2] fence key; ARGV[1] token, ARGV[2] fence (canonical decimal string).
-- Sets the fence key to max(stored, ARGV[2]), never lowering it. Returns 1 when the token held
-- the key (written, or already at least as high), 0 otherwise (nothing touched).
-- A key of a foreign type answers 0; any other error (a GET the ACL user may not run) is passed
-- on as the server's error, so that the member reads as refusing, not as holding another lease.
local held = redis.pcall('GET', KEYS[1])
if type(held) == 'table' and held.err then
  if string.sub(held.err, 1, 9) ~= 'WRONGTYPE' then return held end
  return 0
end
if held ~= ARGV[1] then
  return 0
end
local stored = redis.pcall('GET', KEYS[2])
if type(stored) == 'table' and stored.err then
  if string.sub(stored.err, 1, 9) ~= 'WRONGTYPE' then return stored end
  -- A foreign type on the fence key: the acquire vote already refused it; write nothing.
  return 0
end
-- Decimal strings without leading zeros compare by length, then lexically: no float rounding.
-- Anything but a canonical decimal counts as no fence stored (the client read it so) and is
-- overwritten: kept, it would claim a fence this member never agreed to. A canonical decimal
-- above the fence, also one wider than 2^64 - 1 (which the client reads as exhausted), is kept.
local canonical = stored and string.match(stored, '^[1-9]%d*$')
local f = ARGV[2]
if not canonical or #stored < #f or (#stored == #f and stored < f) then
  redis.call('SET', KEYS[2], f)
end
return 1
