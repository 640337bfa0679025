-- Append a group that no prompt lease produced (rlhf-gateway's episodes), FIFO mode only.
-- KEYS: samples stream, counters, dead-letter stream, the hash of kept records the group is made of
--       (rlhf-gateway's rewarded sessions), the run's params.
-- ARGV: 1 producer, 2 now, 3 dead-letter maxlen, 4 oldest token version of the group, 5 group id,
--       6 prompt id, 7 good samples, 8 bad records, 9 kept fields, 10 filter reason ('' for none),
--       11 samples filtered, 12.. the good samples' bytes, then per bad record: kind, reason, raw
--       bytes, then the kept records' fields (in the hash of kept records)
-- A group filtered by algo.filter_groups comes with no samples and its reason: counted in
-- groups_filtered_<reason> as a worker's filtered group is, its kept records deleted.
-- An appended group counts as admitted (group_size samples, as a prompt's): the learner reads
-- batches of whole groups and pacing counts batch_size samples per update it trained, so a gateway
-- group takes a prompt's place (without this each one trained would let the run's own prompts a
-- group further ahead of the learner). A drop gives it back as it does any group's (drop.lua).
-- The kept records are deleted with the append, and a group whose kept records are not all there
-- any more is not appended (nil): it was appended already (a retried call whose reply was lost,
-- another gateway of the run), so a group is appended at most once.
local samples_key, counters_key, dead_key, kept_key, params_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local producer, now, dead_maxlen, oldest_version = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local group_id, prompt_id, n_good, n_bad = ARGV[5], ARGV[6], tonumber(ARGV[7]), tonumber(ARGV[8])
local n_kept, filter_reason, n_filtered = tonumber(ARGV[9]), ARGV[10], tonumber(ARGV[11])
local first_good, first_bad = 12, 12 + n_good
local first_kept = first_bad + 3 * n_bad
for i = 0, n_kept - 1 do
  if redis.call('HEXISTS', kept_key, ARGV[first_kept + i]) == 0 then
    return false
  end
end
local id = ''
if n_good > 0 then
  id = append_entry(samples_key, counters_key, group_id, prompt_id, oldest_version, n_good, producer, now, first_good)
  incr(counters_key, C.groups_external, 1)
  incr(counters_key, C.admitted, tonumber(redis.call('HGET', params_key, 'group_size')))
elseif filter_reason ~= '' then
  count_filtered(counters_key, filter_reason, n_filtered)
end
for i = 0, n_bad - 1 do
  local b = first_bad + 3 * i
  dead_letter(dead_key, counters_key, dead_maxlen, ARGV[b], ARGV[b + 1], producer, ARGV[b + 2], '', now)
end
for i = 0, n_kept - 1 do
  redis.call('HDEL', kept_key, ARGV[first_kept + i])
end
return id
