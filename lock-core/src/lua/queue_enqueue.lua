-- ARGV[3] max attempts (0 = no limit), ARGV[4..] payloads. Returns {1, id...}.
local bad = check_keys()
if bad then return bad end
local out = {1}
for i = 4, #ARGV do
  local id = redis.call('INCR', KEYS[5])
  -- A counter reset by hand must never overwrite a job that still exists.
  while redis.call('EXISTS', ARGV[1] .. s(id)) == 1 do
    id = redis.call('INCR', KEYS[5])
  end
  redis.call('HSET', ARGV[1] .. s(id), 'state', 'pending', 'attempts', 0, 'max', ARGV[3],
    'payload', ARGV[i])
  redis.call('ZADD', KEYS[1], id, s(id))
  out[#out + 1] = id
end
wake('enqueued')
return out
