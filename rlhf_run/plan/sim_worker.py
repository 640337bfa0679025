"""A simulated rollout worker: its loop, its engine's continuous batching and its scoring thread,
as ``rollout_workers/worker.py``, ``hf_engine.py`` and ``scoring.py`` behave (the constants below
are theirs). A response of n tokens finishes after ``max(1, n - 1)`` steps (the prefill pass
samples its first token); steps are simulated in runs until the next finish, cut short at a step
boundary by anything the loop would react to (an announcement, scores coming back, the end of a
claim back-off). The buffer, the weight server and the kernel are the run's (:class:`Pipeline`:
the :class:`~rlhf_run.plan.simulate.Simulation`).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable, Generator
from typing import Protocol

from rlhf_run.plan.des import CPU, SLEEP, STEPS, WAIT, Kernel, Proc, Signal
from rlhf_run.plan.profile import Profile
from rlhf_run.plan.records import Plan

BUSY_CLAIM_BACKOFF_S = 0.05
SCORING_ONLY_SLEEP_S = 0.002
WAKE_CAP_S = 0.2  # buffer.prompts: a blocked claim re-checks at least this often


class Group:
    """A claimed prompt's group of samples on its way from the claim to the learner."""

    __slots__ = ("size", "finished", "scored", "oldest", "lease_version")

    def __init__(self, size: int, lease_version: int) -> None:
        self.size, self.finished, self.scored = size, 0, 0
        self.oldest, self.lease_version = math.inf, lease_version


class Pipeline(Protocol):
    """What a worker uses of the simulated run around it."""

    k: Kernel
    p: Profile
    plan: Plan
    buffer_version: int  # the learner version the buffer knows: a lease carries it
    server_version: int  # the newest version the weight server committed
    pulling: int  # pulls the weight server is serving
    budget: Signal  # fired when pacing's budget changes
    response_len: Callable[[int], list[int]]  # k draws of a response's tokens
    prompt_len: Callable[[int], list[int]]

    def claim(self, w: SimWorker, capacity: int) -> int: ...

    def budget_left(self) -> int: ...

    def append(self, groups: list[Group], samples: int) -> None: ...

    def trip(self) -> Generator: ...


