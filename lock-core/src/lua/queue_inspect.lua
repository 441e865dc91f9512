-- ARGV[3] job id, or '' for the counts.
-- Counts: {1, pending, active, delayed, dead}.
-- One job: {1, state, attempts, max, error, payload, time ms} where time is the lease deadline
-- (active), the ready time (delayed) or the time of death (dead); false where absent.
local bad = check_keys()
if bad then return bad end
if ARGV[3] == '' then
  return {1, redis.call('ZCARD', KEYS[1]), redis.call('ZCARD', KEYS[2]),
    redis.call('ZCARD', KEYS[3]), redis.call('ZCARD', KEYS[4])}
end
local jk = ARGV[1] .. ARGV[3]
local t = redis.call('TYPE', jk).ok
if t == 'none' then return {-2} end
if t ~= 'hash' then return {-1, jk, t} end
local h = redis.call('HMGET', jk, 'state', 'attempts', 'max', 'error', 'payload')
local at = false
if h[1] == 'active' then
  at = redis.call('ZSCORE', KEYS[2], ARGV[3])
elseif h[1] == 'delayed' then
  at = redis.call('ZSCORE', KEYS[3], ARGV[3])
elseif h[1] == 'dead' then
  at = redis.call('ZSCORE', KEYS[4], ARGV[3])
end
return {1, h[1] or '', tonumber(h[2]) or 0, tonumber(h[3]) or 0, h[4] or false, h[5] or false,
  at and tonumber(at) or false}
