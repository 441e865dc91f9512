#!lua flags=allow-cross-slot-keys,allow-oom
-- allow-oom: a script that declares flags is refused up front when the server is out of memory
-- unless it says it may run then; PEXPIRE needs no memory, and renewal must go on under OOM as
-- it does on a single server (whose scripts declare no flags).
-- Cluster renewal of many leases on the node this call is routed to, across its slots.
-- ARGV[1] ttl in ms, then pairs ARGV[i], ARGV[i+1] = lock key, token.
-- The keys travel as arguments: Redis checks that declared KEYS share one slot before the
-- flag is consulted. redis.call (not pcall) so that a key this node does not serve (a stale
-- slot map) or of a foreign type aborts the batch and the client renews slot by slot instead.
-- Returns 1/0 per lease: renewed, or not held (an expired key is never recreated).
local out = {}
for i = 2, #ARGV, 2 do
  if redis.call('GET', ARGV[i]) == ARGV[i + 1] then
    redis.call('PEXPIRE', ARGV[i], ARGV[1])
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
end
return out
