-- Grants many leases in one call: a busy Locker sends the acquires that queue while others are
-- in flight together (group commit), so the script's fixed cost is paid once for all of them.
-- KEYS[2i-1] lock key and KEYS[2i] fence key of item i (same hash tag); ARGV[3i-2] its token,
-- ARGV[3i-1] its ttl in ms, ARGV[3i] how long its fence key is kept in ms ('0': for ever; a
-- write without PX also clears the expiry an earlier grant's keep left).
-- Returns two values per item, flat (a table per item costs the server more than its
-- commands): 1, fence: granted (an integer, or a decimal string when it comes from a stored
-- fence ahead of the clock); 0, pttl: held by another; -1, type or -2, type: the item's
-- lock or fence key holds a foreign type (nothing written); -3, error: the server refused a
-- command (OOM, NOPERM, MISCONF...), its own error passed on; -4, stored fence: the stored
-- fence is 2^64 - 1 or more, no higher one exists (nothing written).
-- Each redis.call costs the server far more than the command itself, so a grant is two calls
-- beside one TIME for the whole batch, and the items run inline, not as a function called per
-- item: SET NX GET on the lock, SET GET on the fence.

-- A refused command: only WRONGTYPE means a foreign type (status -1 for the lock key, -2 for the
-- fence key); any other refusal is passed on as the server's error, not reported as a type the
-- key does not hold.
local function refusal(err, key, status)
  if string.sub(err, 1, 9) ~= 'WRONGTYPE' then return -3, err end
  -- pcall: a TYPE the ACL user may not run fails this item alone, not the grants already made
  -- in this call (an error here would leave them held by callers told they were refused).
  local t = redis.pcall('TYPE', key)
  if t.err then return -3, t.err end
  return status, t.ok
end

-- The fence key written by every path but the common one: with the item's keep, counted from
-- when the clock (`now`, microseconds) reaches `value`. A fence ahead of the clock forgotten
-- sooner would let the next grant take a lower one from the clock; one more than a year ahead
-- (set from outside, or a clock far behind) is kept for ever.
local function put_fence(key, value, keep, now)
  if keep == '0' then return redis.pcall('SET', key, value) end
  local ahead_ms = math.ceil((tonumber(value) - now) / 1000)
  if ahead_ms > 31536000000 then return redis.pcall('SET', key, value) end
  local px = tonumber(keep) + math.max(ahead_ms, 0)
  return redis.pcall('SET', key, value, 'PX', string.format('%.0f', px))
end

-- A canonical decimal string plus one, exactly: fences go to 2^64 - 1, and Lua numbers are
-- doubles, exact only up to 2^53 (a fence stored above that would otherwise stop rising).
local function plus_one(d)
  local i = #d
  while i > 0 and string.byte(d, i) == 57 do i = i - 1 end -- 57: '9'
  if i == 0 then return '1' .. string.rep('0', #d) end
  return string.sub(d, 1, i - 1) .. string.char(string.byte(d, i) + 1) .. string.rep('0', #d - i)
end

-- The largest fence (2^64 - 1): one stored at or above it cannot rise any more.
local MAX_FENCE = '18446744073709551615'
local function exhausted(d)
  return #d > #MAX_FENCE or (#d == #MAX_FENCE and d >= MAX_FENCE)
end
-- Above 2^64 - 1: a fence no client can read.
local function unreadable(d)
  return #d > #MAX_FENCE or (#d == #MAX_FENCE and d > MAX_FENCE)
end

local out = {}
-- Read before anything is written: a TIME the ACL user may not run refuses every item with
-- nothing changed.
local t = redis.pcall('TIME')
if t.err then
  for i = 1, #KEYS / 2 do out[2 * i - 1], out[2 * i] = -3, t.err end
  return out
end
-- Wall-clock microseconds keep the fence rising even when the counter was lost (restart
-- without persistence, failover to a lagging replica), provided the clock does not step back.
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
-- '%.0f', not '%d': the server's Lua formats '%d' through a C long, 32 bits on some builds
-- (ARMv7, 32-bit x86), where a clock in microseconds would wrap; a double's integer part is
-- exact to 2^53 on every build.
local now_text = string.format('%.0f', now)

for i = 1, #KEYS / 2 do
  local lock, fence_key = KEYS[2 * i - 1], KEYS[2 * i]
  local token, ttl, keep = ARGV[3 * i - 2], ARGV[3 * i - 1], ARGV[3 * i]
  local status, value
  -- SET NX GET (Redis 7+, Valkey): sets only when free and returns the value found either way.
  local current = redis.pcall('SET', lock, token, 'NX', 'PX', ttl, 'GET')
  if not current then
    local stored
    if keep == '0' then
      stored = redis.pcall('SET', fence_key, now_text, 'GET')
    else
      stored = redis.pcall('SET', fence_key, now_text, 'PX', keep, 'GET')
    end
    if type(stored) == 'table' then
      -- The lock key was free a moment ago and holds our token: taking it back leaves nothing
      -- written.
      redis.pcall('DEL', lock)
      status, value = refusal(stored.err, fence_key, -2)
    else
      status, value = 1, now
      -- Compared as decimal strings (length, then lexically), never as doubles; anything but
      -- a canonical decimal counts as no fence stored.
      if stored and (#stored > #now_text or (#stored == #now_text and stored >= now_text))
          and string.match(stored, '^[1-9]%d*$') then
        if exhausted(stored) then
          -- No higher fence exists: refuse, taking the lock back, rather than grant a fence no
          -- client can read (and leave the key held by a grant nobody has).
          -- Put back as it was found, without the keep's expiry: exhausted is for good.
          redis.pcall('SET', fence_key, stored)
          redis.pcall('DEL', lock)
          status, value = -4, stored
        else
          -- The stored fence is ahead of the clock (a clock stepped back, or grants within one
          -- microsecond): it still rises by one.
          value = plus_one(stored)
          local set = put_fence(fence_key, value, keep, now)
          if set.err then
            -- As every other refusal: nothing left written, the stored fence put back (the
            -- SET GET above left the clock's, lower) and the lock taken back. Not reached
            -- today (a script that has written is not refused), kept in line for when it is.
            redis.pcall('SET', fence_key, stored)
            redis.pcall('DEL', lock)
            status, value = -3, set.err
          end
        end
      end
    end
  elseif type(current) == 'table' then
    status, value = refusal(current.err, lock, -1)
  elseif current == token then
    -- A retry of an acquire whose reply was lost: the grant is already ours, keep its fence.
    local stored = redis.pcall('GET', fence_key)
    if type(stored) == 'table' then
      status, value = refusal(stored.err, fence_key, -2)
    elseif stored and string.match(stored, '^[1-9]%d*$') and unreadable(stored) then
      -- 2^64 - 1 itself is a fence this grant may have been given; only one set from outside,
      -- wider than that, cannot be handed back.
      redis.pcall('DEL', lock)
      status, value = -4, stored
    else
      local renewed = redis.pcall('PEXPIRE', lock, ttl)
      status, value = 1, stored
      if not (stored and string.match(stored, '^[1-9]%d*$')) then
        -- The fence key went (evicted, deleted) since the first grant, whose fence the caller
        -- never saw: a fence from the clock, as after a restart, never 0.
        status, value = 1, now
        local set = put_fence(fence_key, now_text, keep, now)
        if set.err then status, value = -3, set.err end
      end
      if type(renewed) == 'table' then status, value = -3, renewed.err end
    end
  else
    -- pcall: a PTTL the ACL user may not run fails this item alone, not the grants already
    -- made in this call.
    value = redis.pcall('PTTL', lock)
    status = 0
    if type(value) == 'table' then status, value = -3, value.err end
  end
  out[2 * i - 1], out[2 * i] = status, value
end
return out
