"""The asynchronous pipeline as the code behaves, as a discrete-event simulation (pure: no I/O).

* **Admission** (``buffer/pacing.py``): a claim admits whole prompts while ``admitted +
  group_size <= (ahead + learner_version + 1) * batch_size`` (no learner restarts are modelled,
  so updates = version); a lease carries the buffer's version and the worker pulls weights at
  least that new before it generates. Dropped stale groups give their budget back.
* **Workers**: each a :class:`~rlhf_run.plan.sim_worker.SimWorker`.
* **Learner** (``learner/trainer.py``): read ``batch_size / G`` groups (the too stale dropped),
  update, snapshot and send on the publish thread (the next publish and a checkpoint wait for the
  send), a checkpoint every ``checkpoint_every``; the send's end is the weight server's commit and
  the buffer's new version.

The processes share the machine through :mod:`rlhf_run.plan.des`.
"""

from __future__ import annotations

import itertools
import random
from collections import deque
from collections.abc import Callable
from dataclasses import replace

from rlhf_run.plan.des import CPU, SLEEP, WAIT, Kernel, Proc, Signal
from rlhf_run.plan.profile import Lengths, Profile
from rlhf_run.plan.records import Plan, SimResult
from rlhf_run.plan.sim_worker import Group, SimWorker

LAUNCHER_PERIOD_S = 1.0  # rlhf_run.progress samples the buffer once a second


class _Sampler:
    """Draws from an empirical distribution, a few thousand at a time."""

    def __init__(self, lengths: Lengths, rng: random.Random) -> None:
        self.values = [max(1, int(v)) for v in lengths.values]
        self.cum = list(itertools.accumulate(float(w) for w in lengths.weights))
        self.rng = rng
        self.pool: list[int] = []
        self.at = 0

    def __call__(self, k: int) -> list[int]:
        if len(self.values) == 1:
            return self.values * k
        if self.at + k > len(self.pool):
            self.pool = self.rng.choices(self.values, cum_weights=self.cum, k=max(4096, k))
            self.at = 0
        self.at += k
        return self.pool[self.at - k:self.at]


