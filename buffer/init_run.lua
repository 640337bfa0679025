-- Create a run once: parameters, learner version 0, consumer groups. Idempotent.
-- KEYS: 1 params, 2 version, 3 prompts, 4 samples, 5 wake_prompts
-- ARGV: name, value, name, value, ... (all run parameters)
-- Returns the stored parameters (flat name/value list): the first caller's values win, so
-- every process of the run reads the same ones.
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('HSET', KEYS[1], unpack(ARGV))
end
redis.call('SET', KEYS[2], '0', 'NX')
-- pcall: BUSYGROUP (the group exists) is the normal case for every caller after the first
redis.pcall('XGROUP', 'CREATE', KEYS[3], WORKERS, '0', 'MKSTREAM')
redis.pcall('XGROUP', 'CREATE', KEYS[4], LEARNER, '0', 'MKSTREAM')
wake(KEYS[5], 'init')
return redis.call('HGETALL', KEYS[1])
