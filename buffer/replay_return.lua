-- Put drawn-but-unused groups back into the replay table (replay mode), un-counting the draw.
-- ARGV: 1 consumer, 2.. entry ids
local counters_key, n_key, out_key, wake_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local consumer = ARGV[1]
local n = 0
for i = 2, #ARGV do
  local id = ARGV[i]
  if redis.call('HGET', out_key, id) == consumer then
    redis.call('HDEL', out_key, id)
    incrf(counters_key, C.rl_samples, -ctl(redis.call('HGET', n_key, id), 0, n_key, id))
    n = n + 1
  end
end
if n > 0 then wake(wake_key, 'returned') end
return n
