-- KEYS[1] lock key; ARGV[1] token, ARGV[2] wake-up channel, ARGV[3] PUBLISH or SPUBLISH (cluster:
-- the channel shares the key's hash tag, so the sharded publish stays in the key's slot).
-- Returns 1 when this token held the lock and it was deleted, 0 otherwise (nothing touched).
-- pcall: a key of another type is simply not ours, so it is left alone.
if redis.pcall('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.call(ARGV[3], ARGV[2], '1')
  return 1
end
return 0
