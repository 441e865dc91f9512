-- ARGV[3] max attempts (0 = no limit), ARGV[4..] payloads. Returns {1, id...}.
local bad = check_keys()
if bad then return bad end
-- Ids pass through Lua as doubles, exact only below 2^53: a counter past that (or not a
-- number at all, which INCR would refuse with an error that names no key) was set from
-- outside, and ids drawn from it could repeat within this call, one job overwriting another.
-- The bound leaves room for the search below (at most 2^42 ids on) and the call's payloads.
local seq = redis.call('GET', KEYS[5])
if seq and not ((seq == '0' or string.match(seq, '^[1-9]%d*$')) and #seq <= 16
    and tonumber(seq) < 2 ^ 53 - 2 ^ 43) then
  return {-1, KEYS[5], 'string that is not a job id counter (a decimal below 2^53 - 2^43)'}
end
local out = {1}
-- Every id is found before any job is written: a search that gives up (below) then leaves no
-- job of this call stored, so the caller's retry after the error stores none twice.
for i = 4, #ARGV do
  local id = redis.call('INCR', KEYS[5])
  -- A counter behind its jobs (reset by hand, evicted, rolled back by a failover) must never
  -- overwrite a job that still exists. The search leaps (1, 2, 4, ... ids on), so a counter a
  -- million jobs behind costs about twenty probes, not a million in one call with the server
  -- blocked, and the counter lands past more of the old jobs.
  local step = 1
  while redis.call('EXISTS', ARGV[1] .. s(id)) == 1 do
    if step > 2 ^ 40 then
      -- Only keys planted at every power-of-two distance get here; a job is never overwritten.
      return redis.error_reply('ERR the job id counter is behind its jobs; set it past the highest job id')
    end
    id = id + step
    step = step * 2
  end
  -- The next INCR starts past this id, so ids found in one call never repeat.
  if step > 1 then redis.call('SET', KEYS[5], s(id)) end
  out[#out + 1] = id
end
for i = 4, #ARGV do
  local id = out[i - 2]
  redis.call('HSET', ARGV[1] .. s(id), 'state', 'pending', 'attempts', 0, 'max', ARGV[3],
    'payload', ARGV[i])
  redis.call('ZADD', KEYS[1], id, s(id))
end
wake('enqueued')
return out