class SimWorker:
    """One rollout worker of ``sim``: :meth:`loop` and :meth:`scorer` are its two processes."""

    def __init__(self, sim: Pipeline, index: int) -> None:
        self.sim = sim
        self.index = index
        self.version = -1
        self.announced = -1
        self.proc: Proc | None = None
        self.step = 0  # engine steps run
        # running rows, aggregated: heap of (finish step, seq, group, rows, their final summed context)
        self.running: list[tuple[int, int, Group, int, int]] = []
        self.seq = itertools.count()
        self.rows = 0
        self.ctx = 0.0  # summed context of the running rows
        self.waiting: deque[list] = deque()  # per group: [group, response lengths, prompt lengths]
        self.n_waiting = 0
        self.open: list[Group] = []  # claimed groups not appended yet
        self.score_queue: deque[list] = deque()  # [group, samples not taken, submitted at]
        self.scoring = 0  # samples waiting, being scored, or scored and not collected
        self.score_waiting = 0
        self.answered: list[tuple[Group, int]] = []
        self.score_signal = Signal()
        self.flush = False
        self.next_claim_at = 0.0
        self.blocked_at: float | None = None  # a claim found no budget then: retries wait for a budget change
        self.owed_claims = 0  # failed retries skipped while blocked (their CPU is paid at the next claim)
        self.in_steps = False
        self.claimable = False  # capacity > 0 during the current run of steps (a back-off end cuts it)

    def busy(self) -> int:
        return self.rows + self.n_waiting + self.scoring

    def poke(self) -> None:
        """Cut a run of engine steps short at the step in progress: the loop has something to do."""
        if self.in_steps:
            assert self.proc is not None  # steps run in the worker's process
            self.sim.k.interrupt(self.proc)

    def budget_changed(self) -> None:
        """A busy worker that found no budget retries at its next back-off end after now (the
        retries before it would have failed: skipped, their CPU owed)."""
        if self.blocked_at is None:
            return
        k = self.sim.k
        periods = max(1, math.ceil((k.now - self.blocked_at) / BUSY_CLAIM_BACKOFF_S - 1e-9))
        self.owed_claims += periods - 1
        self.next_claim_at = self.blocked_at + periods * BUSY_CLAIM_BACKOFF_S
        self.blocked_at = None
        if self.in_steps and self.claimable:
            k.call_at(self.next_claim_at, self._backoff_over)

    def _backoff_over(self) -> None:
        if self.in_steps and self.claimable:
            self.poke()

    def _pull(self):
        sim = self.sim
        sim.pulling += 1
        want = sim.server_version
        yield CPU, sim.p.sync.pull_s(sim.pulling)
        yield from sim.trip()
        sim.pulling -= 1
        self.version = max(self.version, want)

    def loop(self):
        sim = self.sim
        plan, k = sim.plan, sim.k
        wc, g = sim.p.worker, plan.group_size
        yield from self._pull()  # a worker starts with the newest version
        while True:
            idle = not self.rows and not self.n_waiting and not self.open
            capacity = max(0, (plan.slots + g - 1 - self.busy()) // g)
            if capacity > 0 and (idle or (self.blocked_at is None and k.now >= self.next_claim_at)):
                yield CPU, wc.claim_call * (1 + self.owed_claims)
                yield from sim.trip()
                self.owed_claims, self.blocked_at = 0, None
                n = sim.claim(self, capacity)
                if not n and idle:
                    # WorkerClient.claim(block_s=0.25) waits on the wake-up stream, which a new version or
                    # returned budget wakes at once; it re-checks every 0.2 s and the loop claims
                    # again every 0.25 s, all in vain until then: sleep through those re-checks
                    # (their CPU is owed) instead of simulating each
                    while not n:
                        t0 = k.now
                        yield WAIT, sim.budget, None
                        yield CPU, wc.claim_call * (1 + int((k.now - t0) / WAKE_CAP_S))
                        yield from sim.trip()
                        n = sim.claim(self, capacity)
                if not n:
                    self.next_claim_at = k.now + BUSY_CLAIM_BACKOFF_S
                    if sim.budget_left() < g:  # nothing to admit until the version or the budget moves
                        self.blocked_at = k.now
                else:
                    lease_version = sim.buffer_version
                    groups = [Group(g, lease_version) for _ in range(n)]
                    self.open += groups
                    if lease_version > self.version:  # pacing: generate with weights >= the lease's version
                        yield from self._pull()
                    yield CPU, wc.per_prompt * n
                    for group in groups:
                        self.waiting.append([group, sim.response_len(g), sim.prompt_len(g)])
                    self.n_waiting += n * g
            if self.rows or self.n_waiting:
                yield from self._steps()
                if self.announced > self.version:
                    yield from self._pull()
            else:
                if self.announced > self.version:
                    yield from self._pull()
                if self.open:
                    yield SLEEP, SCORING_ONLY_SLEEP_S + k.handoff_s()  # then it waits for a core
                yield CPU, wc.per_iteration
            yield from self._emit()

    def _steps(self):
        """One step with the newcomers' prefill, or a run of decoding steps to the next finish."""
        sim = self.sim
        gen, wc, plan = sim.p.generation, sim.p.worker, sim.plan
        newcomers = prompt_tokens = 0
        free = plan.slots - self.rows
        while self.waiting and free > 0:
            entry = self.waiting[0]
            group, lengths, prompts = entry
            take = min(free, len(lengths))
            group.oldest = min(group.oldest, self.version)  # the prefill samples their first tokens now
            # a response of n tokens finishes after max(1, n - 1) steps: the prefill pass gives the
            # first token, the step's decoding pass the second
            finish: dict[int, list[int]] = {}
            for n_tokens, prompt in zip(lengths[:take], prompts[:take]):
                steps = max(1, n_tokens - 1)
                acc = finish.setdefault(steps, [0, 0])
                acc[0] += 1
                acc[1] += prompt + 1 + steps  # what the row adds to the context until it finishes
                prompt_tokens += prompt
            for steps, (rows, ctx) in finish.items():
                heapq.heappush(self.running, (self.step + steps, next(self.seq), group, rows, ctx))
            if take == len(lengths):
                self.waiting.popleft()
            else:
                entry[1], entry[2] = lengths[take:], prompts[take:]
            newcomers += take
            free -= take
        if newcomers:
            self.rows += newcomers
            self.n_waiting -= newcomers
            self.ctx += prompt_tokens + newcomers
        rows = self.rows
        if newcomers:
            yield CPU, gen.prefill_s(newcomers, prompt_tokens) + gen.decode_s(rows, self.ctx) + wc.per_iteration
            done = 1
        else:
            steps = self.running[0][0] - self.step
            capacity = (plan.slots + plan.group_size - 1 - self.busy()) // plan.group_size
            if capacity > 0 and self.blocked_at is None and sim.k.now >= self.next_claim_at:
                steps = 1  # the next loop pass claims
            per_step = gen.decode_s(rows, self.ctx + rows * (steps - 1) / 2) + wc.per_iteration
            self.in_steps = True
            self.claimable = capacity > 0
            if self.claimable and steps > 1 and self.blocked_at is None:
                sim.k.call_at(self.next_claim_at, self._backoff_over)
            done = yield STEPS, steps, per_step
            self.in_steps = False
        self.step += done
        self.ctx += rows * done
        running = self.running
        while running and running[0][0] <= self.step:
            _, _, group, n, ctx = heapq.heappop(running)
            self.rows -= n
            self.ctx -= ctx
            group.finished += n
            if group.finished == group.size:  # scored a whole group at a time
                self.score_queue.append([group, group.size, sim.k.now])
                self.score_waiting += group.size
                self.scoring += group.size
                sim.k.fire(self.score_signal)

    def _emit(self):
        """Collect scores; append every group whose samples are all scored (one round trip)."""
        sim = self.sim
        wc = sim.p.worker
        answered, self.answered = self.answered, []
        for group, n in answered:
            group.scored += n
            self.scoring -= n
        flush = not self.rows and not self.n_waiting
        if flush and not self.flush:
            sim.k.fire(self.score_signal)
        self.flush = flush
        ready = [grp for grp in self.open if grp.scored == grp.size]
        if not ready:
            return
        samples = sum(grp.size for grp in ready)
        yield CPU, wc.emit_call + wc.per_sample_emit * samples
        yield from sim.trip()
        for grp in ready:
            self.open.remove(grp)
        sim.append(ready, samples)

    def scorer(self):
        sim = self.sim
        wc, plan, k = sim.p.worker, sim.plan, sim.k
        while True:
            if not self.score_queue:
                yield WAIT, self.score_signal, None
                continue
            left = plan.reward_max_wait_s - (k.now - self.score_queue[0][2])
            if not (self.flush or self.score_waiting >= plan.reward_batch_size or left <= 1e-9):
                yield WAIT, self.score_signal, left
                continue
            take: list[tuple[Group, int]] = []
            n = 0
            while self.score_queue and n < plan.reward_batch_size:
                entry = self.score_queue[0]
                m = min(entry[1], plan.reward_batch_size - n)
                take.append((entry[0], m))
                entry[1] -= m
                n += m
                if entry[1] == 0:
                    self.score_queue.popleft()
            self.score_waiting -= n
            yield CPU, wc.score_batch + wc.score_sample * n
            self.answered.extend(take)
            self.poke()
