-- Lease up to max_prompts prompts to a consumer, within the admission budget.
-- Order: prompts given back with release (need budget again), then leases of consumers that
-- stopped heartbeating (already admitted: no budget), then new prompts (need budget).
-- Pacing: admission_budget (the rule and the rate limiter, from buffer/pacing.py through the
-- preamble); each admitted prompt reserves group_size samples of `admitted` and of `inflight`.
-- Returns {status, last wake id, learner version, budget left, id, payload, deliveries, how, ...}
-- status 'noinit' when the run has no parameters yet. With max_prompts 0 nothing is claimed and
-- the budget left is the rule's answer for the current state.
local params_key, version_key, updates_key, counters_key, prompts_key, dead_key, wake_key =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7]
local consumer, max_prompts, lease_ms, now, dead_maxlen =
  ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4], ARGV[5]
local p = redis.call('HMGET', params_key, 'group_size', 'max_deliveries')
if not p[1] then return {'noinit', last_id(wake_key), -1, 0} end
local group_size, max_deliveries = tonumber(p[1]), tonumber(p[2])
local pace = pacing_params(params_key)
local version = ctl(redis.call('GET', version_key), 0, version_key, '')
-- pacing counts the updates trained (pacing.trained_updates: the version when the key is absent)
local updates = ctl(redis.call('GET', updates_key), version, updates_key, '')
local c = redis.call('HMGET', counters_key, C.admitted, C.inflight, C.rl_inserts, C.rl_samples)
local admitted, inflight = ctl(c[1], 0, counters_key, C.admitted), ctl(c[2], 0, counters_key, C.inflight)
local inserts, sampled = ctl(c[3], 0, counters_key, C.rl_inserts), ctl(c[4], 0, counters_key, C.rl_samples)

local function budget()
  return admission_budget(pace, updates, admitted, inflight, inserts, sampled)
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
if max_prompts > 0 and budget() >= group_size then
  local released = redis.call('XPENDING', prompts_key, WORKERS, '-', '+', max_prompts, RELEASED)
  for _, e in ipairs(released) do
    if budget() < group_size then break end
    local got = redis.call('XCLAIM', prompts_key, WORKERS, consumer, 0, e[1])
    if #got > 0 and got[1][2] then
      admitted = admitted + group_size
      inflight = inflight + group_size
      take(got[1], 'released', e[4] + 1)
    end
  end
end

-- 2. leases whose holder stopped heartbeating for the lease timeout, a page of the pending list
-- at a time from the oldest: released prompts (left to step 1 for want of budget) are skipped,
-- and however many there are, the pages move past them to the expired leases behind
local room = max_prompts - n_out
local after = '-'
while room > 0 do
  local idle = redis.call('XPENDING', prompts_key, WORKERS, 'IDLE', lease_ms, after, '+', room + 64)
  if #idle == 0 then break end
  after = '(' .. idle[#idle][1]
  for _, e in ipairs(idle) do
    if room <= 0 then break end
    if e[2] ~= RELEASED then
      -- XCLAIM re-checks the idle time, so a lease renewed since XPENDING stays put
      local got = redis.call('XCLAIM', prompts_key, WORKERS, consumer, lease_ms, e[1])
      if #got > 0 and got[1][2] then
        local deliveries = e[4] + 1
        if deliveries > max_deliveries then
          dead_letter(dead_key, counters_key, dead_maxlen, 'prompt',
            'delivered ' .. deliveries .. ' times without being completed (buffer.max_deliveries=' .. max_deliveries ..
            '): the prompt keeps killing workers or timing out; last holder ' .. e[2],
            e[2], field(got[1][2], F_PROMPT) or '', e[1], now)
          redis.call('XACK', prompts_key, WORKERS, e[1])
          redis.call('XDEL', prompts_key, e[1])
          admitted = admitted - group_size
          inflight = inflight - group_size
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
room = max_prompts - n_out
local n_new = math.min(room, math.floor(budget() / group_size))
if n_new > 0 then
  local res = redis.call('XREADGROUP', 'GROUP', WORKERS, consumer, 'COUNT', n_new, 'STREAMS', prompts_key, '>')
  if res then
    for _, entry in ipairs(res[1][2]) do
      admitted = admitted + group_size
      inflight = inflight + group_size
      n_claimed = n_claimed + 1
      take(entry, 'new', 1)
    end
  end
end

redis.call('HSET', counters_key, C.admitted, admitted, C.inflight, inflight)
if n_claimed > 0 then
  incr(counters_key, C.prompts_claimed, n_claimed)
  incr(counters_key, C.prompts_waiting, -n_claimed)
end
if n_reclaimed > 0 then incr(counters_key, C.prompts_reclaimed, n_reclaimed) end
if n_dead > 0 then
  incr(counters_key, C.budget_returned, n_dead * group_size)
  wake(wake_key, 'budget')
end
local res = {'ok', last_id(wake_key), version, budget()}
for i = 1, #out do res[#res + 1] = out[i] end
return res
