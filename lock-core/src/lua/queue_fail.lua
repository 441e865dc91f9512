-- ARGV[3] id, ARGV[4] attempts, ARGV[5] reason, ARGV[6] holder ('' for none).
local bad = check_keys()
if bad then return bad end
local id = ARGV[3]
local jk = ARGV[1] .. id
local refused = guard(jk, tonumber(ARGV[4]), false, ARGV[6])
if refused then return refused end
local now = now_ms()
redis.call('ZREM', KEYS[2], id)
redis.call('HSET', jk, 'state', 'dead', 'error', ARGV[5])
redis.call('ZADD', KEYS[4], now, id)
return {1, 'dead', now}
