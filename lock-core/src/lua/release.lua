-- KEYS[1] lock key; ARGV[1] token, ARGV[2] wake-up channel.
-- Returns 1 when this token held the lock and it was deleted, 0 otherwise (nothing touched).
-- pcall: a key of another type is simply not ours, so it is left alone.
if redis.pcall('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.call('PUBLISH', ARGV[2], '1')
  return 1
end
return 0
