-- Releases many leases in one call (a busy Locker's releases are sent together, as acquires).
-- KEYS[i] lock key of item i; ARGV[1] PUBLISH or SPUBLISH (cluster: the channel shares the
-- key's hash tag, so the sharded publish stays in the key's slot); ARGV[2i] token of item i,
-- ARGV[2i+1] its wake-up channel.
-- Returns one reply per item: 1 when its token held the lock and it was deleted, 0 otherwise
-- (nothing touched), {-2, error} when the server refused the read (the server's own error).
local function release(lock, token, channel)
  local current = redis.pcall('GET', lock)
  if type(current) == 'table' then
    -- WRONGTYPE (a key of another type) is simply not ours, so it is left alone. Any other
    -- error (a GET the ACL user may not run) is passed on: read as "not held" it would tell
    -- the holder its lease was gone while the key stays.
    if string.sub(current.err, 1, 9) == 'WRONGTYPE' then return 0 end
    return {-2, current.err}
  end
  if current ~= token then return 0 end
  redis.call('DEL', lock)
  -- The lease is gone whatever PUBLISH answers; a refused wake-up leaves waiters to their
  -- timers, so it is not reported as a failed release.
  redis.pcall(ARGV[1], channel, '1')
  return 1
end

local out = {}
for i, lock in ipairs(KEYS) do
  local ok, reply = pcall(release, lock, ARGV[2 * i], ARGV[2 * i + 1])
  -- A refused DEL fails its item alone, not the releases already done in this call.
  out[i] = ok and reply or {-2, type(reply) == 'table' and reply.err or tostring(reply)}
end
return out
