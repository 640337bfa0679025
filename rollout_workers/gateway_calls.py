"""The worker's side of rlhf-gateway: its calls share the continuous batch with the run's prompts.

After each decoding step the worker, in one round trip, sends the new tokens of streamed calls
and the result of every finished call (token ids, behaviour log-probs and per-token policy
versions, exactly as for the run's own samples; a weight update between steps shows in the
versions), takes queued calls up to its free slots (before it claims prompts: a client is
waiting on them; each becomes engine request ``gw/<call id>``), and, every
:data:`CANCEL_CHECK_S`, asks which running calls were cancelled (their client went away): those
are aborted at once, freeing their slots. An idle worker takes calls with :meth:`GatewayCalls.take`
(it is woken for them). Records and keys: :mod:`buffer.gateway`.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from buffer.gateway import CallChunk, GatewayCall, WorkerChannel
from rlhf_core.wire import WireError
from rollout_workers.engine import GenRequest, GenResult, RequestError, SamplingParams

log = logging.getLogger(__name__)

PREFIX = "gw/"
#: how often a busy worker asks which of its running calls were cancelled
CANCEL_CHECK_S = 0.05


class GatewayCalls:
    """Calls in flight in one worker's engine. All methods run on the worker's main thread."""

    def __init__(self, channel: WorkerChannel, engine: Any, worker_id: str) -> None:
        self.channel, self.engine, self.worker_id = channel, engine, worker_id
        self.calls: dict[str, tuple[GatewayCall, list[int]]] = {}  # request id -> (call, [tokens streamed])
        self._next_cancel_check = 0.0
        self.stats = {"gateway_calls": 0, "gateway_done": 0, "gateway_aborted": 0, "gateway_refused": 0,
                      "gateway_bad_records": 0, "gateway_tokens": 0}

    def __len__(self) -> int:
        return len(self.calls)

    def take(self, capacity: int) -> int:
        """Add up to ``capacity`` queued calls to the engine (an idle worker). Returns the calls running."""
        refused = self._add(self.channel.take(capacity))
        self.channel.send(refused)
        return len(self.calls)

    def _add(self, raws: list[bytes]) -> list[tuple[str, CallChunk]]:
        """Queue calls in the engine; a call the engine refuses (too long for its context, bad
        settings) is answered with the reason (the chunks returned)."""
        refused: list[tuple[str, CallChunk]] = []
        for raw in raws:
            try:
                call = GatewayCall.decode(raw)
            except WireError as exc:  # not from a gateway of this release: nobody to answer
                self.stats["gateway_bad_records"] += 1
                log.warning("worker %s: dropped an unreadable gateway call: %s", self.worker_id, exc)
                continue
            try:
                params = SamplingParams(temperature=call.temperature, top_p=call.top_p, max_new_tokens=call.max_tokens,
                                        stop_strings=tuple(call.stop))
                self.engine.add(GenRequest(PREFIX + call.call_id, list(call.prompt_ids), params))
            except RequestError as exc:
                self.stats["gateway_refused"] += 1
                refused.append((call.reply_to, CallChunk(call.call_id, [], final=True, error=str(exc),
                                                         worker_id=self.worker_id)))
                continue
            self.calls[PREFIX + call.call_id] = (call, [0])
            self.stats["gateway_calls"] += 1
        return refused

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
        for request_id, (call, sent) in self.calls.items():
            if call.stream:
                tokens = self.engine.sampled(request_id)
                if len(tokens) > sent[0]:
                    out.append((call.reply_to, CallChunk(call.call_id, list(tokens[sent[0]:]), worker_id=self.worker_id)))
                    sent[0] = len(tokens)
        ids: list[str] = []
        if self.calls and time.monotonic() >= self._next_cancel_check:
            ids = [call.call_id for call, _ in self.calls.values()]
            self._next_cancel_check = time.monotonic() + CANCEL_CHECK_S
        raws, cancelled = self.channel.exchange(out, capacity, ids)
        answers = self._add(raws)
        for call_id in cancelled:
            result = self.engine.abort(PREFIX + call_id)
            if result is not None:
                answers.append(self._final(result))
        self.channel.send(answers)
        return rest

    def abort_all(self) -> None:
        """The worker stops: end every call with finish reason ``abort`` (the client gets what was sampled)."""
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
        call, _ = self.calls.pop(result.request_id)
        self.stats["gateway_aborted" if result.finish_reason == "abort" else "gateway_done"] += 1
        self.stats["gateway_tokens"] += result.num_tokens
        return call.reply_to, CallChunk(call.call_id, result.token_ids.tolist(), final=True,
                                        logprobs=result.logprobs.tolist(), versions=result.versions.tolist(),
                                        finish_reason=result.finish_reason, worker_id=self.worker_id)
