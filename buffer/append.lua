-- Append a group that no prompt lease produced (rlhf-gateway's episodes), FIFO mode only.
-- KEYS: samples stream, counters, dead-letter stream.
-- ARGV: 1 producer, 2 now, 3 dead-letter maxlen, 4 oldest token version of the group, 5 group id,
--       6 prompt id, 7 good samples, 8 bad records, 9.. the good samples' bytes, then per bad
--       record: kind, reason, raw bytes
-- The entry is marked F_EXTERNAL: pacing never admitted it, so a stale drop returns no budget.
local samples_key, counters_key, dead_key = KEYS[1], KEYS[2], KEYS[3]
local producer, now, dead_maxlen, oldest_version = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local group_id, prompt_id, n_good, n_bad = ARGV[5], ARGV[6], tonumber(ARGV[7]), tonumber(ARGV[8])
local first_good, first_bad = 9, 9 + n_good
local id = ''
if n_good > 0 then
  id = append_entry(samples_key, counters_key, group_id, prompt_id, oldest_version, n_good, producer, now, first_good, true)
  incr(counters_key, C.groups_external, 1)
end
for i = 0, n_bad - 1 do
  local b = first_bad + 3 * i
  dead_letter(dead_key, counters_key, dead_maxlen, ARGV[b], ARGV[b + 1], producer, ARGV[b + 2], '', now)
end
return id
