-- Put drawn-but-unused groups back into the replay table (replay mode), un-counting the draw.
-- KEYS: 1 counters, 2 replay_n, 3 replay_out, 4 wake_replay
-- ARGV: 1 consumer, 2.. entry ids
local n = 0
for i = 2, #ARGV do
  local id = ARGV[i]
  if redis.call('HGET', KEYS[3], id) == ARGV[1] then
    redis.call('HDEL', KEYS[3], id)
    incrf(KEYS[1], C.rl_samples, -num(redis.call('HGET', KEYS[2], id), 0))
    n = n + 1
  end
end
if n > 0 then wake(KEYS[4], 'returned') end
return n
