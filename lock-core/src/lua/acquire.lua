-- Grants many leases in one call: a busy Locker sends the acquires that queue behind one in
-- flight together (group commit), so the script's fixed cost is paid once for all of them.
-- KEYS[2i-1] lock key and KEYS[2i] fence key of item i (same hash tag); ARGV[2i-1] its token,
-- ARGV[2i] its ttl in ms.
-- Returns one reply per item: {1, fence} granted; {0, pttl} held by another; {-1, type, k} when
-- the item's KEYS k (1 lock, 2 fence) holds a foreign type (nothing written); {-2, error} when
-- the server refused a command (OOM, NOPERM, MISCONF...): the server's own error, passed on.
-- Each redis.call costs the server far more than the command itself, so a grant is two calls
-- beside one TIME for the whole batch: SET NX GET on the lock, SET GET on the fence.

local function refusal(err, key, k)
  -- Only WRONGTYPE means a foreign type; any other refusal is passed on as the server's error,
  -- not reported as a type the key does not hold.
  if string.sub(err, 1, 9) ~= 'WRONGTYPE' then return {-2, err} end
  return {-1, redis.call('TYPE', key).ok, k}
end

-- Read first, before anything is written: a TIME the ACL user may not run refuses every item
-- with nothing changed.
local t = redis.pcall('TIME')
if t.err then
  local out = {}
  for i = 1, #KEYS / 2 do out[i] = {-2, t.err} end
  return out
end
-- Wall-clock microseconds keep the fence rising even when the counter was lost (restart
-- without persistence, failover to a lagging replica), provided the clock does not step back.
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local now_text = string.format('%d', now)

local function acquire(lock, fence_key, token, ttl)
  -- SET NX GET (Redis 7+, Valkey): sets only when free and returns the value found either way.
  local current = redis.pcall('SET', lock, token, 'NX', 'PX', ttl, 'GET')
  if type(current) == 'table' then return refusal(current.err, lock, 1) end
  if current == token then
    -- A retry of an acquire whose reply was lost: the grant is already ours, keep its fence.
    local stored = redis.pcall('GET', fence_key)
    if type(stored) == 'table' then return refusal(stored.err, fence_key, 2) end
    redis.call('PEXPIRE', lock, ttl)
    return {1, tonumber(stored or '0') or 0}
  end
  if current then return {0, redis.call('PTTL', lock)} end
  local stored = redis.pcall('SET', fence_key, now_text, 'GET')
  if type(stored) == 'table' then
    -- The lock key was free a moment ago and holds our token: taking it back leaves nothing
    -- written.
    redis.call('DEL', lock)
    return refusal(stored.err, fence_key, 2)
  end
  local before = tonumber(stored or '0') or 0
  if before < now then return {1, now} end
  -- The stored fence is ahead of the clock (a clock stepped back, or grants within one
  -- microsecond): it still rises by one.
  redis.call('SET', fence_key, string.format('%d', before + 1))
  return {1, before + 1}
end

local out = {}
for i = 1, #KEYS / 2 do
  local ok, reply = pcall(acquire, KEYS[2 * i - 1], KEYS[2 * i], ARGV[2 * i - 1], ARGV[2 * i])
  -- A command refused by redis.call (a PTTL the ACL user may not run) fails its item alone:
  -- raised, it would fail the whole call and hide the grants already made in it.
  out[i] = ok and reply or {-2, type(reply) == 'table' and reply.err or tostring(reply)}
end
return out
