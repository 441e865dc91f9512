-- KEYS[1..n] lock keys; ARGV[1] ttl in ms, ARGV[1+i] token for KEYS[i].
-- Returns a list of 1/0: renewed, or not held (an expired key is never recreated).
local out = {}
for i, key in ipairs(KEYS) do
  if redis.pcall('GET', key) == ARGV[i + 1] then
    redis.call('PEXPIRE', key, ARGV[1])
    out[i] = 1
  else
    out[i] = 0
  end
end
return out
