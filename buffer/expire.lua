-- Expire a consumer's leases now: the launcher saw its process or its node die, so nothing will
-- heartbeat them, and the next claimer takes each over (claim.lua, step 2) at once instead of
-- after buffer.lease_timeout_s. Each prompt the consumer still holds is made idle for the lease
-- timeout without being moved: its reclaim counts a delivery, as after a timeout
-- (buffer.max_deliveries still dead-letters a prompt that keeps killing workers), and it stays
-- admitted and in flight (no budget moves). A completion from the consumer that arrives anyway
-- is safe: the first completion of a prompt lands, any other is a duplicate (complete.lua).
-- ARGV: 1 consumer, 2 the run's lease timeout in ms. Returns how many leases were expired.
local prompts_key, wake_key = KEYS[1], KEYS[2]
local consumer, lease_ms = ARGV[1], ARGV[2]
local n, after = 0, '-'
while true do
  local held = redis.call('XPENDING', prompts_key, WORKERS, after, '+', 256, consumer)
  for _, e in ipairs(held) do
    redis.call('XCLAIM', prompts_key, WORKERS, consumer, 0, e[1], 'IDLE', lease_ms, 'JUSTID')
  end
  n = n + #held
  if #held < 256 then break end
  after = '(' .. held[#held][1]
end
if n > 0 then wake(wake_key, 'expired') end
return n
