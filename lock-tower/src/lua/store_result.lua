-- KEYS[1] the claim's lock key, KEYS[2] the result key (both under the claim's hash tag).
-- ARGV[1] the claim's token, ARGV[2] retention in ms, ARGV[3] request fingerprint,
-- ARGV[4] status, ARGV[5] headers ("name:value\n"...), ARGV[6] body, ARGV[7] body omitted (0/1).
-- Returns 1 when stored, 0 when the token no longer holds the claim (nothing written): a result
-- computed under a lapsed claim may race a second run, so it must not become the answer.
-- A claim key of a foreign type is not held; any other error (a GET the ACL user may not run)
-- is passed on as the server's error rather than read as a lapsed claim.
local held = redis.pcall('GET', KEYS[1])
if type(held) == 'table' and held.err then
  if string.sub(held.err, 1, 9) ~= 'WRONGTYPE' then return held end
  return 0
end
if held ~= ARGV[1] then
  return 0
end
redis.call('DEL', KEYS[2])
redis.call('HSET', KEYS[2], 'fp', ARGV[3], 'status', ARGV[4], 'headers', ARGV[5],
  'body', ARGV[6], 'omitted', ARGV[7])
redis.call('PEXPIRE', KEYS[2], ARGV[2])
return 1