class Simulation:
    """One simulated run of ``plan`` with ``profile``'s costs. ``run()`` returns a :class:`SimResult`."""

    def __init__(self, profile: Profile, plan: Plan, seed: int = 0, background: float | None = None) -> None:
        if plan.workers < 1:
            raise ValueError("the simulation needs at least one worker")
        self.p, self.plan = profile, plan
        m = profile.machine
        mode = "cpu" if profile.kind == "cpu" else "device"
        self.k = Kernel(mode, cores=m.cores, contention=m.contention,
                        background=m.background if background is None else background,
                        handoff=m.handoff_s, handoff_busy=m.handoff_busy_s)
        rng = random.Random(seed)
        self.response_len: Callable[[int], list[int]] = _Sampler(profile.generation.response_tokens, rng)
        self.prompt_len: Callable[[int], list[int]] = _Sampler(profile.generation.prompt_tokens, rng)
        # the buffer
        self.buffer_version = 0  # the learner version the buffer knows (after a publish)
        self.server_version = 0  # newest version the weight server committed
        self.admitted = 0
        self.stream: deque[Group] = deque()  # appended, not read
        self.budget = Signal()
        self.appended = Signal()
        self.sent = Signal()
        self.sending = False
        self.send_queue: deque[int] = deque()
        self.send_signal = Signal()
        self.pulling = 0
        # the learner
        self.version = 0
        self.updates = 0
        self.carry: deque[Group] = deque()
        # accounting
        self.claimed = self.generated = self.trained = self.dropped = 0
        self.in_learner = 0  # samples of the batch being trained
        self.max_over = -10**9
        self.min_margin: float = 10**9
        self.hist: list[int] = []
        self.marks: list[tuple[float, int, int, float, float]] = []  # per update: time, trained, generated, idle, depth
        self.idle_s = 0.0
        self.warmup = 0
        self.depth_area = 0.0
        self._depth_t = 0.0
        self.depth = 0  # samples appended and not read into an update, nor dropped (stream + carry)
        self.max_lag = 0  # the largest lag the staleness filter saw
        self.workers = [SimWorker(self, i) for i in range(plan.workers)]
        self.roles: dict[str, list[Proc]] = {"learner": [], "workers": [], "launcher": []}

    # ------------------------------------------------------------------ buffer

    def _depth(self) -> int:
        return sum(g.size for g in self.stream) + sum(g.size for g in self.carry)

    def track_depth(self) -> None:
        now = self.k.now
        self.depth_area += self.depth * (now - self._depth_t)
        self._depth_t = now

    def budget_left(self) -> int:
        return (self.plan.ahead + self.buffer_version + 1) * self.plan.batch_size - self.admitted

    def claim(self, w: SimWorker, capacity: int) -> int:
        """claim.lua: admit up to ``capacity`` prompts within the budget; returns how many."""
        plan, g = self.plan, self.plan.group_size
        bound = (plan.ahead + self.buffer_version + 1) * plan.batch_size
        n = min(capacity, max(0, bound - self.admitted) // g)
        if n:
            self.admitted += n * g
            self.claimed += n * g
            self.max_over = max(self.max_over, self.admitted - bound)
        return n

    def _budget_changed(self) -> None:
        """Wake blocked claimers, and the busy workers that found no budget at their next back-off end."""
        self.k.fire(self.budget)
        for w in self.workers:
            w.budget_changed()

    def _return_budget(self, samples: int) -> None:
        self.admitted -= samples
        self._budget_changed()

    def append(self, groups: list[Group], samples: int) -> None:
        """append.lua: scored groups enter the stream; the learner is woken."""
        self.track_depth()
        for grp in groups:
            self.min_margin = min(self.min_margin, grp.oldest - grp.lease_version)
            self.stream.append(grp)
        self.generated += samples
        self.depth += samples
        self.k.fire(self.appended)

    def trip(self):
        """A round trip to Redis or the weight server: the request wakes it, the reply the caller."""
        delay = self.k.handoff_s(2)
        if delay > 0.0:
            yield SLEEP, delay

    # ------------------------------------------------------------------ learner

    def learner(self):
        p, plan, k = self.p, self.plan, self.k
        lc = p.learner
        want = plan.batch_size // plan.group_size
        tokens_per_sample = p.generation.prompt_tokens.mean() + p.generation.response_tokens.mean()
        while True:
            yield CPU, lc.read_base
            yield from self.trip()
            t_wait = k.now
            checked = 0  # groups at the head of carry that passed the filter at this version
            while True:
                carry = self.carry
                if checked < len(carry):  # _filter: drop what is too stale for this version (the rest passed)
                    fresh = [carry.pop() for _ in range(len(carry) - checked)]
                    for grp in reversed(fresh):
                        lag = self.version - grp.oldest
                        if lag > self.max_lag:
                            self.max_lag = int(lag)
                        if lag > plan.max_staleness:
                            self.track_depth()
                            self.dropped += grp.size
                            self.depth -= grp.size
                            self._return_budget(grp.size)
                        else:
                            carry.append(grp)
                    checked = len(carry)
                if len(self.carry) >= want:
                    break
                if self.stream:
                    while self.stream and len(self.carry) < want:
                        self.carry.append(self.stream.popleft())
                    continue
                yield WAIT, self.appended, None
            self.idle_s += k.now - t_wait
            self.track_depth()
            batch = [self.carry.popleft() for _ in range(want)]
            samples = sum(grp.size for grp in batch)
            self.depth -= samples
            self.in_learner = samples
            # decoding and checking the samples, then the update (one job: nothing happens between)
            yield CPU, lc.read_per_sample * samples + lc.update_s(samples, samples * tokens_per_sample, plan.micro_batch_size, plan.learner_devices,
                                   plan.zero_stage, p.machine.gpus_per_node)
            for grp in batch:
                lag = int(self.version - grp.oldest)
                while len(self.hist) <= lag:
                    self.hist.append(0)
                if self.updates >= self.warmup:  # the window the rates are measured over
                    self.hist[lag] += grp.size
            self.trained += samples
            self.in_learner = 0
            self.version += 1
            self.updates += 1
            while self.sending:  # publish(): one send in flight at most
                yield WAIT, self.sent, None
            yield CPU, p.sync.snapshot_s()
            self.sending = True
            self.send_queue.append(self.version)
            k.fire(self.send_signal)
            yield CPU, lc.per_update
            if self.updates % plan.checkpoint_every == 0:
                while self.sending:
                    yield WAIT, self.sent, None
                yield CPU, lc.checkpoint_time(plan.learner_devices, p.machine.gpus_per_node)
            self.marks.append((k.now, self.trained, self.generated, self.idle_s, self.depth_area))

    def publisher(self):
        """The learner's publish thread: send, then the server commits and announces, then the
        buffer learns the new version (pacing admits one more batch)."""
        k = self.k
        while True:
            if not self.send_queue:
                yield WAIT, self.send_signal, None
                continue
            version = self.send_queue.popleft()
            yield CPU, self.p.sync.send_s()
            yield from self.trip()  # to the weight server
            self.server_version = version
            for w in self.workers:
                w.announced = version
                w.poke()
            yield from self.trip()  # the buffer's version
            self.buffer_version = version
            self._budget_changed()
            self.sending = False
            k.fire(self.sent)

    def launcher(self):
        while True:
            yield SLEEP, LAUNCHER_PERIOD_S
            yield CPU, self.p.machine.launcher_per_s * LAUNCHER_PERIOD_S

    # ------------------------------------------------------------------ run

    def invariants(self) -> list[str]:
        """What does not hold now (empty: all is well): pacing's bound, the conservation of
        samples, the staleness bound of what was trained."""
        plan, bad = self.plan, []
        bound = (plan.ahead + self.buffer_version + 1) * plan.batch_size
        in_flight = sum(g.size for w in self.workers for g in w.open)
        if self.admitted > bound:
            bad.append(f"admitted {self.admitted} > bound {bound}")
        if self.claimed != self.generated + in_flight:
            bad.append(f"claimed {self.claimed} != generated {self.generated} + in flight {in_flight}")
        if self.depth != self._depth():
            bad.append(f"the buffer's depth counter {self.depth} != the samples in it {self._depth()}")
        if self.generated != self.trained + self.dropped + self._depth() + self.in_learner:
            bad.append(f"generated {self.generated} != trained {self.trained} + dropped {self.dropped} + "
                       f"in buffer {self._depth()} + being trained {self.in_learner}")
        if self.admitted != self.claimed - self.dropped:
            bad.append(f"admitted {self.admitted} != claimed {self.claimed} - dropped {self.dropped}")
        if len(self.hist) > plan.max_staleness + 1 and any(self.hist[plan.max_staleness + 1:]):
            bad.append(f"trained samples staler than {plan.max_staleness}: {self.hist}")
        return bad

    def run(self, updates: int = 300, warmup: int = 20, max_sim_s: float = 3600.0 * 24,
            check: bool = False) -> SimResult:
        """``check``: test :meth:`invariants` after every event (slow; for tests)."""
        k = self.k
        self.warmup = warmup
        self.roles["learner"] += [k.spawn(self.learner(), "learner"), k.spawn(self.publisher(), "publisher")]
        for w in self.workers:
            w.proc = k.spawn(w.loop(), f"worker-{w.index}")
            self.roles["workers"] += [w.proc, k.spawn(w.scorer(), f"scorer-{w.index}")]
        if self.p.machine.launcher_per_s > 0:
            self.roles["launcher"].append(k.spawn(self.launcher(), "launcher"))
        self.violations: list[tuple[float, str]] = []

        def stop() -> bool:
            if check:
                self.violations += [(k.now, v) for v in self.invariants()]
            return self.updates >= updates

        k.run(max_sim_s, stop=stop)
        return self._result(warmup)

    def _result(self, warmup: int) -> SimResult:
        marks = self.marks
        first = marks[min(warmup, len(marks) - 1)] if marks else (0.0, 0, 0, 0.0, 0.0)
        last = marks[-1] if marks else first
        window = last[0] - first[0]
        n_up = max(1, len(marks) - 1 - min(warmup, len(marks) - 1))
        hist = self.hist
        total = sum(hist)
        in_flight = sum(g.size for w in self.workers for g in w.open)
        cpu = {role: 1e3 * sum(proc.cpu_s for proc in procs) / max(1, self.updates) for role, procs in self.roles.items()}
        cpu["total"] = sum(cpu.values())
        return SimResult(
            updates=self.updates, sim_s=self.k.now, window_s=window,
            trained_samples_per_s=(last[1] - first[1]) / window if window > 0 else 0.0,
            generated_samples_per_s=(last[2] - first[2]) / window if window > 0 else 0.0,
            staleness_mean=sum(i * c for i, c in enumerate(hist)) / total if total else 0.0,
            staleness_hist=list(hist),
            learner_idle_frac=(last[3] - first[3]) / window if window > 0 else 0.0,
            buffer_depth_mean=(last[4] - first[4]) / window if window > 0 else float(self._depth()),
            samples_admitted=self.admitted, samples_generated=self.generated, samples_trained=self.trained,
            samples_dropped=self.dropped, samples_in_buffer=self._depth(), samples_in_flight=in_flight,
            max_admitted_over_bound=self.max_over, min_version_margin=int(self.min_margin) if self.min_margin < 10**9 else 0,
            max_lag_seen=self.max_lag,
            cpu_per_update_ms=cpu if n_up else {}, events=self.k.events,
            background_cores_used=self.k.background_used / self.k.now if self.k.now > 0 else 0.0)


def same_run(plan: Plan, result: SimResult, other: Plan) -> bool:
    """Whether simulating ``other`` (same seed and length) replays ``result``, ``plan``'s run: the
    staleness bound acts only in the learner's filter, so a plan that differs only in it, with the
    same (explicit) lookahead, runs the same events if that run dropped nothing and the bound is at
    least the largest lag the filter saw."""
    return (replace(other, max_staleness=plan.max_staleness) == plan and other.ahead == plan.ahead
            and result.samples_dropped == 0 and result.max_lag_seen <= other.max_staleness)


def background_demand(profile: Profile, plan: Plan, used: float, updates: int = 300, warmup: int = 20) -> tuple[float, SimResult]:
    """Other jobs' demand (runnable threads) under which the simulated run leaves them ``used``
    cores, as they got during a measured run: the cores they used depend on how busy ours were,
    so the measured use is matched, not copied (bisection; returns it and the simulation)."""
    best = simulate(profile, plan, updates=updates, warmup=warmup, background=0.0)
    if used <= 0.01:
        return 0.0, best
    lo, hi = 0.0, 6.0
    # a loaded machine (other jobs' load average far above the cores) needs more than 6: widen
    while hi < 256 and simulate(profile, plan, updates=updates, warmup=warmup, background=hi).background_cores_used < used:
        lo, hi = hi, 2 * hi
    for _ in range(10):
        mid = (lo + hi) / 2
        sim = simulate(profile, plan, updates=updates, warmup=warmup, background=mid)
        if sim.background_cores_used < used:
            lo = mid
        else:
            hi = mid
        best = sim
    return (lo + hi) / 2, best


def simulate(profile: Profile, plan: Plan, updates: int = 300, warmup: int = 20, seed: int = 0,
             background: float | None = None) -> SimResult:
    """Simulate ``updates`` learner updates of ``plan`` (rates over those after ``warmup``).
    ``background``: other jobs' runnable threads (CPU profiles; default: the profile's
    ``machine.background``)."""
    return Simulation(profile, plan, seed=seed, background=background).run(updates=updates, warmup=warmup)
