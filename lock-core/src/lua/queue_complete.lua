-- ARGV[3] id, ARGV[4] attempts, ARGV[5] ms to keep the done marker (0 = delete at once),
-- ARGV[6] holder ('' for none).
local bad = check_keys()
if bad then return bad end
local id = ARGV[3]
local jk = ARGV[1] .. id
-- A repeated complete (its first reply was lost) finds the job done and succeeds again.
local refused = guard(jk, tonumber(ARGV[4]), true, ARGV[6])
if refused then return refused end
redis.call('ZREM', KEYS[2], id)
local kept = redis.call('HMGET', jk, 'max', 'holder')
redis.call('DEL', jk)
local keep = tonumber(ARGV[5])
if keep > 0 then
  -- The marker keeps attempts so a late caller is still told it is stale, not unknown, and
  -- the holder so that only this claim's repeat succeeds on it.
  redis.call('HSET', jk, 'state', 'done', 'attempts', ARGV[4], 'max', kept[1] or '0')
  if kept[2] then redis.call('HSET', jk, 'holder', kept[2]) end
  redis.call('PEXPIRE', jk, keep)
end
return {1, 'done'}
