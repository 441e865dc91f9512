-- KEYS[1] lock key; ARGV[1] token, ARGV[2] wake-up channel, ARGV[3] PUBLISH or SPUBLISH (cluster:
-- the channel shares the key's hash tag, so the sharded publish stays in the key's slot).
-- Returns 1 when this token held the lock and it was deleted, 0 otherwise (nothing touched).
-- pcall: a key of another type is simply not ours, so it is left alone.
local current = redis.pcall('GET', KEYS[1])
if type(current) == 'table' and current.err then
  -- Only WRONGTYPE means "not ours". Any other error (a GET the ACL user may not run) is passed
  -- on: read as "not held" it would tell the holder its lease was gone while the key stays.
  if string.sub(current.err, 1, 9) ~= 'WRONGTYPE' then return current end
  return 0
end
if current == ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.call(ARGV[3], ARGV[2], '1')
  return 1
end
return 0
