"""Batched scoring off the generation thread, with a time limit per reward call.

The main thread hands finished samples over (:meth:`ScoringPool.submit`) and collects the answers
between decoding steps (:meth:`ScoringPool.poll`). Each of ``num_threads`` scoring threads takes up
to ``batch_size`` waiting samples once ``batch_size`` wait, the oldest has waited ``max_wait_s``,
or generation is idle (``poll(flush=True)``), and scores them with ``job(items, watch)``; a thread
takes a batch only when it is free, so while the reward is the bottleneck batches grow by themselves.

``poll`` abandons every batch whose current reward call (``watch``) has run past ``timeout_s``: its
samples get the ``on_timeout`` outcome at once and a fresh thread takes the abandoned one's place
(Python cannot kill it; it drops its result when the call returns). More than ``MAX_ABANDONED``
abandoned calls still running stop the worker.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from rollout_workers.rewards import CallWatch, RewardFailing

K = TypeVar("K", bound=Hashable)

MAX_ABANDONED = 16
#: batch durations kept for take_durations() (the worker's exporter takes them every loop; without one nobody does)
MAX_DURATIONS = 1024

Job = Callable[[list[Any], CallWatch], list[Any]]


@dataclass
class _Batch(Generic[K]):
    keys: list[K]
    watch: CallWatch
    started: float
    thread: threading.Thread


class ScoringPool(Generic[K]):
    """See the module docstring. ``job(items, watch) -> outcomes`` (one per item, in order) runs
    on the scoring threads; ``submit``, ``poll``, ``in_flight`` and ``close`` are called from one
    thread (the worker's main thread)."""

    def __init__(self, job: Job, on_timeout: Callable[[K, str], Any], *, num_threads: int, batch_size: int,
                 max_wait_s: float, timeout_s: float | None) -> None:
        self.job, self.on_timeout = job, on_timeout
        self.batch_size, self.max_wait_s, self.timeout_s = int(batch_size), float(max_wait_s), timeout_s
        self._cond = threading.Condition()
        self._waiting: deque[tuple[K, Any, float]] = deque()  # (key, item, submitted at)
        self._running: dict[threading.Thread, _Batch[K]] = {}  # by the scoring thread running it
        self._done: queue.SimpleQueue[tuple[list[K], list[Any] | BaseException]] = queue.SimpleQueue()
        self._answered = 0  # samples scored and not collected yet
        self._flush = False
        self._closed = False
        self._abandoned: list[threading.Thread] = []
        self._threads: list[threading.Thread] = []
        # accounting, under the lock (read by the worker's stats)
        self.busy_s = 0.0  # time scoring threads spent on batches (abandoned ones up to their abandonment)
        self.calls = 0  # reward calls made (each function or model, per sample or per batch)
        self.batches = 0
        self.timeouts = 0  # reward calls abandoned
        self._durations: deque[float] = deque(maxlen=MAX_DURATIONS)  # per batch, until take_durations()
        for _ in range(int(num_threads)):
            self._start_thread()

    # ------------------------------------------------------------------ main thread

    def submit(self, entries: list[tuple[K, Any]]) -> None:
        """Queue items to score (a whole group at a time keeps a group in as few batches as it fits)."""
        now = time.monotonic()
        with self._cond:
            self._waiting.extend((key, item, now) for key, item in entries)
            self._cond.notify()

    def in_flight(self) -> int:
        """Samples waiting, being scored, or scored and not collected (abandoned ones are answered)."""
        with self._cond:
            return len(self._waiting) + sum(len(b.keys) for b in self._running.values()) + self._answered

    def abandoned_running(self) -> int:
        self._abandoned = [t for t in self._abandoned if t.is_alive()]
        return len(self._abandoned)

    def poll(self, flush: bool = False, wait_s: float = 0.0) -> list[tuple[K, Any]]:
        """``(key, outcome)`` of every sample answered since the last call. ``flush``: score what
        waits without waiting for a fuller batch (until a later call says otherwise). ``wait_s``:
        wait up to that long for an answer when none is there yet."""
        with self._cond:
            if flush and not self._flush:
                self._cond.notify_all()
            self._flush = flush
        out: list[tuple[K, Any]] = []
        while True:
            try:
                keys, result = self._done.get(timeout=wait_s) if wait_s > 0 and not out else self._done.get_nowait()
            except queue.Empty:
                break
            with self._cond:
                self._answered -= len(keys)
            if isinstance(result, BaseException):  # a bug in the job itself, not a reward's failure
                raise result
            out.extend(zip(keys, result))
        if self.timeout_s is not None:
            out.extend(self._expire(self.timeout_s))
        return out

    def take_durations(self) -> list[float]:
        """Seconds of each batch finished or abandoned since the last call (for a histogram)."""
        with self._cond:
            out, self._durations = list(self._durations), deque(maxlen=MAX_DURATIONS)
        return out

    def close(self, wait_s: float = 10.0) -> None:
        """Forget waiting samples; give running batches up to ``wait_s`` to finish (never a stuck one)."""
        with self._cond:
            self._closed = True
            self._waiting.clear()
            self._cond.notify_all()
        deadline = time.monotonic() + wait_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    # ------------------------------------------------------------------ internals

    def _start_thread(self) -> None:
        thread = threading.Thread(target=self._loop, name=f"score-{len(self._threads) + len(self._abandoned)}", daemon=True)
        self._threads.append(thread)
        thread.start()

    def _account(self, batch: _Batch[K], now: float) -> None:
        seconds = now - batch.started
        self.busy_s += seconds
        self.calls += batch.watch.calls
        self.batches += 1
        self._durations.append(seconds)

    def _expire(self, timeout_s: float) -> list[tuple[K, Any]]:
        late: list[tuple[_Batch[K], str]] = []
        with self._cond:
            now = time.monotonic()
            for thread, batch in list(self._running.items()):
                current = batch.watch.current
                if current is None or now - current[1] <= timeout_s:
                    continue
                del self._running[thread]  # the thread sees this when its call returns, and ends
                self._account(batch, now)
                self.timeouts += 1
                self._threads.remove(thread)
                self._abandoned.append(thread)
                self._start_thread()
                late.append((batch, f"{current[0]} did not return within reward.timeout_s={timeout_s:g} s (a batch "
                                    f"of {len(batch.keys)} sample(s)); the call was abandoned and runs on in the "
                                    "background. Make the reward faster, raise reward.timeout_s, or lower reward.batch_size"))
        stuck = self.abandoned_running() if late else 0
        if stuck > MAX_ABANDONED:
            raise RewardFailing(f"{stuck} reward calls abandoned after reward.timeout_s={timeout_s:g} s are still "
                                f"running, the last because: {late[-1][1]}. The reward hangs: fix it (or its server)")
        return [(key, self.on_timeout(key, reason)) for batch, reason in late for key in batch.keys]

    def _take(self) -> tuple[list[K], list[Any]] | None:
        """Wait (holding the lock) until a batch is due; None once closed or abandoned."""
        me = threading.current_thread()
        while not self._closed and me in self._threads:
            if self._waiting:
                left = self.max_wait_s - (time.monotonic() - self._waiting[0][2])
                if self._flush or len(self._waiting) >= self.batch_size or left <= 0:
                    take = [self._waiting.popleft() for _ in range(min(self.batch_size, len(self._waiting)))]
                    if self._waiting:  # the rest is another thread's: submit woke only this one
                        self._cond.notify()
                    return [key for key, _, _ in take], [item for _, item, _ in take]
                self._cond.wait(left)
            else:
                self._cond.wait()
        return None

    def _loop(self) -> None:
        me = threading.current_thread()
        while True:
            with self._cond:
                taken = self._take()
                if taken is None:
                    return
                keys, items = taken
                watch = CallWatch()
                self._running[me] = _Batch(keys, watch, time.monotonic(), me)
            result: list[Any] | BaseException
            try:
                result = outcomes = self.job(items, watch)
                if len(outcomes) != len(items):
                    raise RuntimeError(f"scoring job returned {len(outcomes)} outcomes for {len(items)} items")
            except BaseException as exc:  # handed to the main thread, which raises it
                result = exc
            with self._cond:
                batch = self._running.pop(me, None)
                if batch is None:  # abandoned after a timeout: its samples were answered then
                    return
                self._account(batch, time.monotonic())
                self._answered += len(keys)
                self._done.put((keys, result))
