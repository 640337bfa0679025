"""Loads the Lua scripts (``buffer/*.lua``) with a preamble generated from the Python constants.

Each multi-key state change is one Lua script, so it is atomic (with AOF a crash loses a whole
script, never half). Every script starts with ``#!lua`` (Redis 7 flags): Redis refuses a write
script up front when out of memory, instead of failing after earlier writes happened.

The preamble brings the names defined once in Python (stream fields and groups of
:mod:`buffer.keys`, the counters of :mod:`buffer.metrics` as the table ``C``, which raises on an
unknown name), the shared helpers, and the Lua twins of :mod:`buffer.pacing`. Each script names
its ``KEYS`` in locals on its first lines; :func:`claim_keys` and :func:`complete_keys` build the
lists of the scripts called from more than one place.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import redis

from buffer import keys as K
from buffer import metrics, pacing
from buffer.connection import CORRUPT_MARK

_DIR = Path(__file__).resolve().parent

SCRIPT_NAMES = ("init_run", "claim", "heartbeat", "retire", "release", "expire", "complete", "append", "commit", "drop",
                "replay_draw", "replay_commit", "replay_return")


def _lua_str(s: str) -> str:
    assert "'" not in s and "\\" not in s and "\n" not in s
    return f"'{s}'"


def preamble() -> str:
    consts = {
        "WORKERS": K.WORKERS_GROUP,
        "LEARNER": K.LEARNER_GROUP,
        "RELEASED": K.RELEASED_CONSUMER,
        "RETIRED_COUNT": K.RETIRED_COUNT,
        "F_PROMPT": K.PROMPT_FIELD,
        "F_GROUP": K.F_GROUP,
        "F_PROMPT_ID": K.F_PROMPT_ID,
        "F_VERSION": K.F_VERSION,
        "F_COUNT": K.F_COUNT,
        "F_PRODUCER": K.F_PRODUCER,
        "F_TIME": K.F_TIME,
        "F_SAMPLE": K.SAMPLE_FIELD_PREFIX,
        "D_KIND": K.D_KIND,
        "D_REASON": K.D_REASON,
        "D_PRODUCER": K.D_PRODUCER,
        "D_RAW": K.D_RAW,
        "D_RAW_BYTES": K.D_RAW_BYTES,
        "D_RAW_SHA1": K.D_RAW_SHA1,
        "D_SOURCE": K.D_SOURCE,
        "D_TIME": K.D_TIME,
        "WAKE_MAXLEN": str(K.WAKE_MAXLEN),
        "CORRUPT": CORRUPT_MARK,
    }
    lines = [f"local {name} = {_lua_str(value)}" for name, value in consts.items()]
    lines.append(f"local DEAD_RAW_MAX = {int(K.DEAD_RAW_MAX)}")
    counters = ", ".join(f"{n} = {_lua_str(n)}" for n in metrics.COUNTERS)
    lines.append(f"local C = setmetatable({{{counters}}}, {{__index = function(_, k) error('unknown counter ' .. tostring(k)) end}})")
    lines.append(
        """
-- 2^32: replay scores are version * VSCALE + insertion seq (exact in a double up to version 2^20)
local VSCALE = 4294967296
local function field(fields, name)
  for i = 1, #fields, 2 do
    if fields[i] == name then return fields[i + 1] end
  end
  return false
end
local function last_id(stream)
  local w = redis.call('XREVRANGE', stream, '+', '-', 'COUNT', 1)
  if #w == 0 then return '0-0' end
  return w[1][1]
end
local function wake(stream, why)
  redis.call('XADD', stream, 'MAXLEN', '~', WAKE_MAXLEN, '*', 'e', why)
