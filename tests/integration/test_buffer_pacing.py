"""The pacing rule's two versions agree: claim.lua on a real Redis and buffer.pacing in Python.

For every state of a grid (run parameters x learner version and updates x counters) the test writes the
state into Redis and asks the Lua twice: ``claim.lua`` with ``max_prompts`` 0 returns the
budget it computes without claiming, and a real claim admits some prompts. Both must equal what
:func:`buffer.pacing.admission_budget` says for the same state: the budget (the Lua's is not
clipped at 0), and ``budget // group_size`` prompts admitted (each reserves group_size samples).
"""

from __future__ import annotations

import itertools
import time

import pytest

from buffer import pacing
from buffer.metrics import read_counters
from buffer.scripts import claim_keys
from buffer_clients import Clients
from rlhf_core.config import BufferConfig
from rlhf_core.records import Prompt
from servers import RedisServer

pytestmark = pytest.mark.integration

BATCH, GROUP = 8, 2
MAX_STALENESS = (0, 1, 2, 4)
LOOKAHEAD = (None, 0, 1, 3)
#: (learner version, updates its weights hold): equal, renumbered past them after a restart (the
#: budget counts the updates), and a run's data without the updates key (the version stands in)
LEARNER = ((0, 0), (1, 1), (9, 5), (5, None))
#: More than any state admits: (4 + 5 + 1) * 8 / 2 = 40 prompts at most.
MAX_PROMPTS = 64
# replay mode without a limiter paces like FIFO; with one, the limiter caps the budget too
MODES = {
    "fifo": {},
    "replay": {"max_reuse": 2},
    "replay_limited": {"max_reuse": 4, "samples_per_insert": 2.0, "min_size_to_sample": 8, "error_buffer": 8.0},
}
#: admitted x inflight (samples); budget_returned varies along to show neither side reads it
#: (admitted is already net of what came back)
ADMITTED, INFLIGHT = (0, 6, 8, 23, 40, 120), (0, 4, 16)
#: (rl_inserts, rl_samples) for the limiter; rl_samples is fractional when draws were forgiven
#: (with spi 2, min_size 8, error_buffer 8 the room is floor((24 + rl_samples) / 2) - rl_inserts - inflight:
#: small, zero or negative for the first four, above most pacing budgets for the last)
LIMITER = ((0, 0), (10, 4), (40, 70.5), (100, 20), (20, 150.5))


def _states(limited: bool):
    limiter = LIMITER if limited else ((0, 0),)
    for i, ((version, updates), admitted, inflight, (inserts, sampled)) in enumerate(
            itertools.product(LEARNER, ADMITTED, INFLIGHT, limiter)):
        yield {"version": version, "updates": updates, "admitted": admitted, "inflight": inflight,
               "rl_inserts": inserts, "rl_samples": sampled, "budget_returned": 8 * (i % 3)}


def _updates(state: dict) -> int:
    """What pacing counts in ``state``."""
    return state["version"] if state["updates"] is None else state["updates"]


@pytest.fixture(scope="module")
def pacing_redis_url(tmp_path_factory):
    """One private redis-server for the whole grid, without AOF: this checks arithmetic, not
    durability, and thousands of fsynced writes would take most of a minute."""
    server = RedisServer(tmp_path_factory.mktemp("redis"), appendonly=False).start()
    yield server.url
    server.stop()


