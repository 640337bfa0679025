"""A small discrete-event kernel: generator processes, timers, signals and a shared processor.

Each process is a generator that yields commands and is resumed with their result:

* ``(CPU, work)``: run ``work`` seconds of computation (as measured alone on an idle core);
  how long it takes depends on how many threads are busy at the same time (below);
* ``(STEPS, n, per_step)``: ``n`` steps of ``per_step`` work each, as one job that
  :meth:`Kernel.interrupt` can cut short at the end of the step in progress; resumed with the
  number of steps done;
* ``(SLEEP, seconds)``: wall-clock wait;
* ``(WAIT, signal, timeout)``: until ``signal`` fires (resumed with True, a hand-off later:
  below) or ``timeout`` seconds pass (False; ``None``: no timeout).

Processor sharing. In ``cpu`` mode every busy thread gets an equal share of ``cores``, slowed
while others are busy: with ``k`` of our threads and ``background`` other threads busy, each
progresses at ``min(1, cores / n) / slowdown(n)``, ``n = k + background``, ``slowdown`` rising
linearly from 1 (one thread) to ``contention`` (two or more). The equal share lets one global
counter of work done per busy thread stand for every job's progress: a job started at counter
``v`` with ``w`` to do ends when the counter reaches ``v + w``, so jobs sit in a heap by that
number and rate changes cost nothing. In ``device`` mode each process runs at full speed.

Hand-offs. A thread woken by another (a signal, a reply) runs only once it gets a core:
:meth:`Kernel.handoff_s` is ``handoff`` when a core is free, plus ``handoff_busy`` for each
runnable thread beyond the cores (ours computing, the background's demand, and the woken one).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable, Generator
from typing import Any

CPU, STEPS, SLEEP, WAIT = range(4)

Process = Generator[tuple, Any, None]


class Signal:
    """Something processes wait for; :meth:`Kernel.fire` wakes every waiter."""

    __slots__ = ("waiters",)

    def __init__(self) -> None:
        self.waiters: list[tuple[Proc, int]] = []


class Proc:
    """A running process and the bookkeeping of what it waits for."""

    __slots__ = ("gen", "name", "token", "job", "cpu_s", "busy_s", "since")

    def __init__(self, gen: Process, name: str) -> None:
        self.gen, self.name = gen, name
        self.token = 0  # bumped at every resume: a timer or wake-up with an older token is stale
        self.job: tuple[float, float, int] | None = None  # STEPS: (counter at start, per step, steps)
        self.cpu_s = 0.0  # core-seconds used (what `ps` would show)
        self.busy_s = 0.0  # wall seconds spent computing
        self.since = (0.0, 0.0)  # (time, share counter) when the current job started


class _Call:
    """A plain callback on the timer heap (``call_at``): its entry's token is -1, never stale."""

    __slots__ = ("fn",)
    token = -1

    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn = fn


