"""The asynchronous pipeline as the code behaves, as a discrete-event simulation (pure: no I/O).

What it models, and where the real code does it:

* **Admission** (``buffer/pacing.py``, ``claim.lua``): a claim admits whole prompts while
  ``admitted + group_size <= (ahead + learner_version + 1) * batch_size``, ``ahead =
  min(max_staleness, lookahead)`` (the code counts the learner's updates, equal to its version
  in a run without learner restarts, which is all this models); the learner's version in the
  buffer moves only when a publish is done; a lease carries that version and the worker pulls
  weights at least that new before it generates (``_claim``). Dropped stale groups give their
  budget back and wake claimers.
* **Worker loop** (``rollout_workers/worker.py``): capacity ``(slots + G - 1 - busy) // G``
  prompts with ``busy`` = running + queued requests + samples in the scoring pool; an idle worker
  blocks in the claim up to 0.25 s (woken by a version or budget change, re-checking every
  0.2 s), a busy one whose claim got nothing waits 50 ms before claiming again; one engine step
  per loop pass, then an announcement poll (a newer version is pulled at once, between steps),
  then finished groups are appended once all their samples are scored; only scoring left:
  2 ms sleeps.
* **Continuous batching** (``hf_engine.py``): ``slots`` rows; a request takes a free row at the
  next step, its prompt is prefilled in that step (the pass samples its first token) and it
  decodes from the same step on; a response of n tokens finishes after ``max(1, n - 1)`` steps;
  each token carries the engine's version when it was sampled (a group's staleness is that of
  its oldest token). Steps are simulated in runs until the next finish, cut short at a step
  boundary by anything the loop would react to (an announcement, scores coming back, the end
  of a claim back-off).
* **Scoring** (``scoring.py``): one thread scores batches of up to ``reward.batch_size`` samples
  once that many wait, the oldest waited ``reward.max_wait_ms``, or generation is idle.
* **Learner** (``learner/trainer.py``): read ``batch_size / G`` groups (staler than
  ``max_staleness`` against its own version are dropped), update, version + 1, snapshot the
  weights and send them on the publish thread (the next publish and a checkpoint wait for the
  send), a metrics line, a checkpoint every ``checkpoint_every`` updates; the send's end is
  the weight server's commit (workers see the announcement) and the buffer's new version.

The processes share the machine through :mod:`rlhf_run.plan.des` (cores and contention for a
CPU profile; a device each for a GPU profile).
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from rlhf_run.plan.des import CPU, SLEEP, STEPS, WAIT, Kernel, Proc, Signal
from rlhf_run.plan.profile import Lengths, Profile

BUSY_CLAIM_BACKOFF_S = 0.05
SCORING_ONLY_SLEEP_S = 0.002
WAKE_CAP_S = 0.2  # buffer.prompts: a blocked claim re-checks at least this often
LAUNCHER_PERIOD_S = 1.0  # rlhf_run.report samples the buffer once a second


@dataclass(frozen=True)
class Plan:
    """The knobs of one run (the Hydra setting each one is)."""

    workers: int = 2  # rollout.num_workers
    slots: int = 32  # rollout.slots
    batch_size: int = 32  # learner.batch_size
    micro_batch_size: int = 32  # learner.micro_batch_size (at most the minibatch: batch_size / num_minibatches)
    num_minibatches: int = 1  # learner.num_minibatches
    group_size: int = 4  # algo.group_size
    max_staleness: int = 2  # algo.max_staleness
    lookahead: int | None = 1  # buffer.lookahead (None: up to max_staleness)
    checkpoint_every: int = 10  # learner.checkpoint_every (>= 1, as rlhf_core.config.validate wants)
    learner_devices: int = 1  # len(learner.devices)
    zero_stage: int = 0  # learner.zero_stage (deepspeed)
    reward_batch_size: int = 32  # reward.batch_size
    reward_max_wait_s: float = 0.010  # reward.max_wait_ms / 1000

    @property
    def ahead(self) -> int:
        return self.max_staleness if self.lookahead is None else min(self.max_staleness, self.lookahead)


@dataclass
class SimResult:
    updates: int
    sim_s: float  # simulated seconds
    window_s: float  # from the warm-up's last update to the last update
    trained_samples_per_s: float
    generated_samples_per_s: float
    staleness_mean: float
    staleness_hist: list[int]  # trained samples per staleness 0, 1, ...
    learner_idle_frac: float  # share of the window the learner waited for a batch
    buffer_depth_mean: float  # samples appended and not yet trained (time average over the window)
    samples_admitted: int
    samples_generated: int
    samples_trained: int
    samples_dropped: int
    samples_in_buffer: int
    samples_in_flight: int  # admitted, not appended yet
    max_admitted_over_bound: int  # <= 0: pacing's bound held at every claim
    min_version_margin: int  # >= 0: every group generated with weights >= its lease's version
    cpu_per_update_ms: dict[str, float] = field(default_factory=dict)  # core-ms per update, by role
    background_cores_used: float = 0.0  # cores the background threads got (their demand is Machine.background)
    max_lag_seen: int = 0  # the largest lag the learner's staleness filter saw (see :func:`same_run`)
    events: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


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


class _Group:
    __slots__ = ("size", "finished", "scored", "oldest", "lease_version")

    def __init__(self, size: int, lease_version: int) -> None:
        self.size, self.finished, self.scored = size, 0, 0
        self.oldest, self.lease_version = math.inf, lease_version


class _Worker:
    def __init__(self, index: int) -> None:
        self.index = index
        self.version = -1
        self.announced = -1
        self.proc: Proc | None = None
        self.step = 0  # engine steps run
        # running rows, aggregated: heap of (finish step, seq, group, rows, their final summed context)
        self.running: list[tuple[int, int, _Group, int, int]] = []
        self.rows = 0
        self.ctx = 0.0  # summed context of the running rows
        self.waiting: deque[list] = deque()  # per group: [group, response lengths, prompt lengths]
        self.n_waiting = 0
        self.open: list[_Group] = []  # claimed groups not appended yet
        self.score_queue: deque[list] = deque()  # [group, samples not taken, submitted at]
        self.scoring = 0  # samples waiting, being scored, or scored and not collected
        self.score_waiting = 0
        self.answered: list[tuple[_Group, int]] = []
        self.score_signal = Signal()
        self.flush = False
        self.next_claim_at = 0.0
        self.blocked_at: float | None = None  # a claim found no budget then: retries wait for a budget change
        self.owed_claims = 0  # failed retries skipped while blocked (their CPU is paid at the next claim)
        self.in_steps = False
        self.claimable = False  # capacity > 0 during the current run of steps (a back-off end cuts it)

    def busy(self) -> int:
        return self.rows + self.n_waiting + self.scoring


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
        self.response_len = _Sampler(profile.generation.response_tokens, rng)
        self.prompt_len = _Sampler(profile.generation.prompt_tokens, rng)
        self.seq = itertools.count()
        # the buffer
        self.buffer_version = 0  # the learner version the buffer knows (after a publish)
        self.server_version = 0  # newest version the weight server committed
        self.admitted = 0
        self.stream: deque[_Group] = deque()  # appended, not read
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
        self.carry: deque[_Group] = deque()
        # accounting
        self.claimed = self.generated = self.trained = self.dropped = 0
        self.in_learner = 0  # samples of the batch being trained
        self.max_over = -10**9
        self.min_margin = 10**9
        self.hist: list[int] = []
        self.marks: list[tuple[float, int, int, float, float]] = []  # per update: time, trained, generated, idle, depth
        self.idle_s = 0.0
        self.warmup = 0
        self.depth_area = 0.0
        self._depth_t = 0.0
        self.depth = 0  # samples appended and not read into an update, nor dropped (stream + carry)
        self.max_lag = 0  # the largest lag the staleness filter saw
        self.workers = [_Worker(i) for i in range(plan.workers)]
        self.roles: dict[str, list[Proc]] = {"learner": [], "workers": [], "launcher": []}

    # ------------------------------------------------------------------ buffer

    def _depth(self) -> int:
        return sum(g.size for g in self.stream) + sum(g.size for g in self.carry)

    def _track_depth(self) -> None:
        now = self.k.now
        self.depth_area += self.depth * (now - self._depth_t)
        self._depth_t = now

    def _budget(self) -> int:
        return (self.plan.ahead + self.buffer_version + 1) * self.plan.batch_size - self.admitted

    def _claim(self, w: _Worker, capacity: int) -> int:
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
        """Wake blocked claimers; a busy worker that found no budget retries at its next back-off
        end after now (the retries before it would have failed: skipped, their CPU owed)."""
        self.k.fire(self.budget)
        now = self.k.now
        for w in self.workers:
            if w.blocked_at is None:
                continue
            periods = max(1, math.ceil((now - w.blocked_at) / BUSY_CLAIM_BACKOFF_S - 1e-9))
            w.owed_claims += periods - 1
            w.next_claim_at = w.blocked_at + periods * BUSY_CLAIM_BACKOFF_S
            w.blocked_at = None
            if w.in_steps and w.claimable:
                self.k.call_at(w.next_claim_at, lambda w=w: self._backoff_over(w))

    def _return_budget(self, samples: int) -> None:
        self.admitted -= samples
        self._budget_changed()

    # ------------------------------------------------------------------ worker

    def _trip(self):
        """A round trip to Redis or the weight server: the request wakes it, the reply the caller."""
        delay = self.k.handoff_s(2)
        if delay > 0.0:
            yield SLEEP, delay

    def _pull(self, w: _Worker):
        self.pulling += 1
        want = self.server_version
        yield CPU, self.p.sync.pull_s(self.pulling)
        yield from self._trip()
        self.pulling -= 1
        w.version = max(w.version, want)

    def _poke(self, w: _Worker) -> None:
        if w.in_steps:
            self.k.interrupt(w.proc)

    def worker(self, w: _Worker):
        plan, k = self.plan, self.k
        wc, g = self.p.worker, plan.group_size
        yield from self._pull(w)  # a worker starts with the newest version
        while True:
            idle = not w.rows and not w.n_waiting and not w.open
            capacity = max(0, (plan.slots + g - 1 - w.busy()) // g)
            if capacity > 0 and (idle or (w.blocked_at is None and k.now >= w.next_claim_at)):
                yield CPU, wc.claim_call * (1 + w.owed_claims)
                yield from self._trip()
                w.owed_claims, w.blocked_at = 0, None
                n = self._claim(w, capacity)
                if not n and idle:
                    # Buffer.claim(block_s=0.25) waits on the wake-up stream, which a new version or
                    # returned budget wakes at once; it re-checks every 0.2 s and the loop claims
                    # again every 0.25 s, all in vain until then: sleep through those re-checks
                    # (their CPU is owed) instead of simulating each
                    while not n:
                        t0 = k.now
                        yield WAIT, self.budget, None
                        yield CPU, wc.claim_call * (1 + int((k.now - t0) / WAKE_CAP_S))
                        yield from self._trip()
                        n = self._claim(w, capacity)
                if not n:
                    w.next_claim_at = k.now + BUSY_CLAIM_BACKOFF_S
                    if self._budget() < g:  # nothing to admit until the version or the budget moves
                        w.blocked_at = k.now
                else:
                    lease_version = self.buffer_version
                    groups = [_Group(g, lease_version) for _ in range(n)]
                    w.open += groups
                    if lease_version > w.version:  # pacing: generate with weights >= the lease's version
                        yield from self._pull(w)
                    yield CPU, wc.per_prompt * n
                    for group in groups:
                        w.waiting.append([group, self.response_len(g), self.prompt_len(g)])
                    w.n_waiting += n * g
            if w.rows or w.n_waiting:
                yield from self._steps(w)
                if w.announced > w.version:
                    yield from self._pull(w)
            else:
                if w.announced > w.version:
                    yield from self._pull(w)
                if w.open:
                    yield SLEEP, SCORING_ONLY_SLEEP_S + k.handoff_s()  # then it waits for a core
                yield CPU, wc.per_iteration
            yield from self._emit(w)

    def _steps(self, w: _Worker):
        """One step with the newcomers' prefill, or a run of decoding steps to the next finish."""
        gen, wc, plan = self.p.generation, self.p.worker, self.plan
        newcomers = prompt_tokens = 0
        free = plan.slots - w.rows
        while w.waiting and free > 0:
            entry = w.waiting[0]
            group, lengths, prompts = entry
            take = min(free, len(lengths))
            group.oldest = min(group.oldest, w.version)  # the prefill samples their first tokens now
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
                heapq.heappush(w.running, (w.step + steps, next(self.seq), group, rows, ctx))
            if take == len(lengths):
                w.waiting.popleft()
            else:
                entry[1], entry[2] = lengths[take:], prompts[take:]
            newcomers += take
            free -= take
        if newcomers:
            w.rows += newcomers
            w.n_waiting -= newcomers
            w.ctx += prompt_tokens + newcomers
        rows = w.rows
        if newcomers:
            yield CPU, gen.prefill_s(newcomers, prompt_tokens) + gen.decode_s(rows, w.ctx) + wc.per_iteration
            done = 1
        else:
            steps = w.running[0][0] - w.step
            capacity = (plan.slots + plan.group_size - 1 - w.busy()) // plan.group_size
            if capacity > 0 and w.blocked_at is None and self.k.now >= w.next_claim_at:
                steps = 1  # the next loop pass claims
            per_step = gen.decode_s(rows, w.ctx + rows * (steps - 1) / 2) + wc.per_iteration
            w.in_steps = True
            w.claimable = capacity > 0
            if w.claimable and steps > 1 and w.blocked_at is None:
                self.k.call_at(w.next_claim_at, lambda: self._backoff_over(w))
            done = yield STEPS, steps, per_step
            w.in_steps = False
        w.step += done
        w.ctx += rows * done
        running = w.running
        while running and running[0][0] <= w.step:
            _, _, group, n, ctx = heapq.heappop(running)
            w.rows -= n
            w.ctx -= ctx
            group.finished += n
            if group.finished == group.size:  # scored a whole group at a time
                w.score_queue.append([group, group.size, self.k.now])
                w.score_waiting += group.size
                w.scoring += group.size
                self.k.fire(w.score_signal)

    def _backoff_over(self, w: _Worker) -> None:
        if w.in_steps and w.claimable:
            self._poke(w)

    def _emit(self, w: _Worker):
        """Collect scores; append every group whose samples are all scored (one round trip)."""
        wc = self.p.worker
        answered, w.answered = w.answered, []
        for group, n in answered:
            group.scored += n
            w.scoring -= n
        flush = not w.rows and not w.n_waiting
        if flush and not w.flush:
            self.k.fire(w.score_signal)
        w.flush = flush
        ready = [grp for grp in w.open if grp.scored == grp.size]
        if not ready:
            return
        samples = sum(grp.size for grp in ready)
        yield CPU, wc.emit_call + wc.per_sample_emit * samples
        yield from self._trip()
        self._track_depth()
        for grp in ready:
            w.open.remove(grp)
            self.min_margin = min(self.min_margin, grp.oldest - grp.lease_version)
            self.stream.append(grp)
        self.generated += samples
        self.depth += samples
        self.k.fire(self.appended)

    def scorer(self, w: _Worker):
        wc, plan, k = self.p.worker, self.plan, self.k
        while True:
            if not w.score_queue:
                yield WAIT, w.score_signal, None
                continue
            left = plan.reward_max_wait_s - (k.now - w.score_queue[0][2])
            if not (w.flush or w.score_waiting >= plan.reward_batch_size or left <= 1e-9):
                yield WAIT, w.score_signal, left
                continue
            take: list[tuple[_Group, int]] = []
            n = 0
            while w.score_queue and n < plan.reward_batch_size:
                entry = w.score_queue[0]
                m = min(entry[1], plan.reward_batch_size - n)
                take.append((entry[0], m))
                entry[1] -= m
                n += m
                if entry[1] == 0:
                    w.score_queue.popleft()
            w.score_waiting -= n
            yield CPU, wc.score_batch + wc.score_sample * n
            w.answered.extend(take)
            self._poke(w)

    # ------------------------------------------------------------------ learner

    def learner(self):
        p, plan, k = self.p, self.plan, self.k
        lc = p.learner
        want = plan.batch_size // plan.group_size
        tokens_per_sample = p.generation.prompt_tokens.mean() + p.generation.response_tokens.mean()
        while True:
            yield CPU, lc.read_base
            yield from self._trip()
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
                            self._track_depth()
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
            self._track_depth()
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
            yield from self._trip()  # to the weight server
            self.server_version = version
            for w in self.workers:
                w.announced = version
                self._poke(w)
            yield from self._trip()  # the buffer's version
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
            w.proc = k.spawn(self.worker(w), f"worker-{w.index}")
            self.roles["workers"] += [w.proc, k.spawn(self.scorer(w), f"scorer-{w.index}")]
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
