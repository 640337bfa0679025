-- Draw whole groups from the replay table for one batch (replay mode), under the rate limiter.
-- First removes entries too stale to train on: those never used are dropped as too stale (counted
-- per lag, and they give their admission back, as FIFO's drop.lua does); a used one was trained on
-- and only ages out (samples_aged_out). Then blocks (returns 'wait')
-- while the table holds fewer than min_size_to_sample samples or fewer free groups than wanted,
-- or while drawing would break the sample side of the limiter (limiter_can_sample, from
-- buffer/pacing.py through the preamble). Drawn entries are marked out to this consumer until
-- commit (uses count then) or return.
-- Returns {'wait', last wake_replay id, why} or {'ok', id, fields, id, fields, ...}.
-- ARGV[5] '1': a dry run (LearnerClient.exhausted): {'ok'} where a draw would succeed, nothing drawn.
local params_key, counters_key, samples_key, index_key, n_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local uses_key, out_key, hist_key, wake_replay_key, wake_prompts_key = KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10]
local consumer, version, want, policy = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
local dry = ARGV[5] == '1'
local pace = pacing_params(params_key)
local max_staleness = pace.max_staleness

-- 1. too stale: entry version < version - max_staleness, i.e. score < (version - max_staleness) * VSCALE
if version - max_staleness > 0 then
  local stale = redis.call('ZRANGEBYSCORE', index_key, '-inf', '(' .. ((version - max_staleness) * VSCALE), 'WITHSCORES')
  local dropped, unused = 0, 0
  for i = 1, #stale, 2 do
    local m = stale[i]
    if redis.call('HEXISTS', out_key, m) == 0 then
      local n = ctl(redis.call('HGET', n_key, m), 0, n_key, m)
      local uses = ctl(redis.call('HGET', uses_key, m), 0, uses_key, m)
      local lag = version - math.floor(tonumber(stale[i + 1]) / VSCALE)
      replay_remove(index_key, n_key, uses_key, samples_key, counters_key, m, n)
      if uses == 0 then
        incr(counters_key, C.samples_dropped_stale, n)
        incr(counters_key, C.groups_dropped_stale, 1)
        incr(hist_key, lag, n)
        unused = unused + 1
      else
        incr(counters_key, C.samples_aged_out, n)
        incr(counters_key, C.groups_aged_out, 1)
      end
      limiter_forgive(counters_key, pace.samples_per_insert, n, uses)
      dropped = dropped + 1
    end
  end
  -- claimers wait on the budget given back or on the limiter's draws forgiven
  if unused > 0 then
    give_back_groups(params_key, counters_key, wake_prompts_key, unused, 'dropped')
  elseif dropped > 0 then
    wake(wake_prompts_key, 'dropped')
  end
end

-- 2. size gate
local c = redis.call('HMGET', counters_key, C.replay_size, C.rl_inserts, C.rl_samples)
local size, inserts = ctl(c[1], 0, counters_key, C.replay_size), ctl(c[2], 0, counters_key, C.rl_inserts)
local sampled = ctl(c[3], 0, counters_key, C.rl_samples)
if size < pace.min_size_to_sample or size == 0 then return {'wait', last_id(wake_replay_key), 'size'} end

-- 3. choose free entries
local chosen = {}
if policy == 'uniform' then
  local pool = redis.call('ZRANDMEMBER', index_key, want + redis.call('HLEN', out_key))
  for _, m in ipairs(pool) do
    if #chosen >= want then break end
    if redis.call('HEXISTS', out_key, m) == 0 then chosen[#chosen + 1] = m end
  end
else
  local start = 0
  while #chosen < want do
    local cand = redis.call('ZRANGE', index_key, start, start + 63)
    if #cand == 0 then break end
    for _, m in ipairs(cand) do
      if #chosen >= want then break end
      if redis.call('HEXISTS', out_key, m) == 0 then chosen[#chosen + 1] = m end
    end
    start = start + 64
  end
end
if #chosen < want then return {'wait', last_id(wake_replay_key), 'entries'} end
local total = 0
for _, m in ipairs(chosen) do total = total + ctl(redis.call('HGET', n_key, m), 0, n_key, m) end

-- 4. ratio gate
if not limiter_can_sample(pace, inserts, sampled, total) then
  return {'wait', last_id(wake_replay_key), 'ratio'}
end
if dry then return {'ok'} end

incrf(counters_key, C.rl_samples, total)
local res = {'ok'}
for _, m in ipairs(chosen) do
  redis.call('HSET', out_key, m, consumer)
  local e = redis.call('XRANGE', samples_key, m, m)
  res[#res + 1] = m
  if #e == 1 then res[#res + 1] = e[1][2] else res[#res + 1] = {} end
end
-- sampling makes room for inserts under the limiter
if pace.samples_per_insert > 0 then wake(wake_prompts_key, 'sampled') end
return res
