-- ARGV[3] id, ARGV[4] attempts, ARGV[5] lease ms, ARGV[6] holder ('' for none). Returns
-- {1, 'active', new deadline ms}.
local bad = check_keys()
if bad then return bad end
local id = ARGV[3]
local refused = guard(ARGV[1] .. id, tonumber(ARGV[4]), false, ARGV[6])
if refused then return refused end
local deadline = now_ms() + tonumber(ARGV[5])
redis.call('ZADD', KEYS[2], deadline, id)
return {1, 'active', deadline}
