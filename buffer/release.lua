-- Give leased prompts back un-done (a worker shutting down): re-delivered to the next claimer.
-- ARGV: 1 consumer, 2.. lease ids
-- The prompt moves to the pseudo-consumer RELEASED with its delivery count put back, so a
-- shutdown does not count towards max_deliveries; its budget reservation is returned and the
-- next claimer admits it again.
local prompts_key, counters_key, wake_key, params_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local consumer = ARGV[1]
local group_size = tonumber(redis.call('HGET', params_key, 'group_size'))
local n = 0
for i = 2, #ARGV do
  local id = ARGV[i]
  local pe = redis.call('XPENDING', prompts_key, WORKERS, id, id, 1)
  if #pe == 1 and pe[1][2] == consumer then
    local back = pe[1][4] - 1
    if back < 0 then back = 0 end
    redis.call('XCLAIM', prompts_key, WORKERS, RELEASED, 0, id, 'RETRYCOUNT', back, 'JUSTID')
    n = n + 1
  end
end
if n > 0 then
  incr(counters_key, C.inflight, -n * group_size)
  incr(counters_key, C.prompts_released, n)
  give_back(counters_key, wake_key, n * group_size, 'released')
end
return n
