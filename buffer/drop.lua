-- Drop groups the learner will not train on (FIFO mode): too stale, or nothing usable in them.
-- KEYS: 1 samples, 2 counters, 3 hist_dropped, 4 dead, 5 params, 6 wake_prompts
-- ARGV: 1 now, 2 dead-letter maxlen, 3 number of entries, then per entry:
--       id, why (stale|bad), lag, bad count, then per dead letter: kind, reason, producer, raw
-- The group's admission reservation is returned (pacing would stall otherwise) and claimers
-- are woken. Idempotent like commit.lua.
local G = tonumber(redis.call('HGET', KEYS[5], 'group_size'))
local pos, returned = 4, 0
for _ = 1, tonumber(ARGV[3]) do
  local id, why, lag, n_bad = ARGV[pos], ARGV[pos + 1], ARGV[pos + 2], tonumber(ARGV[pos + 3])
  pos = pos + 4
  if redis.call('XACK', KEYS[1], LEARNER, id) == 1 then
    local e = redis.call('XRANGE', KEYS[1], id, id)
    local n = 0
    if #e == 1 then n = num(field(e[1][2], F_COUNT), 0) end
    redis.call('XDEL', KEYS[1], id)
    incr(KEYS[2], C.samples_removed, n)
    incr(KEYS[2], C.groups_removed, 1)
    if why == 'stale' then
      incr(KEYS[2], C.samples_dropped_stale, n)
      incr(KEYS[2], C.groups_dropped_stale, 1)
      incr(KEYS[3], lag, n)
    end
    for i = 0, n_bad - 1 do
      local b = pos + 4 * i
      dead_letter(KEYS[4], KEYS[2], ARGV[2], ARGV[b], ARGV[b + 1], ARGV[b + 2], ARGV[b + 3], id, ARGV[1])
    end
    returned = returned + 1
  end
  pos = pos + 4 * n_bad
end
if returned > 0 and G then
  incr(KEYS[2], C.admitted, -returned * G)
  incr(KEYS[2], C.budget_returned, returned * G)
  wake(KEYS[6], 'budget')
end
return returned
