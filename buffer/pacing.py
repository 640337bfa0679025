"""Pacing: how far generation may run ahead of training, and the replay rate limiter.

This module owns the rule. It is enforced in Lua, inside the scripts that claim prompts and draw
replay batches (a check and the change it allows must be one atomic step), and computed in
Python for the monitor's snapshot. Both are here: the Python functions and their Lua twins
(:func:`lua`, put into every script's preamble by :mod:`buffer.scripts` with the names in
:data:`PARAMS` and :data:`COUNTERS`); ``tests/integration/test_buffer_pacing.py`` checks they agree.

Admission (AReaL's staleness control), counted in samples::

    ahead  = min(max_staleness, lookahead)         (lookahead None: max_staleness)
    budget = (ahead + updates + 1) * batch_size - admitted

``updates``: the updates the learner's published weights hold (the ``updates`` key), not its
version, which runs ahead of them after a restart from an older checkpoint; data without the key
counts the version. ``claim.lua`` admits a prompt while ``budget >= group_size`` and reserves
``group_size`` of ``admitted`` for it; ``append.lua`` admits a gateway group as it appends it.
Budget comes back (the preamble's ``give_back``) when a reservation yields nothing to train on:
a prompt released, completed empty or dead-lettered, a group dropped, or in replay mode one that
leaves the table before any use.

Rate limiter (Reverb's ``SampleToInsertRatio``, replay mode with ``samples_per_insert`` set)::

    offset   = samples_per_insert * min_size_to_sample
    min_diff = offset - error_buffer        max_diff = offset + error_buffer
    can_insert(n): inserts + n <= min_size_to_sample  or  (inserts + n) * spi - samples <= max_diff
    can_sample(n): size >= min_size_to_sample  and  inserts * spi - (samples + n) >= min_diff

``inserts`` and ``samples`` are the ``rl_inserts`` and ``rl_samples`` counters. The insert side
blocks at admission (:func:`insert_room` counts the groups in flight too), the sample side in
``replay_draw.lua``. An entry that leaves the table before it was drawn ``spi`` times has the
draws it owed forgiven (``limiter_forgive``), or a learner that can never catch up would block
inserts forever.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from buffer.connection import control_int

#: Run parameters (fields of the run's ``params`` hash) the rule reads, in the order the Lua
#: ``pacing_params`` reads them.
PARAMS = ("batch_size", "max_staleness", "lookahead", "samples_per_insert", "min_size_to_sample", "error_buffer")
#: Counters (:data:`buffer.metrics.COUNTERS`) the rule reads.
COUNTERS = ("admitted", "inflight", "rl_inserts", "rl_samples")


def ahead(max_staleness: int, lookahead: int | None) -> int:
    """Batches admitted beyond the one the learner reads next."""
    return max_staleness if lookahead is None else min(max_staleness, lookahead)


def trained_updates(raw: bytes | str | None, version: int, key: str) -> int:
    """The updates pacing counts, from the ``updates`` key's value ``raw`` (``key``: its name, for
    the error when it is not a number); ``version`` when the run's data has no such key."""
    return version if raw is None else control_int(raw, key, "")


def admission_budget(params: Mapping[str, Any], updates: int, counters: Mapping[str, float]) -> int:
    """Samples that may be admitted for generation now: pacing, capped by the limiter if on
    (``params``: :data:`PARAMS`; ``counters``: :data:`COUNTERS`). Never negative (the Lua's can be)."""
    budget = (ahead(params["max_staleness"], params.get("lookahead")) + updates + 1) * params["batch_size"]
    budget -= counters["admitted"]
    spi = params["samples_per_insert"]
    if spi:
        ins = counters["rl_inserts"] + counters["inflight"]
        budget = min(budget, insert_room(ins, counters["rl_samples"], spi, params["min_size_to_sample"], params["error_buffer"]))
    return int(max(0, budget))


def max_diff(spi: float, min_size: int, error_buffer: float) -> float:
    return spi * min_size + error_buffer


def min_diff(spi: float, min_size: int, error_buffer: float) -> float:
    return spi * min_size - error_buffer


def can_insert(inserts: float, samples: float, n: int, spi: float, min_size: int, error_buffer: float) -> bool:
    if inserts + n <= min_size:
        return True
    return (inserts + n) * spi - samples <= max_diff(spi, min_size, error_buffer)


def can_sample(inserts: float, samples: float, size: int, n: int, spi: float, min_size: int, error_buffer: float) -> bool:
    if size < min_size or size < n:
        return False
    return inserts * spi - (samples + n) >= min_diff(spi, min_size, error_buffer)


def insert_room(inserts: float, samples: float, spi: float, min_size: int, error_buffer: float) -> int:
    """The largest n with ``can_insert(n)``: how many more samples may be inserted now."""
    room = math.floor((max_diff(spi, min_size, error_buffer) + samples) / spi) - inserts
    return int(max(room, min_size - inserts))


_LUA = """
-- Pacing and the replay rate limiter: the Lua twins of buffer/pacing.py (read the rule there).
-- pacing_params reads the parameters of the rule from the run's params hash.
local function pacing_params(params_key)
  local p = redis.call('HMGET', params_key, @PARAM_NAMES@)
  return {@PARAM_FIELDS@}
end
-- pacing.ahead
local function pacing_ahead(pace)
  if pace.lookahead and pace.lookahead < pace.max_staleness then return pace.lookahead end
  return pace.max_staleness
end
-- pacing.insert_room: the largest n with Reverb's CanInsert(n)
local function limiter_insert_room(pace, inserts, sampled)
  local max_diff = pace.samples_per_insert * pace.min_size_to_sample + pace.error_buffer
  local room = math.floor((max_diff + sampled) / pace.samples_per_insert) - inserts
  if pace.min_size_to_sample - inserts > room then room = pace.min_size_to_sample - inserts end
  return room
end
-- pacing.admission_budget, before it is clipped at 0 (a negative budget admits nothing)
local function admission_budget(pace, updates, admitted, inflight, inserts, sampled)
  local budget = (pacing_ahead(pace) + updates + 1) * pace.batch_size - admitted
  if pace.samples_per_insert > 0 then
    local room = limiter_insert_room(pace, inserts + inflight, sampled)
    if room < budget then budget = room end
  end
  return budget
end
-- the ratio half of pacing.can_sample (replay_draw.lua checks the table size itself)
local function limiter_can_sample(pace, inserts, sampled, n)
  if pace.samples_per_insert <= 0 then return true end
  local min_diff = pace.samples_per_insert * pace.min_size_to_sample - pace.error_buffer
  return inserts * pace.samples_per_insert - (sampled + n) >= min_diff
end
-- an entry of n samples drawn `uses` times leaves the table: forgive the draws it still owed
local function limiter_forgive(counters_key, spi, n, uses)
  if spi > uses then incrf(counters_key, C.rl_samples, n * (spi - uses)) end
end
"""

#: Parameters the Lua reads as numbers with a default when unset; ``lookahead`` unset is None
#: (``false`` in Lua), every other unset one is 0 (``samples_per_insert`` 0: the limiter is off).
_LUA_DEFAULTS = {"lookahead": "false"}


def lua() -> str:
    """The Lua twins, with the parameter names filled in (for :func:`buffer.scripts.preamble`)."""
    names = ", ".join(f"'{n}'" for n in PARAMS)
    fields = ", ".join(f"{n} = num(p[{i}], {_LUA_DEFAULTS.get(n, '0')})" for i, n in enumerate(PARAMS, start=1))
    return _LUA.replace("@PARAM_NAMES@", names).replace("@PARAM_FIELDS@", fields)
