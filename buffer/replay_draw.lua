-- Draw whole groups from the replay table for one batch (replay mode), under the rate limiter.
-- KEYS: 1 params, 2 counters, 3 samples, 4 replay_index, 5 replay_n, 6 replay_uses, 7 replay_out,
--       8 hist_dropped, 9 wake_replay, 10 wake_prompts
-- ARGV: 1 consumer, 2 learner version, 3 groups wanted, 4 policy (fifo|uniform)
-- First removes entries too stale to train on (counted per lag). Then blocks (returns 'wait')
-- while the table holds fewer than min_size_to_sample samples or fewer free groups than wanted,
-- or while drawing would push inserts * spi - samples below min_diff (Reverb's CanSample).
-- Drawn entries are marked out to this consumer until commit (uses count then) or return.
-- Returns {'wait', last wake_replay id, why} or {'ok', id, fields, id, fields, ...}.
local p = redis.call('HMGET', KEYS[1], 'max_staleness', 'samples_per_insert', 'min_size_to_sample', 'error_buffer')
local eta, spi, minsz, errbuf = tonumber(p[1]), num(p[2], 0), num(p[3], 0), num(p[4], 0)
local v, want = tonumber(ARGV[2]), tonumber(ARGV[3])

-- 1. too stale: version < v - eta, i.e. score < (v - eta) * VSCALE
if v - eta > 0 then
  local stale = redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', '(' .. ((v - eta) * VSCALE), 'WITHSCORES')
  local dropped = 0
  for i = 1, #stale, 2 do
    local m = stale[i]
    if redis.call('HEXISTS', KEYS[7], m) == 0 then
      local n = num(redis.call('HGET', KEYS[5], m), 0)
      local uses = num(redis.call('HGET', KEYS[6], m), 0)
      local lag = v - math.floor(tonumber(stale[i + 1]) / VSCALE)
      redis.call('ZREM', KEYS[4], m)
      redis.call('HDEL', KEYS[5], m)
      redis.call('HDEL', KEYS[6], m)
      redis.call('XDEL', KEYS[3], m)
      incr(KEYS[2], C.samples_dropped_stale, n)
      incr(KEYS[2], C.groups_dropped_stale, 1)
      incr(KEYS[8], lag, n)
      incr(KEYS[2], C.samples_removed, n)
      incr(KEYS[2], C.groups_removed, 1)
      incr(KEYS[2], C.replay_size, -n)
      if spi > uses then incrf(KEYS[2], C.rl_samples, n * (spi - uses)) end
      dropped = dropped + 1
    end
  end
  if dropped > 0 then wake(KEYS[10], 'dropped') end
end

-- 2. size gate
local c = redis.call('HMGET', KEYS[2], C.replay_size, C.rl_inserts, C.rl_samples)
local size, inserts, sampled = num(c[1], 0), num(c[2], 0), num(c[3], 0)
if size < minsz or size == 0 then return {'wait', last_id(KEYS[9]), 'size'} end

-- 3. choose free entries
local chosen = {}
if ARGV[4] == 'uniform' then
  local pool = redis.call('ZRANDMEMBER', KEYS[4], want + redis.call('HLEN', KEYS[7]))
  for _, m in ipairs(pool) do
    if #chosen >= want then break end
    if redis.call('HEXISTS', KEYS[7], m) == 0 then chosen[#chosen + 1] = m end
  end
else
  local start = 0
  while #chosen < want do
    local cand = redis.call('ZRANGE', KEYS[4], start, start + 63)
    if #cand == 0 then break end
    for _, m in ipairs(cand) do
      if #chosen >= want then break end
      if redis.call('HEXISTS', KEYS[7], m) == 0 then chosen[#chosen + 1] = m end
    end
    start = start + 64
  end
end
if #chosen < want then return {'wait', last_id(KEYS[9]), 'entries'} end
local total = 0
for _, m in ipairs(chosen) do total = total + num(redis.call('HGET', KEYS[5], m), 0) end

-- 4. ratio gate: Reverb CanSample(n): inserts * spi - (samples + n) >= spi * min_size - error_buffer
if spi > 0 and inserts * spi - (sampled + total) < spi * minsz - errbuf then
  return {'wait', last_id(KEYS[9]), 'ratio'}
end

incrf(KEYS[2], C.rl_samples, total)
local res = {'ok'}
for _, m in ipairs(chosen) do
  redis.call('HSET', KEYS[7], m, ARGV[1])
  local e = redis.call('XRANGE', KEYS[3], m, m)
  res[#res + 1] = m
  if #e == 1 then res[#res + 1] = e[1][2] else res[#res + 1] = {} end
end
-- sampling makes room for inserts under the limiter
if spi > 0 then wake(KEYS[10], 'sampled') end
return res
