-- Lease up to max_prompts prompts to a consumer, within the admission budget.
-- KEYS: 1 params, 2 version, 3 counters, 4 prompts, 5 dead, 6 wake_prompts
-- ARGV: 1 consumer, 2 max_prompts, 3 lease timeout (ms), 4 now, 5 dead-letter maxlen
-- Order: prompts given back with release (need budget again), then leases of consumers that
-- stopped heartbeating (already admitted: no budget), then new prompts (need budget).
-- Pacing (AReaL): admitted <= (ahead + version + 1) * batch_size, in samples, with
-- ahead = min(max_staleness, lookahead) (no lookahead: max_staleness); each prompt reserves
-- group_size. The lookahead keeps workers that outpace the learner from generating batches
-- that would only wait in the buffer and age up to the staleness bound. With a rate limiter
-- (samples_per_insert), a prompt is admitted only if its group would be insertable under the
-- limiter counting groups still being generated.
-- Returns {status, last wake id, learner version, budget left, id, payload, deliveries, how, ...}
-- status 'noinit' when the run has no parameters yet.
local consumer = ARGV[1]
local max_n = tonumber(ARGV[2])
local p = redis.call('HMGET', KEYS[1], 'group_size', 'batch_size', 'max_staleness', 'max_deliveries',
                     'samples_per_insert', 'min_size_to_sample', 'error_buffer', 'lookahead')
if not p[1] then return {'noinit', last_id(KEYS[6]), -1, 0} end
local G, B, eta, maxdel = tonumber(p[1]), tonumber(p[2]), tonumber(p[3]), tonumber(p[4])
local spi, minsz, errbuf = num(p[5], 0), num(p[6], 0), num(p[7], 0)
local ahead = eta
if p[8] and p[8] ~= '' and tonumber(p[8]) < ahead then ahead = tonumber(p[8]) end
local v = num(redis.call('GET', KEYS[2]), 0)
local c = redis.call('HMGET', KEYS[3], C.admitted, C.inflight, C.rl_inserts, C.rl_samples)
local admitted, inflight, inserts, sampled = num(c[1], 0), num(c[2], 0), num(c[3], 0), num(c[4], 0)

local function budget()
  local b = (ahead + v + 1) * B - admitted
  if spi > 0 then
    -- Reverb CanInsert(n): inserts + n <= min_size, or (inserts + n) * spi - samples <= max_diff
    local ins = inserts + inflight
    local room = math.floor((spi * minsz + errbuf + sampled) / spi) - ins
    if minsz - ins > room then room = minsz - ins end
    if room < b then b = room end
  end
  return b
end

local out = {}
local n_out, n_claimed, n_reclaimed, n_dead = 0, 0, 0, 0
local function take(entry, how, deliveries)
  out[#out + 1] = entry[1]
  out[#out + 1] = field(entry[2], F_PROMPT)
  out[#out + 1] = deliveries
  out[#out + 1] = how
  n_out = n_out + 1
end

-- 1. prompts given back un-done: owned by the pseudo-consumer RELEASED
if max_n > 0 and budget() >= G then
  local rel = redis.call('XPENDING', KEYS[4], WORKERS, '-', '+', max_n, RELEASED)
  for _, e in ipairs(rel) do
    if budget() < G then break end
    local got = redis.call('XCLAIM', KEYS[4], WORKERS, consumer, 0, e[1])
    if #got > 0 and got[1][2] then
      admitted = admitted + G
      inflight = inflight + G
      take(got[1], 'released', e[4] + 1)
    end
  end
end

-- 2. leases whose holder stopped heartbeating for the lease timeout
local room = max_n - n_out
if room > 0 then
  local idle = redis.call('XPENDING', KEYS[4], WORKERS, 'IDLE', ARGV[3], '-', '+', room + 16)
  for _, e in ipairs(idle) do
    if room <= 0 then break end
    if e[2] ~= RELEASED then
      -- XCLAIM re-checks the idle time, so a lease renewed since XPENDING stays put
      local got = redis.call('XCLAIM', KEYS[4], WORKERS, consumer, ARGV[3], e[1])
      if #got > 0 and got[1][2] then
        local deliveries = e[4] + 1
        if deliveries > maxdel then
          dead_letter(KEYS[5], KEYS[3], ARGV[5], 'prompt',
            'delivered ' .. deliveries .. ' times without being completed (buffer.max_deliveries=' .. maxdel ..
            '): the prompt keeps killing workers or timing out; last holder ' .. e[2],
            e[2], field(got[1][2], F_PROMPT) or '', e[1], ARGV[4])
          redis.call('XACK', KEYS[4], WORKERS, e[1])
          redis.call('XDEL', KEYS[4], e[1])
          admitted = admitted - G
          inflight = inflight - G
          n_dead = n_dead + 1
        else
          take(got[1], 'reclaimed', deliveries)
          n_reclaimed = n_reclaimed + 1
          room = room - 1
        end
      end
    end
  end
end

-- 3. new prompts within the budget
room = max_n - n_out
local k = math.min(room, math.floor(budget() / G))
if k > 0 then
  local res = redis.call('XREADGROUP', 'GROUP', WORKERS, consumer, 'COUNT', k, 'STREAMS', KEYS[4], '>')
  if res then
    for _, entry in ipairs(res[1][2]) do
      admitted = admitted + G
      inflight = inflight + G
      n_claimed = n_claimed + 1
      take(entry, 'new', 1)
    end
  end
end

redis.call('HSET', KEYS[3], C.admitted, admitted, C.inflight, inflight)
if n_claimed > 0 then
  incr(KEYS[3], C.prompts_claimed, n_claimed)
  incr(KEYS[3], C.prompts_waiting, -n_claimed)
end
if n_reclaimed > 0 then incr(KEYS[3], C.prompts_reclaimed, n_reclaimed) end
if n_dead > 0 then
  incr(KEYS[3], C.budget_returned, n_dead * G)
  wake(KEYS[6], 'budget')
end
local res = {'ok', last_id(KEYS[6]), v, budget()}
for i = 1, #out do res[#res + 1] = out[i] end
return res
