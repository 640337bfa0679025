-- Renew a consumer's leases and record it for the monitor.
-- ARGV: 1 consumer, 2 consumer record (msgpack, less its last_seen), 3 '1' when the caller has
-- heartbeated this consumer before, 4.. lease ids it believes it holds
-- XCLAIM ... JUSTID with min-idle 0 resets the idle time without counting a delivery. Only
-- leases still owned by this consumer are renewed: one reclaimed by another worker (this one
-- was too slow) is not stolen back. The record gets last_seen from Redis's clock, the one every
-- sweep compares it with (the hosts' clocks may differ). Returns {retired, lost}: retired is 1,
-- and nothing is written, when a consumer that heartbeated before has no record (retire.lua
-- retired it while it was silent: its totals are in the run's retired sums); lost: the ids no
-- longer held, so the worker can stop them.
local prompts_key, consumers_key = KEYS[1], KEYS[2]
local consumer, record = ARGV[1], ARGV[2]
if ARGV[3] == '1' and redis.call('HEXISTS', consumers_key, consumer) == 0 then
  return {1, {}}
end
local lost = {}
for i = 4, #ARGV do
  local id = ARGV[i]
  local pe = redis.call('XPENDING', prompts_key, WORKERS, id, id, 1)
  if #pe == 1 and pe[1][2] == consumer then
    redis.call('XCLAIM', prompts_key, WORKERS, consumer, 0, id, 'JUSTID')
  else
    lost[#lost + 1] = id
  end
end
local now = redis.call('TIME')
redis.call('HSET', consumers_key, consumer, record .. cmsgpack.pack('last_seen', tonumber(now[1]) + tonumber(now[2]) / 1e6))
return {0, lost}
