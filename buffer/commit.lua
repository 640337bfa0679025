-- Ack groups the learner trained on (FIFO mode): count them consumed and delete them.
-- ARGV: 1 now, 2 dead-letter maxlen, 3 number of entries, then per entry:
--       id, good samples ('' = all), lag ('' = stored version - entry version), bad count,
--       then per bad sample: reason, producer, raw
-- Idempotent: an entry already acked (XACK returns 0) is skipped with its dead letters, so a
-- retried or repeated commit (commit_ids after a restart) never counts twice.
-- A group committed with 0 good samples was not trained (LearnerClient.discard: the learner dropped
-- every sample of its batch): its admission goes back, as drop.lua's does.
local samples_key, counters_key, hist_key, dead_key, version_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local params_key, wake_key = KEYS[6], KEYS[7]
local now, dead_maxlen, n_entries = ARGV[1], ARGV[2], tonumber(ARGV[3])
local version = ctl(redis.call('GET', version_key), 0, version_key, '')
local pos, done, untrained = 4, 0, 0
for _ = 1, n_entries do
  local id, good, lag, n_bad = ARGV[pos], ARGV[pos + 1], ARGV[pos + 2], tonumber(ARGV[pos + 3])
  pos = pos + 4
  local fields, n = take_entry(samples_key, counters_key, id)
  if fields then
    local n_good = num(good, n)
    local entry_lag = num(lag, version - field_int(field(fields, F_VERSION), version))
    incr(counters_key, C.samples_consumed, n_good)
    incr(counters_key, C.groups_consumed, 1)
    if n_good > 0 then incr(hist_key, entry_lag, n_good) else untrained = untrained + 1 end
    sample_dead_letters(dead_key, counters_key, dead_maxlen, pos, n_bad, id, now)
    done = done + 1
  end
  pos = pos + 3 * n_bad
end
give_back_groups(params_key, counters_key, wake_key, untrained, 'budget')
return done
