-- ARGV[3] most jobs to move in one call. Returns {1, taken, id, attempts, new state, ...}:
-- taken is how many expired ids left the active set (at most ARGV[3]; fewer means none are
-- left), then one triple for every active job whose deadline passed on the server clock; a job
-- whose key holds a foreign type is set aside in the dead set and listed as {id, 'foreign',
-- type} (a marker no attempts count can be, as -1 could: the field is writable from outside); an
-- id whose key was deleted from outside is dropped, unlisted, but counts in taken.
local bad = check_keys()
if bad then return bad end
local now = now_ms()
local expired = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', '(' .. s(now), 'LIMIT', 0,
  tonumber(ARGV[3]))
local out = {1, #expired}
local woke = false
for _, id in ipairs(expired) do
  local jk = ARGV[1] .. id
  -- Read first, as in a claim: a job key already moved by a slot migration fails the script
  -- before this job leaves the active set.
  local t = redis.call('TYPE', jk).ok
  redis.call('ZREM', KEYS[2], id)
  if t == 'hash' then
    local h = redis.call('HMGET', jk, 'attempts', 'max')
    local att = tonumber(h[1]) or 0
    local max = tonumber(h[2]) or 0
    -- attempts stay as they are: the next claim raises the fence.
    redis.call('HSET', jk, 'error', 'lease expired on attempt ' .. s(att))
    local to
    if max > 0 and att >= max then
      to = 'dead'
      redis.call('HSET', jk, 'state', 'dead')
      redis.call('ZADD', KEYS[4], now, id)
    else
      to = 'pending'
      woke = true
      redis.call('HSET', jk, 'state', 'pending')
      redis.call('ZADD', KEYS[1], id, id)
    end
    out[#out + 1] = id
    -- As stored, but a count a reply can carry (changed from outside, it may be below zero,
    -- NaN, or huge: tonumber reads "nan" and "1e30"): the claim that finds it so sets the
    -- job aside; the reply reports what this call did, not the corruption.
    local shown = 0
    if att == att and att > 0 then shown = math.floor(math.min(att, 9007199254740992)) end
    out[#out + 1] = shown
    out[#out + 1] = to
  elseif t ~= 'none' then
    set_aside(id, now)
    out[#out + 1] = id
    out[#out + 1] = 'foreign'
    out[#out + 1] = t
  end
end
if woke then
  wake('reaped')
end
return out
