-- Append a prompt's group of samples and ack the prompt, in one atomic step.
-- KEYS (scripts.complete_keys): the first five always, the replay ones in replay mode only.
-- ARGV: 1 lease id, 2 consumer, 3 now, 4 dead-letter maxlen, 5 mode (fifo|replay), 6 group_size,
--       7 oldest token version of the group, 8 group id, 9 prompt id, 10 filter reason ('' for none),
--       11 samples filtered, 12 good samples, 13 bad records,
--       14.. the good samples' bytes, then per bad record: kind (sample|prompt), reason, raw bytes
-- (an undecodable prompt is completed with no samples and itself as the bad record; a group the
-- worker filtered (algo.filter_groups) is completed with no samples and its reason, counted in
-- groups_filtered_<reason>, and gives its budget back like an empty one)
-- Idempotent: a prompt no longer pending was already completed (a retry after a lost reply, or
-- a slow worker finishing a prompt that was re-delivered and completed elsewhere); then nothing
-- is written and the call returns {0}. Exactly one group per prompt lands.
-- The first completion wins, whoever holds the lease now. A prompt held by RELEASED (its lease
-- expired, the next claimer took it and released it, release.lua gave its reservation back) is
-- completed too: the samples are good and acking it here means nobody generates it again; it
-- takes its reservation back (admitted again, as claim.lua would, and no longer in flight).
-- The arguments are few and the entry's field names come from the preamble: this is the hot
-- path of every worker, and argument count is most of its client-side cost.
local prompts_key, samples_key, counters_key, dead_key, wake_prompts_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local params_key, index_key, n_key, uses_key, out_key, wake_replay_key = KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10], KEYS[11]
local lease_id, consumer, now, dead_maxlen, mode = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local group_size, oldest_version, group_id, prompt_id = tonumber(ARGV[6]), ARGV[7], ARGV[8], ARGV[9]
local filter_reason, n_filtered = ARGV[10], tonumber(ARGV[11])
local n_good, n_bad = tonumber(ARGV[12]), tonumber(ARGV[13])
local first_good, first_bad = 14, 14 + n_good

-- the stalest entries (lowest score) beyond capacity leave the table, unless a learner holds them now;
-- returns how many were never used (their admission goes back: they will never be trained; a
-- used one was trained on, and a trained group's admission is never returned, as in FIFO mode)
local function evict(size, cap, spi)
  local start, unused = 0, 0
  while size > cap do
    local cand = redis.call('ZRANGE', index_key, start, start + 63)
    if #cand == 0 then break end
    for _, m in ipairs(cand) do
      if size <= cap then break end
      if redis.call('HEXISTS', out_key, m) == 0 then
        local n = ctl(redis.call('HGET', n_key, m), 0, n_key, m)
        local uses = ctl(redis.call('HGET', uses_key, m), 0, uses_key, m)
        replay_remove(index_key, n_key, uses_key, samples_key, counters_key, m, n)
        size = size - n
        incr(counters_key, C.samples_evicted, n)
        limiter_forgive(counters_key, spi, n, uses)
        if uses == 0 then unused = unused + 1 end
      else
        start = start + 1
      end
    end
  end
  return unused
end

local pe = redis.call('XPENDING', prompts_key, WORKERS, lease_id, lease_id, 1)
if #pe == 0 then
  incr(counters_key, C.completions_duplicate, 1)
  return {0}
end
redis.call('XACK', prompts_key, WORKERS, lease_id)
redis.call('XDEL', prompts_key, lease_id)
if pe[1][2] == RELEASED then
  incr(counters_key, C.admitted, group_size)
else
  incr(counters_key, C.inflight, -group_size)
end
local id = ''
if n_good > 0 then
  id = append_entry(samples_key, counters_key, group_id, prompt_id, oldest_version, n_good, consumer, now, first_good)
  if mode == 'replay' then
    local seq = redis.call('HINCRBY', counters_key, C.replay_seq, 1)
    redis.call('ZADD', index_key, tonumber(oldest_version) * VSCALE + (seq % VSCALE), id)
    redis.call('HSET', n_key, id, n_good)
    incr(counters_key, C.rl_inserts, n_good)
    local size = redis.call('HINCRBY', counters_key, C.replay_size, n_good)
    local cap = tonumber(redis.call('HGET', params_key, 'capacity'))
    local spi = ctl(redis.call('HGET', params_key, 'samples_per_insert'), 0, params_key, 'samples_per_insert')
    give_back(counters_key, wake_prompts_key, evict(size, cap, spi) * group_size, 'evicted')
    wake(wake_replay_key, 'insert')
  end
else
  -- every sample was bad, or the group was filtered: the prompt produced nothing to train on,
  -- so its reservation goes back and pacing admits another prompt in its place
  if filter_reason ~= '' then
    count_filtered(counters_key, filter_reason, n_filtered)
  else
    incr(counters_key, C.completions_empty, 1)
  end
  give_back(counters_key, wake_prompts_key, group_size, 'budget')
end
for i = 0, n_bad - 1 do
  local b = first_bad + 3 * i
  dead_letter(dead_key, counters_key, dead_maxlen, ARGV[b], ARGV[b + 1], consumer, ARGV[b + 2], lease_id, now)
end
return {1, id, filter_reason}
