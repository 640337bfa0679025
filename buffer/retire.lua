-- Retire consumers that stopped heartbeating long ago: add the running totals of their stats to
-- the run's retired totals, delete their record and their consumer of the prompts' group. The
-- caller read the records and picked the dead ones; a record that changed since (a heartbeat came)
-- or whose consumer still owns leases is left alone: a claimer takes the leases over once they
-- are idle for lease_timeout_s, and a later sweep retires it (XGROUP DELCONSUMER would drop them).
-- ARGV, per consumer: name, SHA-1 of its record as read, n, then n pairs (stat, total to add)
-- Then every consumer of the prompts' group that owns nothing and has no record is deleted (a
-- claimer that never heartbeated, or one retired now): its next claim would make it again.
-- Returns the names retired.
local prompts_key, consumers_key, retired_key = KEYS[1], KEYS[2], KEYS[3]
local summary = redis.pcall('XPENDING', prompts_key, WORKERS)
if summary.err then return {} end  -- no group yet: the run has not started
local pending = {}
for _, row in ipairs(summary[4] or {}) do pending[row[1]] = true end

local retired = {}
local i = 1
while i <= #ARGV do
  local name, sha, n = ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 2])
  local rec = redis.call('HGET', consumers_key, name)
  if rec and redis.sha1hex(rec) == sha and not pending[name] then
    for j = i + 3, i + 1 + 2 * n, 2 do
      redis.call('HINCRBYFLOAT', retired_key, ARGV[j], ARGV[j + 1])
    end
    redis.call('HINCRBY', retired_key, RETIRED_COUNT, 1)
    redis.call('HDEL', consumers_key, name)
    retired[#retired + 1] = name
  end
  i = i + 3 + 2 * n
end

for _, c in ipairs(redis.call('XINFO', 'CONSUMERS', prompts_key, WORKERS)) do
  local name, owns
  for j = 1, #c, 2 do
    if c[j] == 'name' then name = c[j + 1] elseif c[j] == 'pending' then owns = c[j + 1] end
  end
  if owns == 0 and name ~= RELEASED and redis.call('HEXISTS', consumers_key, name) == 0 then
    redis.call('XGROUP', 'DELCONSUMER', prompts_key, WORKERS, name)
  end
end
return retired
