-- ARGV[3] id, ARGV[4] attempts, ARGV[5] ms to keep the done marker (0 = delete at once).
local bad = check_keys()
if bad then return bad end
local id = ARGV[3]
local jk = ARGV[1] .. id
-- A repeated complete (its first reply was lost) finds the job done and succeeds again.
local refused = guard(jk, tonumber(ARGV[4]), true)
if refused then return refused end
redis.call('ZREM', KEYS[2], id)
local max = redis.call('HGET', jk, 'max') or '0'
redis.call('DEL', jk)
local keep = tonumber(ARGV[5])
if keep > 0 then
  -- The marker keeps attempts so a late caller is still told it is stale, not unknown.
  redis.call('HSET', jk, 'state', 'done', 'attempts', ARGV[4], 'max', max)
  redis.call('PEXPIRE', jk, keep)
end
return {1, 'done'}
