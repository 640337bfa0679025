-- Give leased prompts back un-done (a worker shutting down): re-delivered to the next claimer.
-- KEYS: 1 prompts, 2 counters, 3 wake_prompts, 4 params
-- ARGV: 1 consumer, 2.. lease ids
-- The prompt moves to the pseudo-consumer RELEASED with its delivery count put back, so a
-- shutdown does not count towards max_deliveries; its budget reservation is returned and the
-- next claimer admits it again.
local G = tonumber(redis.call('HGET', KEYS[4], 'group_size'))
local n = 0
for i = 2, #ARGV do
  local id = ARGV[i]
  local pe = redis.call('XPENDING', KEYS[1], WORKERS, id, id, 1)
  if #pe == 1 and pe[1][2] == ARGV[1] then
    local back = pe[1][4] - 1
    if back < 0 then back = 0 end
    redis.call('XCLAIM', KEYS[1], WORKERS, RELEASED, 0, id, 'RETRYCOUNT', back, 'JUSTID')
    n = n + 1
  end
end
if n > 0 then
  incr(KEYS[2], C.admitted, -n * G)
  incr(KEYS[2], C.inflight, -n * G)
  incr(KEYS[2], C.budget_returned, n * G)
  incr(KEYS[2], C.prompts_released, n)
  wake(KEYS[3], 'released')
end
return n