end
-- append a group's stream entry: the good samples are ARGV[first .. first + n_good - 1]
local function append_entry(samples_key, counters_key, group_id, prompt_id, oldest, n_good, producer, now, first)
  local fields = {F_GROUP, group_id, F_PROMPT_ID, prompt_id, F_VERSION, oldest, F_COUNT, n_good,
                  F_PRODUCER, producer, F_TIME, now}
  for i = 0, n_good - 1 do
    fields[#fields + 1] = F_SAMPLE .. i
    fields[#fields + 1] = ARGV[first + i]
  end
  local id = redis.call('XADD', samples_key, '*', unpack(fields))
  redis.call('HINCRBY', counters_key, C.groups_appended, 1)
  redis.call('HINCRBY', counters_key, C.samples_appended, n_good)
  return id
end
-- one dead letter; kind is 'sample' | 'prompt' | 'entry'
-- a dead letter keeps the first DEAD_RAW_MAX bytes of the record, its size and (when cut) its SHA-1
local function dead_letter(dead, counters, maxlen, kind, reason, producer, raw, source, now)
  local size, sha = #raw, ''
  if size > DEAD_RAW_MAX then
    sha = redis.sha1hex(raw)
    raw = string.sub(raw, 1, DEAD_RAW_MAX)
  end
  redis.call('XADD', dead, 'MAXLEN', '~', maxlen, '*', D_KIND, kind, D_REASON, string.sub(reason, 1, 4096),
             D_PRODUCER, producer, D_RAW, raw, D_RAW_BYTES, size, D_RAW_SHA1, sha, D_SOURCE, source, D_TIME, now)
  redis.call('HINCRBY', counters, C.dead_letters, 1)
  if kind == 'sample' then
    redis.call('HINCRBY', counters, C.samples_dead_lettered, 1)
  elseif kind == 'prompt' then
    redis.call('HINCRBY', counters, C.prompts_dead_lettered, 1)
  else
    redis.call('HINCRBY', counters, C.entries_dead_lettered, 1)
  end
end
-- admission given back (buffer/pacing.py): `samples` admitted will never be trained (a prompt
-- released or completed empty, a group dropped or evicted before any use); claimers are woken
local function give_back(counters_key, wake_key, samples, why)
  if samples > 0 then
    redis.call('HINCRBY', counters_key, C.admitted, -samples)
    redis.call('HINCRBY', counters_key, C.budget_returned, samples)
    wake(wake_key, why)
  end
end
-- HINCRBY / HINCRBYFLOAT that skip a zero step (Lua's -0 would reach Redis as "-0", which
-- HINCRBY rejects, and a zero step is a wasted write anyway)
local function incr(key, name, by)
  if by ~= 0 then return redis.call('HINCRBY', key, name, by) end
end
local function incrf(key, name, by)
  if by ~= 0 then return redis.call('HINCRBYFLOAT', key, name, by) end
end
local function num(x, default)
  if x == false or x == nil or x == '' then return default end
  return tonumber(x)
end
-- a group filtered by algo.filter_groups: counted, and per reason
local function count_filtered(counters_key, reason, n)
  incr(counters_key, C.groups_filtered, 1)
  incr(counters_key, C.samples_filtered, n)
  incr(counters_key, C['groups_filtered_' .. reason], 1)
end
-- give_back for `groups` whole groups of the run's group_size (read only when there are some)
local function give_back_groups(params_key, counters_key, wake_key, groups, why)
  if groups > 0 then
    give_back(counters_key, wake_key, groups * num(redis.call('HGET', params_key, 'group_size'), 0), why)
  end
end
-- a control value the service wrote (a counter, the version): a number, else stop with an error
-- naming the key (buffer.connection turns it into CorruptStateError); never arithmetic on nil
local function ctl(x, default, key, name)
  if x == false or x == nil or x == '' then return default end
  local v = tonumber(x)
  if v == nil then
    local where = key
    if name ~= '' then where = where .. ' ' .. tostring(name) end
    error(CORRUPT .. ' ' .. where .. " holds '" .. string.sub(x, 1, 40) .. "', not a number")
  end
  return v
end
-- a field a producer wrote (count, version): a non-negative integer, else default; the learner
-- dead-letters such entries before any script sees them, this keeps the arithmetic safe anyway
local function field_int(x, default)
  local v = tonumber(x)
  if v == nil or v ~= math.floor(v) or v < 0 or v > 9007199254740991 then return default end
  return v
end
-- ack and delete an entry the learner read from the sample stream, counted as removed: its
-- fields ({} when the entry is gone) and sample count; nil when it was acked already
local function take_entry(samples_key, counters_key, id)
  if redis.call('XACK', samples_key, LEARNER, id) == 0 then return nil, 0 end
  local e = redis.call('XRANGE', samples_key, id, id)
  local fields = {}
  if #e == 1 then fields = e[1][2] end
  redis.call('XDEL', samples_key, id)
  local n = field_int(field(fields, F_COUNT), 0)
  incr(counters_key, C.samples_removed, n)
  incr(counters_key, C.groups_removed, 1)
  return fields, n
end
-- the dead letters of a committed entry: n_bad samples as (reason, producer, raw) from ARGV[first]
local function sample_dead_letters(dead_key, counters_key, dead_maxlen, first, n_bad, id, now)
  for i = 0, n_bad - 1 do
    local b = first + 3 * i
    dead_letter(dead_key, counters_key, dead_maxlen, 'sample', ARGV[b], ARGV[b + 1], ARGV[b + 2], id, now)
  end
end
-- take one group of n samples out of the replay table (index, sizes, use counts, stream entry)
local function replay_remove(index_key, n_key, uses_key, samples_key, counters_key, id, n)
  redis.call('ZREM', index_key, id)
  redis.call('HDEL', n_key, id)
  redis.call('HDEL', uses_key, id)
  redis.call('XDEL', samples_key, id)
  incr(counters_key, C.samples_removed, n)
  incr(counters_key, C.groups_removed, 1)
  incr(counters_key, C.replay_size, -n)
end
"""
    )
    lines.append(pacing.lua())
    return "\n".join(lines)


def source(name: str) -> str:
    """The full source of script ``name``: shebang, preamble, body."""
    body = (_DIR / f"{name}.lua").read_text()
    if body.startswith("#!"):
        body = body.split("\n", 1)[1]
    return "#!lua\n" + preamble() + "\n" + body


def claim_keys(keys: K.RunKeys) -> list[str]:
    """``KEYS`` of ``claim.lua`` (the pacing check runs there)."""
    return [keys.params, keys.version, keys.updates, keys.counters, keys.prompts, keys.dead, keys.wake_prompts]


def complete_keys(keys: K.RunKeys, mode: str) -> list[str]:
    """``KEYS`` of ``complete.lua``: the replay ones only in replay mode (fewer arguments on the hot path)."""
    out = [keys.prompts, keys.samples, keys.counters, keys.dead, keys.wake_prompts]
    if mode == "replay":
        out += [keys.params, keys.replay_index, keys.replay_n, keys.replay_uses, keys.replay_out, keys.wake_replay]
    return out


def run_many(client: redis.Redis, script: redis.commands.core.Script, keys: list[str],
             arg_lists: list[list[Any]]) -> list[Any]:
    """Run ``script`` once per argument list in ONE round trip (redis-py's pipeline would send
    SCRIPT EXISTS first): EVALSHA each, loading the script and running again only on NOSCRIPT."""
    results: list[Any] = [None] * len(arg_lists)
    todo = list(range(len(arg_lists)))
    for _ in range(3):
        pipe = client.pipeline(transaction=False)
        for i in todo:
            pipe.evalsha(script.sha, len(keys), *keys, *arg_lists[i])
        missing = []
        for i, res in zip(todo, pipe.execute(raise_on_error=False)):
            if isinstance(res, redis.exceptions.NoScriptError):
                missing.append(i)
            elif isinstance(res, Exception):
                raise res
            else:
                results[i] = res
        if not missing:
            return results
        script.sha = client.script_load(script.script)
        todo = missing
    raise redis.exceptions.NoScriptError("Redis keeps forgetting the buffer's scripts (SCRIPT FLUSH in a loop?)")


class Scripts:
    """The registered scripts of one client, each made on first use: ``scripts.claim(keys=[...], args=[...])``."""

    def __init__(self, client: redis.Redis) -> None:
        self._client = client

    def __getattr__(self, name: str) -> redis.commands.core.Script:
        if name not in SCRIPT_NAMES:
            raise AttributeError(f"no buffer script {name!r}")
        script = self._client.register_script(source(name))
        setattr(self, name, script)  # found as an attribute from now on
        return script
