-- Count drawn groups as used (replay mode); remove those used max_reuse times.
-- KEYS: 1 params, 2 counters, 3 samples, 4 replay_index, 5 replay_n, 6 replay_uses, 7 replay_out,
--       8 hist_consumed, 9 dead, 10 version
-- ARGV: 1 consumer, 2 now, 3 dead-letter maxlen, 4 number of entries, then per entry:
--       id, good samples ('' = all), lag ('' = from stored version), retire (1 = remove now: it
--       held bad samples, dead-lettered here once), bad count, then per bad: reason, producer, raw
-- Only entries this consumer holds are counted: a repeated commit is a no-op.
local max_reuse = tonumber(redis.call('HGET', KEYS[1], 'max_reuse'))
local version = num(redis.call('GET', KEYS[10]), 0)
local pos, done = 5, 0
for _ = 1, tonumber(ARGV[4]) do
  local id, good, lag, retire, n_bad = ARGV[pos], ARGV[pos + 1], ARGV[pos + 2], ARGV[pos + 3], tonumber(ARGV[pos + 4])
  pos = pos + 5
  if redis.call('HGET', KEYS[7], id) == ARGV[1] then
    redis.call('HDEL', KEYS[7], id)
    local n = num(redis.call('HGET', KEYS[5], id), 0)
    local uses = redis.call('HINCRBY', KEYS[6], id, 1)
    local g = num(good, n)
    local l = lag
    if l == '' then
      local score = redis.call('ZSCORE', KEYS[4], id)
      l = version - math.floor(num(score, 0) / VSCALE)
    end
    incr(KEYS[2], C.samples_consumed, g)
    incr(KEYS[2], C.groups_consumed, 1)
    if g > 0 then incr(KEYS[8], l, g) end
    for i = 0, n_bad - 1 do
      local b = pos + 3 * i
      dead_letter(KEYS[9], KEYS[2], ARGV[3], 'sample', ARGV[b], ARGV[b + 1], ARGV[b + 2], id, ARGV[2])
    end
    if uses >= max_reuse or retire == '1' then
      redis.call('ZREM', KEYS[4], id)
      redis.call('HDEL', KEYS[5], id)
      redis.call('HDEL', KEYS[6], id)
      redis.call('XDEL', KEYS[3], id)
      incr(KEYS[2], C.samples_removed, n)
      incr(KEYS[2], C.groups_removed, 1)
      incr(KEYS[2], C.replay_size, -n)
    end
    done = done + 1
  end
  pos = pos + 3 * n_bad
end
return done
