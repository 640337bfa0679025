-- Count drawn groups as used (replay mode); remove those used max_reuse times.
-- ARGV: 1 consumer, 2 now, 3 dead-letter maxlen, 4 number of entries, then per entry:
--       id, good samples ('' = all), lag ('' = from stored version), retire (1 = remove now: it
--       held bad samples, dead-lettered here once), bad count, then per bad: reason, producer, raw
-- Only entries this consumer holds are counted: a repeated commit is a no-op.
-- A group's first use committed with 0 good samples trained nothing (LearnerClient.discard): its
-- admission goes back, as for a group dropped before any use (replay_draw.lua).
local params_key, counters_key, samples_key, index_key, n_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local uses_key, out_key, hist_key, dead_key, version_key = KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10]
local wake_key = KEYS[11]
local consumer, now, dead_maxlen, n_entries = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local max_reuse = tonumber(redis.call('HGET', params_key, 'max_reuse'))
local version = ctl(redis.call('GET', version_key), 0, version_key, '')
local pos, done, untrained = 5, 0, 0
for _ = 1, n_entries do
  local id, good, lag, retire, n_bad = ARGV[pos], ARGV[pos + 1], ARGV[pos + 2], ARGV[pos + 3], tonumber(ARGV[pos + 4])
  pos = pos + 5
  if redis.call('HGET', out_key, id) == consumer then
    redis.call('HDEL', out_key, id)
    local n = ctl(redis.call('HGET', n_key, id), 0, n_key, id)
    local uses = redis.call('HINCRBY', uses_key, id, 1)
    local n_good = num(good, n)
    local entry_lag = lag
    if entry_lag == '' then
      local score = redis.call('ZSCORE', index_key, id)
      entry_lag = version - math.floor(num(score, 0) / VSCALE)
    end
    incr(counters_key, C.samples_consumed, n_good)
    incr(counters_key, C.groups_consumed, 1)
    if n_good > 0 then incr(hist_key, entry_lag, n_good) elseif uses == 1 then untrained = untrained + 1 end
    sample_dead_letters(dead_key, counters_key, dead_maxlen, pos, n_bad, id, now)
    if uses >= max_reuse or retire == '1' then
      replay_remove(index_key, n_key, uses_key, samples_key, counters_key, id, n)
    end
    done = done + 1
  end
  pos = pos + 3 * n_bad
end
give_back_groups(params_key, counters_key, wake_key, untrained, 'budget')
return done
