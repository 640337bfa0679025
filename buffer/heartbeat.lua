-- Renew a consumer's leases and record it for the monitor.
-- ARGV: 1 consumer, 2 consumer record (msgpack), 3.. lease ids it believes it holds
-- XCLAIM ... JUSTID with min-idle 0 resets the idle time without counting a delivery. Only
-- leases still owned by this consumer are renewed: one reclaimed by another worker (this one
-- was too slow) is not stolen back. Returns the ids no longer held, so the worker can stop them.
local prompts_key, consumers_key = KEYS[1], KEYS[2]
local consumer, record = ARGV[1], ARGV[2]
local lost = {}
for i = 3, #ARGV do
  local id = ARGV[i]
  local pe = redis.call('XPENDING', prompts_key, WORKERS, id, id, 1)
  if #pe == 1 and pe[1][2] == consumer then
    redis.call('XCLAIM', prompts_key, WORKERS, consumer, 0, id, 'JUSTID')
  else
    lost[#lost + 1] = id
  end
end
redis.call('HSET', consumers_key, consumer, record)
return lost
