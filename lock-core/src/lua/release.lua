-- Releases many leases in one call (a busy Locker's releases are sent together, as acquires).
-- KEYS[i] lock key of item i; ARGV[1] PUBLISH or SPUBLISH (cluster: the channel shares the
-- key's hash tag, so the sharded publish stays in the key's slot); ARGV[2i] token of item i,
-- ARGV[2i+1] its wake-up channel.
-- Returns one value per item: 1 when its token held the lock and it was deleted, 0 otherwise
-- (nothing touched), or the server's error as text when it refused a command for that item.
local out = {}
for i, lock in ipairs(KEYS) do
  local current = redis.pcall('GET', lock)
  if current == ARGV[2 * i] then
    local deleted = redis.pcall('DEL', lock)
    if type(deleted) == 'table' then
      out[i] = deleted.err
    else
      -- The lease is gone whatever PUBLISH answers; a refused wake-up leaves waiters to their
      -- timers, so it is not reported as a failed release.
      redis.pcall(ARGV[1], ARGV[2 * i + 1], '1')
      out[i] = 1
    end
  elseif type(current) == 'table' and string.sub(current.err, 1, 9) ~= 'WRONGTYPE' then
    -- WRONGTYPE (a key of another type) is simply not ours, so it is left alone. Any other
    -- error (a GET the ACL user may not run) is passed on: read as "not held" it would tell
    -- the holder its lease was gone while the key stays.
    out[i] = current.err
  else
    out[i] = 0
  end
end
return out
