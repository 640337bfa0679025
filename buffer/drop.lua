-- Drop groups the learner will not train on (FIFO mode): too stale, or nothing usable in them.
-- ARGV: 1 now, 2 dead-letter maxlen, 3 number of entries, then per entry:
--       id, why (stale|bad), lag, bad count, then per dead letter: kind, reason, producer, raw
-- Each group's admission (group_size samples, a prompt's or a gateway group's: append.lua) is
-- returned (pacing would stall otherwise) and claimers are woken. Idempotent like commit.lua.
local samples_key, counters_key, hist_key, dead_key, params_key, wake_key =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local now, dead_maxlen, n_entries = ARGV[1], ARGV[2], tonumber(ARGV[3])
local pos, returned = 4, 0
for _ = 1, n_entries do
  local id, why, lag, n_bad = ARGV[pos], ARGV[pos + 1], ARGV[pos + 2], tonumber(ARGV[pos + 3])
  pos = pos + 4
  local fields, n = take_entry(samples_key, counters_key, id)
  if fields then
    if why == 'stale' then
      incr(counters_key, C.samples_dropped_stale, n)
      incr(counters_key, C.groups_dropped_stale, 1)
      incr(hist_key, lag, n)
    end
    for i = 0, n_bad - 1 do
      local b = pos + 4 * i
      dead_letter(dead_key, counters_key, dead_maxlen, ARGV[b], ARGV[b + 1], ARGV[b + 2], ARGV[b + 3], id, now)
    end
    returned = returned + 1
  end
  pos = pos + 4 * n_bad
end
give_back_groups(params_key, counters_key, wake_key, returned, 'budget')
return returned