class Kernel:
    def __init__(self, mode: str = "cpu", cores: float = 2.0, contention: float = 1.0, background: float = 0.0,
                 handoff: float = 0.0, handoff_busy: float = 0.0) -> None:
        if mode not in ("cpu", "device"):
            raise ValueError(f"mode must be cpu or device, got {mode!r}")
        self.device = mode == "device"
        self.cores, self.contention, self.background = float(cores), float(contention), float(background)
        self.handoff, self.handoff_busy = float(handoff), float(handoff_busy)
        self.now = 0.0
        self.work = 0.0  # work done by each busy thread since the start (the shared counter)
        self.share = 0.0  # core-seconds used by each busy thread since the start
        self.background_used = 0.0  # core-seconds the background threads got
        self.busy = 0
        self.events = 0
        self._seq = itertools.count()
        self._timers: list[tuple[float, int, Proc | _Call, int, Any]] = []
        self._jobs: list[tuple[float, int, Proc, int]] = []
        self._ready: deque[tuple[Proc, Any]] = deque()
        self._rates = [self._rate(k) for k in range(64)]
        self._shares = [self._core_share(k) for k in range(64)]

    # ------------------------------------------------------------------ rates

    def rate(self, busy: int) -> float:
        """Work per second of each busy thread when ``busy`` of ours are busy."""
        return self._rates[busy] if busy < 64 else self._rate(busy)

    def _rate(self, busy: int) -> float:
        if self.device:
            return 1.0
        if busy == 0:
            return 1.0
        n = busy + self.background
        slow = 1.0 + (self.contention - 1.0) * min(1.0, max(0.0, n - 1.0))
        return min(1.0, self.cores / n) / slow

    def _core_share(self, busy: int) -> float:
        """The share of a core each busy thread (ours or the background's) gets."""
        return 1.0 if self.device else min(1.0, self.cores / max(1e-9, busy + self.background))

    def handoff_s(self, trips: int = 1) -> float:
        """Wall seconds before ``trips`` hand-offs in a row have each got a core (a round trip to
        another process is two: the request wakes it, the reply wakes the caller)."""
        if self.device:
            return trips * self.handoff
        queued = max(0.0, self.busy + self.background + 1.0 - self.cores)
        return trips * (self.handoff + self.handoff_busy * queued)

    # ------------------------------------------------------------------ processes

    def call_at(self, t: float, fn: Callable[[], None]) -> None:
        """Call ``fn()`` at time ``t`` (a plain callback, no process)."""
        heapq.heappush(self._timers, (t, next(self._seq), _Call(fn), _Call.token, None))

    def spawn(self, gen: Process, name: str = "") -> Proc:
        proc = Proc(gen, name)
        self._ready.append((proc, None))
        return proc

    def fire(self, signal: Signal, value: Any = True) -> None:
        waiters, signal.waiters = signal.waiters, []
        delay = self.handoff_s() if waiters else 0.0
        for proc, token in waiters:
            if proc.token != token:
                continue
            if delay > 0.0:  # resumed when it gets a core; its timeout, if sooner, still wins (same token)
                heapq.heappush(self._timers, (self.now + delay, next(self._seq), proc, token, value))
            else:
                self._ready.append((proc, value))

    def interrupt(self, proc: Proc) -> None:
        """End ``proc``'s STEPS job after the step in progress (no-op if it is not in one)."""
        if proc.job is None:
            return
        start, per_step, steps = proc.job
        done = int((self.work - start) / per_step + 1e-9) + 1  # the step in progress finishes
        if done < steps:
            proc.job = (start, per_step, done)
            proc.token += 1  # the job's old heap entry is stale now
            heapq.heappush(self._jobs, (start + done * per_step, next(self._seq), proc, proc.token))

    def _dispatch(self, proc: Proc, value: Any) -> None:
        proc.token += 1
        proc.job = None
        try:
            cmd = proc.gen.send(value)
        except StopIteration:
            return
        kind = cmd[0]
        if kind == CPU or kind == STEPS:
            if kind == CPU:
                work, result = cmd[1], None
            else:
                steps, per_step = int(cmd[1]), float(cmd[2])
                work, result = steps * per_step, steps
                proc.job = (self.work, per_step, steps)
            if work <= 0.0:
                self._ready.append((proc, result))
                return
            heapq.heappush(self._jobs, (self.work + work, next(self._seq), proc, proc.token))
            self.busy += 1
            proc.since = (self.now, self.share)
        elif kind == SLEEP:
            heapq.heappush(self._timers, (self.now + max(0.0, cmd[1]), next(self._seq), proc, proc.token, None))
        elif kind == WAIT:
            signal, timeout = cmd[1], cmd[2]
            signal.waiters.append((proc, proc.token))
            if timeout is not None:
                heapq.heappush(self._timers, (self.now + max(0.0, timeout), next(self._seq), proc, proc.token, False))
        else:
            raise ValueError(f"{proc.name}: unknown command {cmd!r}")

    # ------------------------------------------------------------------ the loop

    def run(self, until: float, stop: Callable[[], bool] | None = None) -> None:
        """Advance to ``until`` (seconds) or until ``stop()`` is true after an event (the hot loop:
        written with locals, the time advance inlined)."""
        jobs, timers, ready = self._jobs, self._timers, self._ready
        rates, shares = self._rates, self._shares
        dispatch, heappop, inf = self._dispatch, heapq.heappop, math.inf
        while True:
            while ready:
                proc, value = ready.popleft()
                dispatch(proc, value)
            if stop is not None and stop():
                return
            while jobs and jobs[0][2].token != jobs[0][3]:
                heappop(jobs)
            while timers and timers[0][3] >= 0 and timers[0][2].token != timers[0][3]:
                heappop(timers)
            busy = self.busy
            rate = rates[busy] if busy < 64 else self._rate(busy)
            t_job = self.now + (jobs[0][0] - self.work) / rate if jobs else inf
            t_timer = timers[0][0] if timers else inf
            t = t_job if t_job <= t_timer else t_timer
            if t > until:
                t = until
            dt = t - self.now
            if dt > 0.0:
                share = shares[busy] if busy < 64 else self._core_share(busy)
                if busy:
                    self.work += rate * dt
                    self.share += share * dt
                self.background_used += self.background * share * dt
                self.now = t
            if t == until and t < t_job and t < t_timer:
                return
            self.events += 1
            if t_job <= t_timer:
                key, _, proc, _ = heappop(jobs)
                if key > self.work:
                    self.work = key
                self.busy = busy - 1
                t0, s0 = proc.since
                proc.busy_s += t - t0
                proc.cpu_s += self.share - s0
                job, proc.job = proc.job, None
                ready.append((proc, None if job is None else job[2]))
            else:
                _, _, entry, _, value = heappop(timers)
                if isinstance(entry, Proc):
                    ready.append((entry, value))
                else:
                    entry.fn()
