-- ARGV[3] most jobs to remove in one call, ARGV[4] an age in ms. Removes the dead jobs that
-- died at least that long ago on the server clock, their job hashes with them. Returns
-- {1, how many left the dead set}. An id whose key is not a dead job's hash (a foreign type a
-- claim or reap set aside) leaves the dead set with its key untouched: the key is not ours.
local bad = check_keys()
if bad then return bad end
local cutoff = now_ms() - tonumber(ARGV[4])
local ids = redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', s(cutoff), 'LIMIT', 0,
  tonumber(ARGV[3]))
for _, id in ipairs(ids) do
  local jk = ARGV[1] .. id
  -- Read first, as in a reap: a job key already moved by a slot migration fails the script
  -- before this job leaves the dead set.
  local t = redis.call('TYPE', jk).ok
  if t == 'hash' and redis.call('HGET', jk, 'state') == 'dead' then
    redis.call('DEL', jk)
  end
  redis.call('ZREM', KEYS[4], id)
end
return {1, #ids}
