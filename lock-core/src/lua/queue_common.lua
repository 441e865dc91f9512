-- Shared head of every queue script (prepended at build time).
-- KEYS[1] pending (zset, score = job id: FIFO by enqueue order)
-- KEYS[2] active  (zset, score = lease deadline in server ms)
-- KEYS[3] delayed (zset, score = ready time in server ms)
-- KEYS[4] dead    (zset, score = time of death in server ms)
-- KEYS[5] seq     (string counter of job ids)
-- ARGV[1] job key prefix (`{prefix:queue}:job:`), ARGV[2] wake-up channel.
-- Job keys are built from ARGV[1]: they share the queue's hash tag, so they live in the same
-- cluster slot as the declared keys.
--
-- Replies: {1, ...} done; {0, ...} nothing to do; {-1, key, type} a queue key, or the job key
-- the caller named, holds a foreign type, found before any write; {-2} no such job;
-- {-3, attempts} stale caller; {-4, why} the caller's lease ended without a newer grant
-- (why: the job's state, reaped, retried or failed), or the job under this id and attempt was
-- claimed by another holder ('held by another claim': the server lost writes and reused the
-- id), or its attempt count was changed from outside to none a reply can carry ('attempts
-- corrupt'); {-5, attempts} the caller named an attempt above the job's latest, one never granted.
-- A job key of a foreign type met while claiming or reaping is no error: nobody asked for that
-- job by name, and refusing would stall every job behind it. Its id is set aside in the dead
-- set, the key itself never read or written, and the reply lists it.

local function foreign(key, want)
  local t = redis.call('TYPE', key).ok
  if t ~= 'none' and t ~= want then
    return {-1, key, t}
  end
  return nil
end

local function check_keys()
  for i = 1, 4 do
    local bad = foreign(KEYS[i], 'zset')
    if bad then return bad end
  end
  return foreign(KEYS[5], 'string')
end

-- Moves a job id whose key holds a foreign type to the dead set; the key is not ours to touch.
local function set_aside(id, now)
  redis.call('ZADD', KEYS[4], now, id)
end

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- Integers as Redis wants them in keys and members (Lua numbers are doubles). '%.0f', not
-- '%d', which goes through a C long (32 bits on some builds).
local function s(n)
  return string.format('%.0f', n)
end

-- nil when the caller, at attempt `want`, still holds the job's lease; otherwise the refusal.
-- A lease that passed its deadline but was not reaped yet still holds: nobody else has the job.
-- `holder` is the claim's own token ('' when the caller named the job by id and attempt only):
-- a server that lost its writes hands a job id out again, and that job's claims count their
-- attempts from 1 again, so only the token tells an old claim from the new one. A job claimed
-- without a holder field (by an older version) is not checked.
local function guard(jk, want, done_ok, holder)
  local t = redis.call('TYPE', jk).ok
  if t == 'none' then return {-2} end
  if t ~= 'hash' then return {-1, jk, t} end
  local h = redis.call('HMGET', jk, 'state', 'attempts', 'holder')
  local att = tonumber(h[2]) or 0
  -- Changed from outside to a count no reply can carry as a fence (below zero, not an
  -- integer, NaN, 2^53 or more), or to text the claim's HINCRBY would refuse though tonumber
  -- reads it ('1.0', '0x1', ' 1', '01'): no claim can hold the job by it, and the next claim
  -- that finds it sets it aside. Reported as not held (the caller's lease is over), not as a
  -- count the client would fail to read and take for a server fault.
  local canonical = h[2] and (h[2] == '0' or string.match(h[2], '^[1-9]%d*$'))
  if h[2] and not (canonical and att < 9007199254740992) then
    return {-4, 'attempts corrupt'}
  end
  -- Higher than the latest attempt: nothing superseded it, so it is not stale.
  if want > att then return {-5, att} end
  if att ~= want then return {-3, att} end
  if holder ~= '' and h[3] and h[3] ~= holder then return {-4, 'held by another claim'} end
  if done_ok and h[1] == 'done' then return {1, 'done'} end
  if h[1] ~= 'active' then return {-4, h[1] or ''} end
  return nil
end

-- Wakes waiting claimers, after the step's writes: pcall, since a refused wake-up (an ACL user
-- without PUBLISH) must not report as failed a step whose writes stand; an enqueue reported as
-- refused would be sent again and its jobs stored twice. Claimers then find the job by their
-- timer.
local function wake(what)
  redis.pcall(PUBLISH, ARGV[2], what)
end
