-- Ack groups the learner trained on (FIFO mode): count them consumed and delete them.
-- KEYS: 1 samples, 2 counters, 3 hist_consumed, 4 dead, 5 version
-- ARGV: 1 now, 2 dead-letter maxlen, 3 number of entries, then per entry:
--       id, good samples ('' = all), lag ('' = stored version - entry version), bad count,
--       then per bad sample: reason, producer, raw
-- Idempotent: an entry already acked (XACK returns 0) is skipped with its dead letters, so a
-- retried or repeated commit (commit_ids after a restart) never counts twice.
local version = num(redis.call('GET', KEYS[5]), 0)
local pos, done = 4, 0
for _ = 1, tonumber(ARGV[3]) do
  local id, good, lag, n_bad = ARGV[pos], ARGV[pos + 1], ARGV[pos + 2], tonumber(ARGV[pos + 3])
  pos = pos + 4
  if redis.call('XACK', KEYS[1], LEARNER, id) == 1 then
    local e = redis.call('XRANGE', KEYS[1], id, id)
    local n, v = 0, version
    if #e == 1 then
      n = num(field(e[1][2], F_COUNT), 0)
      v = num(field(e[1][2], F_VERSION), version)
    end
    local g = num(good, n)
    local l = num(lag, version - v)
    redis.call('XDEL', KEYS[1], id)
    incr(KEYS[2], C.samples_consumed, g)
    incr(KEYS[2], C.groups_consumed, 1)
    incr(KEYS[2], C.samples_removed, n)
    incr(KEYS[2], C.groups_removed, 1)
    if g > 0 then incr(KEYS[3], l, g) end
    for i = 0, n_bad - 1 do
      local b = pos + 3 * i
      dead_letter(KEYS[4], KEYS[2], ARGV[2], 'sample', ARGV[b], ARGV[b + 1], ARGV[b + 2], id, ARGV[1])
    end
    done = done + 1
  end
  pos = pos + 3 * n_bad
end
return done
