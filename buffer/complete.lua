-- Append a prompt's group of samples and ack the prompt, in one atomic step.
-- KEYS: 1 prompts, 2 samples, 3 counters, 4 dead, 5 wake_prompts, and in replay mode only:
--       6 params, 7 replay_index, 8 replay_n, 9 replay_uses, 10 replay_out, 11 wake_replay
-- ARGV: 1 lease id, 2 consumer, 3 now, 4 dead-letter maxlen, 5 mode (fifo|replay), 6 group_size,
--       7 oldest token version of the group, 8 group id, 9 prompt id, 10 good samples, 11 bad records,
--       12.. the good samples' bytes, then per bad record: kind (sample|prompt), reason, raw bytes
-- (an undecodable prompt is completed with no samples and itself as the bad record)
-- Idempotent: XACK returns 0 when the prompt was already completed (a retry after a lost reply,
-- or a slow worker finishing a prompt that was re-delivered and completed elsewhere); then
-- nothing is written and the call returns {0}. Exactly one group per prompt lands.
-- The arguments are few and the entry's field names come from the preamble: this is the hot
-- path of every worker, and argument count is most of its client-side cost.
local G, n_good, n_bad = tonumber(ARGV[6]), tonumber(ARGV[10]), tonumber(ARGV[11])
if redis.call('XACK', KEYS[1], WORKERS, ARGV[1]) == 0 then
  incr(KEYS[3], C.completions_duplicate, 1)
  return {0}
end
redis.call('XDEL', KEYS[1], ARGV[1])
incr(KEYS[3], C.inflight, -G)
local id = ''
if n_good > 0 then
  local fields = {F_GROUP, ARGV[8], F_PROMPT_ID, ARGV[9], F_VERSION, ARGV[7], F_COUNT, n_good,
                  F_PRODUCER, ARGV[2], F_TIME, ARGV[3]}
  for i = 0, n_good - 1 do
    fields[#fields + 1] = F_SAMPLE .. i
    fields[#fields + 1] = ARGV[12 + i]
  end
  id = redis.call('XADD', KEYS[2], '*', unpack(fields))
  incr(KEYS[3], C.groups_appended, 1)
  incr(KEYS[3], C.samples_appended, n_good)
  if ARGV[5] == 'replay' then
    local seq = redis.call('HINCRBY', KEYS[3], C.replay_seq, 1)
    redis.call('ZADD', KEYS[7], tonumber(ARGV[7]) * VSCALE + (seq % VSCALE), id)
    redis.call('HSET', KEYS[8], id, n_good)
    incr(KEYS[3], C.rl_inserts, n_good)
    local size = redis.call('HINCRBY', KEYS[3], C.replay_size, n_good)
    -- capacity: evict the stalest entries (lowest score) that no learner holds right now
    local cap = tonumber(redis.call('HGET', KEYS[6], 'capacity'))
    local spi = num(redis.call('HGET', KEYS[6], 'samples_per_insert'), 0)
    local start = 0
    while size > cap do
      local cand = redis.call('ZRANGE', KEYS[7], start, start + 63)
      if #cand == 0 then break end
      for _, m in ipairs(cand) do
        if size <= cap then break end
        if redis.call('HEXISTS', KEYS[10], m) == 0 then
          local n = num(redis.call('HGET', KEYS[8], m), 0)
          local uses = num(redis.call('HGET', KEYS[9], m), 0)
          redis.call('ZREM', KEYS[7], m)
          redis.call('HDEL', KEYS[8], m)
          redis.call('HDEL', KEYS[9], m)
          redis.call('XDEL', KEYS[2], m)
          size = size - n
          incr(KEYS[3], C.samples_evicted, n)
          incr(KEYS[3], C.samples_removed, n)
          incr(KEYS[3], C.groups_removed, 1)
          incr(KEYS[3], C.replay_size, -n)
          -- forgive the draws the limiter still expected of this entry (see replay.py)
          if spi > uses then incrf(KEYS[3], C.rl_samples, n * (spi - uses)) end
        else
          start = start + 1
        end
      end
    end
    wake(KEYS[11], 'insert')
  end
else
  -- every sample was bad: the prompt produced nothing, so its reservation goes back
  incr(KEYS[3], C.completions_empty, 1)
  incr(KEYS[3], C.admitted, -G)
  incr(KEYS[3], C.budget_returned, G)
  wake(KEYS[5], 'budget')
end
local base = 11 + n_good
for i = 0, n_bad - 1 do
  local b = base + 3 * i
  dead_letter(KEYS[4], KEYS[3], ARGV[4], ARGV[b + 1], ARGV[b + 2], ARGV[2], ARGV[b + 3], ARGV[1], ARGV[3])
end
return {1, id}
