-- Create a run once: parameters, learner version 0, consumer groups. Idempotent.
-- ARGV: name, value, name, value, ... (all run parameters)
-- Returns the stored parameters (flat name/value list): the first caller's values win, so
-- every process of the run reads the same ones.
local params_key, version_key, prompts_key, samples_key, wake_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
if redis.call('EXISTS', params_key) == 0 then
  redis.call('HSET', params_key, unpack(ARGV))
end
redis.call('SET', version_key, '0', 'NX')
-- pcall: BUSYGROUP (the group exists) is the normal case for every caller after the first
redis.pcall('XGROUP', 'CREATE', prompts_key, WORKERS, '0', 'MKSTREAM')
redis.pcall('XGROUP', 'CREATE', samples_key, LEARNER, '0', 'MKSTREAM')
wake(wake_key, 'init')
return redis.call('HGETALL', params_key)