class Rig:
    """One run of the grid: its clients, a consumer whose leases never expire, prompts kept waiting."""

    def __init__(self, url: str, mode: str, max_staleness: int, lookahead: int | None) -> None:
        cfg = BufferConfig(lookahead=lookahead, lease_timeout_s=3600.0, **MODES[mode])
        self.buf = Clients.connect(url, f"pacing-{mode}-{max_staleness}-{lookahead}", cfg)
        self.params = self.buf.learner.init_run(batch_size=BATCH, group_size=GROUP, max_staleness=max_staleness)
        assert self.params["mode"] == ("fifo" if mode == "fifo" else "replay")
        self.waiting = 0
        self.enqueued = 0

    def set_state(self, state: dict) -> None:
        self.buf.learner.set_learner_version(state["version"], state["updates"])
        if state["updates"] is None:
            self.buf.redis.delete(self.buf.keys.updates)
        counters = {n: state[n] for n in (*pacing.COUNTERS, "budget_returned")}
        self.buf.redis.hset(self.buf.keys.counters, mapping=counters)

    def lua_budget(self) -> int:
        """claim.lua's budget for the state in Redis, claiming nothing (max_prompts 0)."""
        k = self.buf.keys
        res = self.buf.store.scripts.claim(keys=claim_keys(k), args=["pacing-probe", 0, 3_600_000, repr(time.time()), 100])
        assert res[0] == b"ok" and len(res) == 4, res
        return int(res[3])

    def claim(self) -> int:
        """Prompts one claim admits (with more than enough waiting)."""
        if self.waiting < MAX_PROMPTS:
            n = 4 * MAX_PROMPTS
            self.buf.producer.enqueue_prompts(Prompt(f"q{self.enqueued + i}", "x") for i in range(n))
            self.enqueued += n
            self.waiting += n
        leases = self.buf.worker.claim("pacing-worker", MAX_PROMPTS)
        self.waiting -= len(leases)
        assert all(lease.how == "new" for lease in leases)  # nothing released or expired in the way
        return len(leases)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_lua_and_python_pacing_agree_over_a_grid_of_states(pacing_redis_url, mode):
    limited = "samples_per_insert" in MODES[mode]
    mismatches: list[str] = []
    budgets: set[int] = set()
    limiter_binds = pacing_binds = 0
    for max_staleness, lookahead in itertools.product(MAX_STALENESS, LOOKAHEAD):
        rig = Rig(pacing_redis_url, mode, max_staleness, lookahead)
        for state in _states(limited):
            rig.set_state(state)
            python = pacing.admission_budget(rig.params, _updates(state), state)
            assert rig.buf.monitor.admission_budget() == python  # the monitor reads the same state back
            lua = rig.lua_budget()
            admitted = rig.claim()
            after = {**state, "admitted": state["admitted"] + GROUP * admitted, "inflight": state["inflight"] + GROUP * admitted}
            python_after = pacing.admission_budget(rig.params, _updates(state), after)
            stored = read_counters(rig.buf.redis.hgetall(rig.buf.keys.counters))
            got = (max(0, lua), admitted, python_after, (stored["admitted"], stored["inflight"]))
            want = (python, min(MAX_PROMPTS, python // GROUP), max(0, lua - GROUP * admitted), (after["admitted"], after["inflight"]))
            if got != want:
                mismatches.append(f"max_staleness={max_staleness} lookahead={lookahead} {state}: "
                                  f"(lua budget, admitted, budget after, counters after) {got} != {want}")
            budgets.add(python)
            if limited:
                ins = state["rl_inserts"] + state["inflight"]
                room = pacing.insert_room(ins, state["rl_samples"], 2.0, 8, 8.0)
                pace = (pacing.ahead(max_staleness, lookahead) + _updates(state) + 1) * BATCH - state["admitted"]
                limiter_binds += room < pace and room > 0
                pacing_binds += pace < room and pace > 0
        rig.buf.monitor.delete_run()
        rig.buf.close()
    assert not mismatches, f"{len(mismatches)} state(s) disagree:\n" + "\n".join(mismatches[:20])
    # the grid is not degenerate: empty, partial and full budgets (at most (4 + 5 + 1) * 8 = 80
    # samples), and with the limiter each of the two caps decides some states
    assert 0 in budgets and len(budgets) >= 10, sorted(budgets)
    if limited:
        assert limiter_binds > 20 and pacing_binds > 20, (limiter_binds, pacing_binds)
    else:
        assert max(budgets) == 80, sorted(budgets)
