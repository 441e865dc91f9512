-- ARGV[3] id, ARGV[4] attempts, ARGV[5] delay ms, ARGV[6] error ('' for none), ARGV[7] holder
-- ('' for none).
local bad = check_keys()
if bad then return bad end
local id = ARGV[3]
local jk = ARGV[1] .. id
local refused = guard(jk, tonumber(ARGV[4]), false, ARGV[7])
if refused then return refused end
local now = now_ms()
redis.call('ZREM', KEYS[2], id)
if ARGV[6] ~= '' then
  redis.call('HSET', jk, 'error', ARGV[6])
end
local max = tonumber(redis.call('HGET', jk, 'max')) or 0
if max > 0 and tonumber(ARGV[4]) >= max then
  redis.call('HSET', jk, 'state', 'dead')
  redis.call('ZADD', KEYS[4], now, id)
  return {1, 'dead'}
end
local delay = tonumber(ARGV[5])
if delay > 0 then
  redis.call('HSET', jk, 'state', 'delayed')
  redis.call('ZADD', KEYS[3], now + delay, id)
  -- Waiting claimers sleep until the next delayed job they saw is due: this one may be due
  -- sooner.
  wake('delayed')
  return {1, 'delayed', now + delay}
end
redis.call('HSET', jk, 'state', 'pending')
redis.call('ZADD', KEYS[1], id, id)
wake('retried')
return {1, 'pending'}
