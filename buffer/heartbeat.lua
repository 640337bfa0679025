-- Renew a consumer's leases and record it for the monitor.
-- KEYS: 1 prompts, 2 consumers
-- ARGV: 1 consumer, 2 consumer record (msgpack), 3.. lease ids it believes it holds
-- XCLAIM ... JUSTID with min-idle 0 resets the idle time without counting a delivery. Only
-- leases still owned by this consumer are renewed: one reclaimed by another worker (this one
-- was too slow) is not stolen back. Returns the ids no longer held, so the worker can stop them.
local lost = {}
for i = 3, #ARGV do
  local id = ARGV[i]
  local pe = redis.call('XPENDING', KEYS[1], WORKERS, id, id, 1)
  if #pe == 1 and pe[1][2] == ARGV[1] then
    redis.call('XCLAIM', KEYS[1], WORKERS, ARGV[1], 0, id, 'JUSTID')
  else
    lost[#lost + 1] = id
  end
end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
return lost
