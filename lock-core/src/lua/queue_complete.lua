-- ARGV[3] id, ARGV[4] attempts, ARGV[5] ms to keep the done marker (0 = delete at once),
-- ARGV[6] holder ('' for none).
local bad = check_keys()
if bad then return bad end
local id = ARGV[3]
local jk = ARGV[1] .. id
-- A repeated complete (its first reply was lost) finds the job done and succeeds again.
local refused = guard(jk, tonumber(ARGV[4]), true, ARGV[6])
if refused then return refused end
-- The job's key is written before the active set, so that a refused write (an ACL without
-- HDEL) leaves the job as it was.
local keep = tonumber(ARGV[5])
if keep > 0 then
  -- The job's hash becomes its done marker in place: deleted and written again, it would be a
  -- key this node no longer holds while its slot migrates, and the write would fail with the
  -- job already out of every set. The marker keeps attempts so a late caller is still told it
  -- is stale, not unknown, and the holder so that only this claim's repeat succeeds on it.
  redis.call('HDEL', jk, 'payload', 'error')
  redis.call('HSET', jk, 'state', 'done', 'attempts', ARGV[4])
  redis.call('PEXPIRE', jk, keep)
else
  redis.call('DEL', jk)
end
redis.call('ZREM', KEYS[2], id)
return {1, 'done'}
