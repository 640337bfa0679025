"""The worker's side of rlhf-gateway: its calls share the continuous batch with the run's prompts.

After each decoding step the worker hands over the new tokens of streamed calls and the result
of every finished call (token ids, behaviour log-probs and per-token versions, as for the run's
own samples), takes queued calls up to its free slots (before it claims prompts: a client is
waiting; each becomes engine request ``gw/<call id>``), and, every :data:`CANCEL_CHECK_S`, aborts
the running calls that were cancelled or lost their gateway. An idle worker takes calls with
:meth:`GatewayCalls.take` (it is woken for them).

The Redis traffic runs off the decoding loop (:class:`BackgroundChannel`): a taker thread waits on
the call list (``BRPOP``) while the worker wants calls, a sender thread publishes chunks and reads
cancellations, and the main thread only moves records through in-memory queues. Calls the taker
fetches while the idle main thread waits for prompts end that wait (:meth:`GatewayCalls.waiting`).
Records and keys: :mod:`buffer.gateway`.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from buffer.gateway import CallChunk, GatewayCall, WorkerChannel
from rlhf_core.wire import WireError
from rollout_workers.engine import GenRequest, GenResult, RequestError, SamplingParams

log = logging.getLogger(__name__)

PREFIX = "gw/"
#: how often a busy worker asks which of its running calls were cancelled or lost their gateway
CANCEL_CHECK_S = 0.05

#: a call as taken from the list: its raw record (given back as it is when the worker stops before
#: starting it) and what it decoded to, or why it did not decode
Taken = tuple[bytes, GatewayCall | WireError]


def read_calls(raws: list[bytes]) -> list[Taken]:
    """Decode each raw call once (the taker thread does, off the decoding loop)."""
    out: list[Taken] = []
    for raw in raws:
        try:
            out.append((raw, GatewayCall.decode(raw)))
        except WireError as exc:
            out.append((raw, exc))
    return out


class BackgroundChannel:
    """What :class:`GatewayCalls` asks of Redis (``take``, ``send``, ``exchange``), served by two
    threads over a :class:`~buffer.gateway.WorkerChannel`: ``take`` and ``exchange`` return what the
    threads have fetched already; chunks are sent in order. :meth:`close` sends what is left, then
    gives calls taken and never started back to the list (another worker serves them)."""

    BLOCK_S = 0.1  # a taker's BRPOP waits this long before it looks at the demand again

    def __init__(self, channel: WorkerChannel, worker_id: str = "") -> None:
        self.channel, self.worker_id = channel, worker_id
        self.inbox: collections.deque[Taken] = collections.deque()
        self.cancelled: collections.deque[str] = collections.deque()
        # chunks to send, the running calls to ask about (call id, reply-to), None: stop
        self.outbox: queue.SimpleQueue[tuple[str, CallChunk] | list[tuple[str, str]] | None] = queue.SimpleQueue()
        self.demand = 0  # calls the worker could start now (set by the main thread)
        self.main_waiting = False  # the main thread waits on Redis for prompts (see waiting())
        self._got = threading.Condition()
        self._want = threading.Event()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._taker, name="gateway-take", daemon=True),
                         threading.Thread(target=self._sender, name="gateway-send", daemon=True)]
        for t in self._threads:
            t.start()

    def take(self, n: int, wait_s: float = 0.01) -> list[Taken]:
        """Up to ``n`` calls fetched; an idle worker (just woken for a call) waits ``wait_s`` for the first."""
        self._ask(n)
        if n > 0 and not self.inbox and wait_s > 0:
            with self._got:
                self._got.wait_for(lambda: bool(self.inbox), timeout=wait_s)
        return self._pop(n)

    @contextlib.contextmanager
    def waiting(self) -> Iterator[Callable[[], bool]]:
        """Around the main thread's wait for prompts: yields what to ask before waiting (calls
        fetched already?); calls fetched during the wait wake it (:meth:`WorkerChannel.wake`). The
        flag is set before it asks and the inbox filled before the taker looks, so neither misses."""
        self.main_waiting = True
        try:
            yield lambda: bool(self.inbox)
        finally:
            self.main_waiting = False

    def send(self, chunks: list[tuple[str, CallChunk]]) -> None:
        for chunk in chunks:
            self.outbox.put(chunk)

    def exchange(self, chunks: list[tuple[str, CallChunk]], take: int,
                 running: list[tuple[str, str]]) -> tuple[list[Taken], list[str]]:
        self.send(chunks)
        if running:
            self.outbox.put(list(running))  # the sender asks which of these were cancelled
        self._ask(take)
        cancelled = [self.cancelled.popleft() for _ in range(len(self.cancelled))]
        return self._pop(take), cancelled

    def _ask(self, n: int) -> None:
        self.demand = max(0, n - len(self.inbox))
        if self.demand:
            self._want.set()

    def _pop(self, n: int) -> list[Taken]:
        out: list[Taken] = []
        while len(out) < n and self.inbox:
            out.append(self.inbox.popleft())
        return out

    def _taker(self) -> None:
        while not self._stop.is_set():
            if self.demand <= 0:
                self._want.wait(self.BLOCK_S)
                self._want.clear()
                continue
            try:
                got = read_calls(self.channel.wait_take(self.demand, self.BLOCK_S))
            except Exception as exc:  # noqa: BLE001  # Redis away for a moment: the loop retries
                log.warning("gateway calls: taking calls failed (%s); retrying", exc)
                self._stop.wait(0.5)
                continue
            if got:
                self.send(self._held(got, self.worker_id, time.time()))  # before the main thread can start them
                with self._got:
                    self.inbox.extend(got)
                    self.demand = max(0, self.demand - len(got))
                    self._got.notify_all()
                if self.main_waiting:
                    try:
                        self.channel.wake()
                    except Exception as exc:  # noqa: BLE001  # the main thread's wait ends at its cap anyway
                        log.warning("gateway calls: waking the worker for %d call(s) failed (%s)", len(got), exc)

    def _sender(self) -> None:
        while True:
            item = self.outbox.get()
            items = [item]
            while True:  # everything queued goes in one round trip
                try:
                    items.append(self.outbox.get_nowait())
                except queue.Empty:
                    break
            chunks = [i for i in items if isinstance(i, tuple)]
            running = next((i for i in reversed(items) if isinstance(i, list)), [])
            try:
                self.cancelled.extend(self.channel.send(chunks, running))
            except Exception as exc:  # noqa: BLE001  # the gateway times such calls out and answers 503
                log.warning("gateway calls: %d chunk(s) could not be sent: %s", len(chunks), exc)
            if None in items:
                return

    def close(self) -> None:
        self._stop.set()
        self._want.set()
        self._threads[0].join(timeout=2 * self.BLOCK_S + 5)
        left = self._pop(len(self.inbox))
        # held by nobody, said before they are back on the list (another worker's word must come last)
        self.send(self._held(left, "", None))
        self.outbox.put(None)
        self._threads[1].join(timeout=10)
        if left:
            try:
                self.channel.give_back([raw for raw, _ in left])
            except Exception as exc:  # noqa: BLE001
                log.warning("gateway calls: %d call(s) taken and not started could not be given back: %s", len(left), exc)

    @staticmethod
    def _held(taken: list[Taken], worker_id: str, at: float | None) -> list[tuple[str, CallChunk]]:
        """The chunks that tell the calls' gateways which worker holds them (:attr:`CallChunk.started`),
        sent as the taker fetches them: a worker killed with calls it has not started fails them too."""
        return [(call.reply_to, CallChunk(call.call_id, [], worker_id=worker_id, started_at=at))
                for _, call in taken if isinstance(call, GatewayCall)]


class GatewayCalls:
    """Calls in flight in one worker's engine. All methods run on the worker's main thread."""

    def __init__(self, channel: BackgroundChannel, engine: Any, worker_id: str) -> None:
        self.channel, self.engine, self.worker_id = channel, engine, worker_id
        # request id -> (call, [tokens streamed], when it was queued in the engine (time.time()))
        self.calls: dict[str, tuple[GatewayCall, list[int], float]] = {}
        self._next_cancel_check = 0.0
        self.stats = {"gateway_calls": 0, "gateway_done": 0, "gateway_aborted": 0, "gateway_refused": 0,
                      "gateway_bad_records": 0, "gateway_tokens": 0}

    def __len__(self) -> int:
        return len(self.calls)

    def waiting(self) -> contextlib.AbstractContextManager[Callable[[], bool]]:
        """Around an idle worker's wait for prompts: yields the ``interrupt`` of
        :meth:`buffer.WorkerClient.claim` (calls are there to take)."""
        if isinstance(self.channel, BackgroundChannel):
            return self.channel.waiting()
        return contextlib.nullcontext(lambda: False)  # takes on this thread: nothing arrives unseen

    def take(self, capacity: int) -> int:
        """Add up to ``capacity`` queued calls to the engine (an idle worker). Returns the calls running."""
        self.channel.send(self._add(self.channel.take(capacity)))
        return len(self.calls)

    def _add(self, taken: list[Taken]) -> list[tuple[str, CallChunk]]:
        """Queue calls in the engine; returns the answers to the calls it refuses (too long for its
        context, bad settings): why. (Which worker holds a call, the channel said as it took it.)"""
        answers: list[tuple[str, CallChunk]] = []
        for _, call in taken:
            if isinstance(call, WireError):  # not from a gateway of this release: nobody to answer
                self.stats["gateway_bad_records"] += 1
                log.warning("worker %s: dropped an unreadable gateway call: %s", self.worker_id, call)
                continue
            try:
                params = SamplingParams(temperature=call.temperature, top_p=call.top_p, max_new_tokens=call.max_tokens,
                                        stop_strings=tuple(call.stop))
                self.engine.add(GenRequest(PREFIX + call.call_id, list(call.prompt_ids), params, call.min_kv_version))
            except RequestError as exc:
                self.stats["gateway_refused"] += 1
                answers.append((call.reply_to, CallChunk(call.call_id, [], final=True, error=str(exc),
                                                         worker_id=self.worker_id)))
                continue
            self.calls[PREFIX + call.call_id] = (call, [0], time.time())
            self.stats["gateway_calls"] += 1
        return answers

    def after_step(self, finished: list[GenResult], capacity: int) -> list[GenResult]:
        """Answer the calls among ``finished``, stream the running ones, take up to ``capacity``
        new ones; returns the other results."""
        if not self.calls and capacity <= 0:
            return finished
        out: list[tuple[str, CallChunk]] = []
        rest: list[GenResult] = []
        for result in finished:
            if result.request_id in self.calls:
                out.append(self._final(result))
            else:
                rest.append(result)
        for request_id, (call, sent, _) in self.calls.items():
            if call.stream:
                tokens = self.engine.sampled(request_id)
                if len(tokens) > sent[0]:
                    out.append((call.reply_to, CallChunk(call.call_id, list(tokens[sent[0]:]), worker_id=self.worker_id)))
                    sent[0] = len(tokens)
        ids: list[tuple[str, str]] = []
        if self.calls and time.monotonic() >= self._next_cancel_check:
            ids = [(call.call_id, call.reply_to) for call, *_ in self.calls.values()]
            self._next_cancel_check = time.monotonic() + CANCEL_CHECK_S
        raws, cancelled = self.channel.exchange(out, capacity, ids)
        answers = self._add(raws)
        for call_id in cancelled:
            result = self.engine.abort(PREFIX + call_id)
            if result is not None:
                answers.append(self._final(result))
        self.channel.send(answers)
        return rest

    def close(self) -> None:
        """The worker stops: abort the running calls (:meth:`abort_all`), then the channel's threads."""
        self.abort_all()
        if isinstance(self.channel, BackgroundChannel):
            self.channel.close()

    def abort_all(self) -> None:
        """End every call with finish reason ``abort`` (the client gets what was sampled)."""
        out = []
        for request_id in list(self.calls):
            result = self.engine.abort(request_id)
            if result is not None:
                out.append(self._final(result))
        self.calls.clear()
        try:
            self.channel.send(out)
        except Exception as exc:  # noqa: BLE001  # Redis gone at shutdown: the gateway times the calls out
            log.warning("worker %s: could not tell the gateway about %d aborted call(s): %s", self.worker_id, len(out), exc)

    def _final(self, result: GenResult) -> tuple[str, CallChunk]:
        call, _, started = self.calls.pop(result.request_id)
        self.stats["gateway_aborted" if result.finish_reason == "abort" else "gateway_done"] += 1
        self.stats["gateway_tokens"] += result.num_tokens
        return call.reply_to, CallChunk(call.call_id, result.token_ids.tolist(), final=True,
                                        logprobs=result.logprobs.tolist(), versions=result.versions.tolist(),
                                        finish_reason=result.finish_reason, worker_id=self.worker_id,
                                        started_at=started, finished_at=time.time())
