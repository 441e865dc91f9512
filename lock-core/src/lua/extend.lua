-- KEYS[1..n] lock keys; ARGV[1] ttl in ms, ARGV[1+i] token for KEYS[i].
-- Returns a list of 1/0: renewed, or not held (an expired key is never recreated). A key of a
-- foreign type is not held. Any other error (a GET the ACL user may not run) fails the whole
-- call with the server's error, so that the caller retries instead of reporting leases lost
-- that the server still holds; keys renewed before it stay renewed, which a retry repeats.
-- The held case is tested first: it is nearly every key, and costs no more than before.
local out = {}
for i, key in ipairs(KEYS) do
  local current = redis.pcall('GET', key)
  if current == ARGV[i + 1] then
    redis.call('PEXPIRE', key, ARGV[1])
    out[i] = 1
  elseif type(current) == 'table' and current.err
      and string.sub(current.err, 1, 9) ~= 'WRONGTYPE' then
    return current
  else
    out[i] = 0
  end
end
return out
