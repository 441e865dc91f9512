-- ARGV[3] lease ms, ARGV[4] the claim's token (its holder). Returns {1, id, attempts, deadline ms, payload, aside...}, {0, ms until
-- the next delayed job is due or -1, aside...}, or {2, aside...} when pending still holds jobs
-- after 100 ids taken off it (deleted or set aside), or due retries are left after 100 promoted
-- ones that came to nothing, where aside is {job key, what was found} for
-- every job this claim set aside in the dead set: a job key of a foreign type, or a job hash
-- whose attempts field is corrupt or whose payload is missing.
local bad = check_keys()
if bad then return bad end
local now = now_ms()
local aside = {}
-- HINCRBY's own refusals of the field's value, as Redis and Valkey word them.
local function corrupt(err)
  return string.find(err, 'not an integer', 1, true) or string.find(err, 'overflow', 1, true)
end
local function reply(out)
  for _, v in ipairs(aside) do
    out[#out + 1] = v
  end
  return out
end
-- Sets job `id` aside in the dead set and lists it for the reply, with what was found there.
local function put_aside(id, jk, found)
  set_aside(id, now)
  aside[#aside + 1] = jk
  aside[#aside + 1] = found
end
-- Delayed retries that are due join pending at their original place (their id).
-- At most 100 a claim, the earliest due first (the memory queue's PROMOTE_PER_CLAIM): a claim's
-- script must stay short.
local due = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now, 'LIMIT', 0, 100)
for _, id in ipairs(due) do
  local jk = ARGV[1] .. id
  -- Read before the job is moved: on a cluster whose slot is migrating, a job key already
  -- moved fails the script here, and the job must still be in a set when it does.
  local t = redis.call('TYPE', jk).ok
  redis.call('ZREM', KEYS[3], id)
  if t == 'hash' then
    redis.call('ZADD', KEYS[1], id, id)
    redis.call('HSET', jk, 'state', 'pending')
  elseif t ~= 'none' then
    put_aside(id, jk, t)
  end
end
-- At most 100 ids a claim, for the same reason; a claim that set aside all 100 answers {2,
-- aside...} and the client asks again, rather than report an empty queue with jobs pending.
local taken = 0
for _ = 1, 100 do
  local id = redis.call('ZRANGE', KEYS[1], 0, 0)[1]
  if not id then break end
  taken = taken + 1
  local jk = ARGV[1] .. id
  local t = redis.call('TYPE', jk).ok
  -- Every job is written with its payload, empty or not: a hash without one was changed from
  -- outside, and handed out it would run on an empty payload and be completed with its data
  -- gone. It dies with the reason instead, as a corrupt attempts field does.
  local payload = t == 'hash' and redis.call('HGET', jk, 'payload')
  if t == 'hash' and not payload then
    redis.call('ZREM', KEYS[1], id)
    redis.call('HSET', jk, 'state', 'dead', 'error', 'payload missing')
    put_aside(id, jk, 'hash without a payload')
  elseif t == 'hash' then
    -- The fence first: if the field is corrupt this fails before the job is changed.
    local att = redis.pcall('HINCRBY', jk, 'attempts', 1)
    if type(att) == 'table' and not corrupt(att.err) then
      -- The server's refusal (OOM, NOPERM...), not the job's fault: the claim fails, the job
      -- stays pending.
      return redis.error_reply(att.err)
    end
    local why = type(att) == 'table' and att.err or nil
    if not why and att < 1 then
      -- An integer, but below one after the increment: no fence a client can read. Put back
      -- as it was found.
      redis.call('HINCRBY', jk, 'attempts', -1)
      why = 'below zero'
    elseif not why and att >= 9007199254740992 then
      -- 2^53 or more: the reply reached Lua as a double, rounded, so two claims could be handed
      -- one fence (and the settle checks compare doubles too). Put back as it was found.
      redis.call('HINCRBY', jk, 'attempts', -1)
      why = 'above 2^53 - 1'
    end
    redis.call('ZREM', KEYS[1], id)
    if why then
      -- An attempts field written from outside (not an integer, at its limit, above 2^53 - 1
      -- or below zero)
      -- gives no fence to hand out, and a claim refused for it would stall every job behind
      -- it: the job dies with the reason, the field kept as it was found.
      redis.call('HSET', jk, 'state', 'dead', 'error', 'corrupt attempts field: ' .. why)
      put_aside(id, jk, 'hash with a corrupt attempts field')
    else
      redis.call('HSET', jk, 'state', 'active', 'holder', ARGV[4])
      -- The deadline is the server's clock plus the lease, never the worker's clock.
      local deadline = now + tonumber(ARGV[3])
      redis.call('ZADD', KEYS[2], deadline, id)
      return reply({1, id, att, deadline, payload})
    end
  elseif t == 'none' then
    -- An id whose job was deleted from outside: nothing to run, drop it.
    redis.call('ZREM', KEYS[1], id)
  else
    redis.call('ZREM', KEYS[1], id)
    put_aside(id, jk, t)
  end
end
if taken == 100 and redis.call('EXISTS', KEYS[1]) == 1 then
  return reply({2})
end
local nxt = redis.call('ZRANGE', KEYS[3], 0, 0, 'WITHSCORES')
-- The same for due retries: a promotion round of 100 that left nothing to claim (their jobs
-- deleted or set aside) with more due behind it asks again too.
if #due == 100 and nxt[2] and tonumber(nxt[2]) <= now then
  return reply({2})
end
if nxt[2] then
  return reply({0, math.max(0, tonumber(nxt[2]) - now)})
end
return reply({0, -1})
