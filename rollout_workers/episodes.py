"""Multi-turn episodes in the worker: many at once in one continuous batch, environments off the
main thread.

An :class:`Episode` is a small state machine driven by the worker's main thread::

    reset (env call) -> turn (engine request) -> step (env call) -> turn -> step ... -> finished

Environment calls run on :class:`EnvCalls` (a thread pool, or one event loop for ``async def``)
and come back through a queue the main thread drains between decoding steps, so other episodes
keep decoding meanwhile. A turn is one engine request over the whole context so far (the engines
reuse the previous turn's K/V); its tokens go into the episode's
:class:`~rlhf_core.episode.Transcript` as sampled, the observation's (and the chat template's
between turns, :mod:`rlhf_core.turns`) with loss mask 0.

An episode finishes ``stop`` (the environment said done), ``max_turns``, ``length`` (the context
is full; an observation that would overflow it is cut to fit) or fails (an environment that
raises, answers in the wrong shape or runs past ``rollout.env_timeout_s``): that episode alone,
with the reason, which the worker dead-letters.
"""

from __future__ import annotations

import inspect
import logging
import queue
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from rlhf_core.episode import Transcript
from rlhf_core.records import Prompt
from rlhf_core.tool_calls import ToolCallParser
from rlhf_core.turns import PlainConversation, TemplateConversation, observation_messages, observation_text
from rollout_workers.engine import GenRequest, GenResult, SamplingParams
from rollout_workers.environment import AssistantTurn, EnvFactory, as_step_result
from rollout_workers.prompts import PromptRejected, PromptRenderer
from rollout_workers.user_loop import UserLoop

log = logging.getLogger(__name__)

#: lines of an environment's exception kept in the dead-letter reason
ERROR_LINES = 6


def describe_exception(exc: BaseException, where: str) -> str:
    """``where``: the exception's first lines and the innermost frame it was raised in."""
    lines = [ln.rstrip() for ln in traceback.format_exception_only(type(exc), exc) for ln in ln.splitlines()]
    frames = traceback.extract_tb(exc.__traceback__)
    at = f" (at {frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name})" if frames else ""
    return f"{where}: {' | '.join(lines[:ERROR_LINES])}{at}"


class EnvCalls:
    """Environment calls off the main thread; answers are collected by :meth:`poll` on it (the pool
    threads and the event loop only put answers into a queue)."""

    def __init__(self, threads: int, timeout_s: float | None) -> None:
        self.threads, self.timeout_s = int(threads), timeout_s
        self._pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="env")
        self._loop = UserLoop("env-asyncio")  # async methods, and plain ones that returned an awaitable
        self._done: queue.SimpleQueue[tuple[int, Future]] = queue.SimpleQueue()
        self._pending: dict[int, str] = {}  # call id -> key
        # call id -> when it began running (written by the pool threads): the time limit counts from there
        self._began: dict[int, float] = {}
        # calls given to the pool and not yet ended, abandoned ones included (they keep their thread)
        self._on_pool: set[int] = set()
        self._next = 0
        self.calls = 0
        self.timeouts = 0

    def _run_sync(self, fn: Any, args: tuple, call_id: int | None = None) -> Any:
        if call_id is not None:
            self._began[call_id] = time.monotonic()
        out = fn(*args)
        if inspect.isawaitable(out):
            return self._loop.submit(out).result()
        return out

    def submit(self, key: str, fn: Any, *args: Any) -> None:
        """Start ``fn(*args)``; its answer comes back from :meth:`poll` under ``key``."""
        call_id, self._next = self._next, self._next + 1
        self._pending[call_id] = key
        self.calls += 1
        if inspect.iscoroutinefunction(fn):  # the event loop runs it at once: no thread to wait for
            self._began[call_id] = time.monotonic()
            fut: Future = self._loop.submit(fn(*args))
        else:
            self._on_pool.add(call_id)
            fut = self._pool.submit(self._run_sync, fn, args, call_id)
        fut.add_done_callback(lambda f: self._done.put((call_id, f)))

    def fire(self, fn: Any) -> None:
        """Run ``fn()`` in the background and forget it (an environment's ``close``)."""
        if inspect.iscoroutinefunction(fn):
            self._loop.submit(fn())
        else:
            self._pool.submit(self._run_sync, fn, ())

    def poll(self, block_s: float = 0.0) -> list[tuple[str, Any, BaseException | None]]:
        """Answers that came back: ``(key, value, None)`` or ``(key, None, exception)``; calls past
        the time limit come back as a ``TimeoutError`` (the call itself cannot be stopped; its
        late answer is dropped). Waits up to ``block_s`` for the first answer."""
        done: list[tuple[int, Future]] = []
        try:
            done.append(self._done.get(timeout=block_s) if block_s > 0 and self._pending else self._done.get_nowait())
        except queue.Empty:
            pass
        while True:
            try:
                done.append(self._done.get_nowait())
            except queue.Empty:
                break
        out: list[tuple[str, Any, BaseException | None]] = []
        for call_id, fut in done:
            self._began.pop(call_id, None)
            self._on_pool.discard(call_id)
            if call_id not in self._pending:  # timed out or cancelled before it answered
                continue
            key = self._pending.pop(call_id)
            # a coroutine that ended in CancelledError cancels its future, whose exception() raises
            exc = (RuntimeError("the environment's call was cancelled (its coroutine ended in asyncio.CancelledError)")
                   if fut.cancelled() else fut.exception())
            out.append((key, None if exc is not None else fut.result(), exc))
        if self.timeout_s is not None and self._pending:
            now = time.monotonic()
            for call_id, key in list(self._pending.items()):
                began = self._began.get(call_id)
                if began is not None and now - began > self.timeout_s:
                    del self._pending[call_id]
                    self.timeouts += 1
                    out.append((key, None, TimeoutError(
                        f"no answer within rollout.env_timeout_s={self.timeout_s:g} s; the call was abandoned")))
        return out

    def cancel(self, key: str) -> None:
        """Forget the calls of ``key`` (their answers are dropped)."""
        for call_id in [c for c, k in self._pending.items() if k == key]:
            del self._pending[call_id]

    def pending(self) -> int:
        return len(self._pending)

    def queued(self) -> int:
        """Calls waiting for a free thread: the threads abandoned calls still hold are not free."""
        return max(0, len(self._on_pool) - self.threads)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._loop.stop()


@dataclass(eq=False)
class Episode:
    """One episode (see the module docstring). ``tag`` is the caller's (the worker's group and index)."""

    key: str
    prompt: Prompt
    tag: Any = None
    env: Any = None
    parser: ToolCallParser | None = None
    conversation: PlainConversation | TemplateConversation | None = None
    transcript: Transcript | None = None
    prompt_text: str = ""
    prompt_messages: list[dict[str, Any]] = field(default_factory=list)  # the first observation as messages
    messages: list[dict[str, Any]] = field(default_factory=list)  # the whole conversation, for reward functions
    turns: list[AssistantTurn] = field(default_factory=list)
    env_reward: float | None = None  # the sum of the rewards step returned; None: it never gave one
    finish_reason: str | None = None
    error: str | None = None  # why it failed (the dead-letter reason)
    drift_turns: int = 0
    request_id: str | None = None  # the engine request of the running turn
    started_at: float = field(default_factory=time.time)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None


@dataclass
class EpisodeStats:
    """Monotonic counts for the worker's heartbeat (``episodes_*``, ``env_*``, ``retokenisation_drift``)."""

    started: int = 0
    finished: dict[str, int] = field(default_factory=lambda: {"stop": 0, "max_turns": 0, "length": 0})
    failed: int = 0
    turns: int = 0
    policy_tokens: int = 0
    observation_tokens: int = 0
    observations_cut: int = 0  # observations cut to fit the context (the episode then ends `length`)
    tool_calls: int = 0
    tool_call_errors: int = 0  # calls the parser could not read (the environment was told)
    drift: int = 0  # turns where the template's rendering of the conversation differs from the ids

    def as_dict(self, calls: EnvCalls) -> dict[str, int]:
        out = {"episodes_started": self.started, "episodes_failed": self.failed, "episode_turns": self.turns,
               "episode_policy_tokens": self.policy_tokens, "episode_observation_tokens": self.observation_tokens,
               "observations_cut": self.observations_cut, "tool_calls": self.tool_calls,
               "tool_call_errors": self.tool_call_errors, "retokenisation_drift": self.drift,
               "env_calls": calls.calls, "env_timeouts": calls.timeouts}
        out.update({f"episodes_{reason}": n for reason, n in self.finished.items()})
        return out


class EpisodeRunner:
    """Runs episodes on ``engine`` (see the module docstring). Main-thread only. ``renderer`` renders
    the first observation with the prompt length policy; each turn's ``max_new_tokens`` is capped by
    the room left in ``max_context`` (prompt + response tokens) and ``max_response`` (response
    tokens, ``rollout.max_episode_tokens``; None: no cap). ``threads``, ``timeout_s``: :class:`EnvCalls`."""

    def __init__(self, engine: Any, tokenizer: Any, renderer: PromptRenderer, sampling: SamplingParams,
                 factory: EnvFactory, *, max_turns: int, max_context: int, threads: int, timeout_s: float | None,
                 max_response: int | None = None) -> None:
        self.engine, self.tokenizer, self.renderer, self.sampling = engine, tokenizer, renderer, sampling
        self.factory, self.max_turns, self.max_context = factory, int(max_turns), int(max_context)
        self.max_response = max_response
        self.templated = renderer.uses_chat_template
        self.calls = EnvCalls(threads, timeout_s)
        self.episodes: dict[str, Episode] = {}  # running, by key
        self._finished: list[Episode] = []
        self.stats = EpisodeStats()

    # ------------------------------------------------------------------ the caller's side

    def start(self, key: str, prompt: Prompt, tag: Any = None) -> Episode:
        """Begin an episode of ``prompt`` (its reset runs off this thread)."""
        if key in self.episodes:
            raise ValueError(f"episode {key!r} is already running")
        ep = Episode(key, prompt, tag)
        self.episodes[key] = ep
        self.stats.started += 1
        try:
            ep.env = self.factory.make()
        except Exception as exc:  # noqa: BLE001 - the user's constructor: this episode fails, the worker goes on
            self._fail(ep, describe_exception(exc, f"environment {self.factory.path}() failed"))
            return ep
        self.calls.submit(key, ep.env.reset, prompt)
        return ep

    def on_result(self, result: GenResult) -> bool:
        """A finished engine request; False when it is not a turn of a running episode."""
        key = result.request_id.rpartition("#")[0]
        ep = self.episodes.get(key)
        if ep is None or ep.request_id != result.request_id:
            return False
        ep.request_id = None
        if result.finish_reason == "abort":
            self._fail(ep, "the turn was aborted by the engine")
            return True
        self._turn_done(ep, result)
        return True

    def poll(self, block_s: float = 0.0) -> list[Episode]:
        """Take in the environments' answers (waiting up to ``block_s`` for one), queue the next
        turns, and return the episodes that finished since the last call."""
        for key, value, exc in self.calls.poll(block_s):
            ep = self.episodes.get(key)
            if ep is None:
                continue
            what = "reset" if ep.transcript is None else "step"
            if exc is not None:
                self._fail(ep, describe_exception(exc, f"environment {self.factory.path}.{what}() failed"))
                continue
            try:
                if what == "reset":
                    self._begin(ep, value)
                else:
                    self._after_step(ep, value)
            except PromptRejected as exc:
                self._fail(ep, str(exc))
            except Exception as exc:  # noqa: BLE001 - a contract the environment broke: this episode only
                self._fail(ep, describe_exception(exc, f"environment {self.factory.path}.{what}() answered badly"))
        out, self._finished = self._finished, []
        return out

    def abort(self, key: str) -> None:
        """Drop a running episode (its lease was lost, or the worker stops)."""
        ep = self.episodes.pop(key, None)
        if ep is None:
            return
        if ep.request_id is not None:
            self.engine.abort(ep.request_id)
        self.calls.cancel(key)
        self._close_env(ep)

    def abort_all(self) -> None:
        for key in list(self.episodes):
            self.abort(key)

    def waiting_for_env(self) -> int:
        """Episodes whose environment call runs or waits for a thread."""
        return self.calls.pending()

    def queued_for_env(self) -> int:
        """Environment calls waiting for a free thread (``rollout.env_threads``)."""
        return self.calls.queued()

    def close(self) -> None:
        self.abort_all()
        self.calls.close()

    # ------------------------------------------------------------------ the state machine

    def _begin(self, ep: Episode, first: Any) -> None:
        """reset answered: render the first observation, then the first turn."""
        prompt = ep.prompt
        if first is not None:
            messages = observation_messages(first, "user")
            prompt = replace(prompt, text=observation_text(first), messages=messages)
        tools = getattr(ep.env, "tools", None) or None
        text, ids = self.renderer.render(prompt, tools)
        ep.prompt_text = text
        ep.prompt_messages = list(prompt.messages or [{"role": "user", "content": prompt.text}])
        ep.messages = list(ep.prompt_messages)
        ep.transcript = Transcript(ids)
        ep.conversation = (TemplateConversation(self.tokenizer, ep.messages, tools) if self.templated
                           else PlainConversation(self.tokenizer))
        ep.parser = ToolCallParser(self.tokenizer, getattr(ep.env, "tool_call_pattern", None), tools)
        self._next_turn(ep)

    def _next_turn(self, ep: Episode) -> None:
        assert ep.transcript is not None
        context = ep.transcript.context_ids
        room = self._room(ep)
        if room < 1:
            self._finish(ep, "length")
            return
        params = self.sampling if self.sampling.max_new_tokens <= room else replace(self.sampling, max_new_tokens=room)
        ep.request_id = f"{ep.key}#{len(ep.turns)}"
        self.engine.add(GenRequest(ep.request_id, context, params, min_kv_version=ep.transcript.oldest_version))

    def _turn_done(self, ep: Episode, result: GenResult) -> None:
        """The policy's turn: append its tokens as sampled, parse its tool calls, call ``step``."""
        assert ep.transcript is not None and ep.parser is not None
        ids = result.token_ids.tolist()
        ep.transcript.add_policy(ids, result.logprobs.tolist(), result.versions.tolist())
        raw = self.tokenizer.decode(ids, skip_special_tokens=False)
        prefix = ep.conversation.rendered if isinstance(ep.conversation, TemplateConversation) else ""
        calls, errors = ep.parser.parse(raw, prefix)
        turn = AssistantTurn(result.text, raw, ids, result.finish_reason, len(ep.turns), calls, errors)
        ep.turns.append(turn)
        ep.messages.append({"role": "assistant", "content": result.text})
        s = self.stats
        s.turns, s.policy_tokens = s.turns + 1, s.policy_tokens + len(ids)
        s.tool_calls, s.tool_call_errors = s.tool_calls + len(calls), s.tool_call_errors + len(errors)
        self.calls.submit(ep.key, ep.env.step, turn)

    def _after_step(self, ep: Episode, value: Any) -> None:
        """step answered: end the episode, or append the observation and queue the next turn."""
        assert ep.transcript is not None and ep.conversation is not None
        result = as_step_result(value)
        if result.reward is not None:
            ep.env_reward = (ep.env_reward or 0.0) + result.reward
        if result.done:
            self._finish(ep, "stop")
            return
        if len(ep.turns) >= self.max_turns:
            self._finish(ep, "max_turns")
            return
        if self._room(ep) < 1:
            self._finish(ep, "length")
            return
        last = ep.turns[-1]
        role = "tool" if last.tool_calls or last.tool_call_errors else "user"
        ids, drift = ep.conversation.after_turn(ep.transcript.context_ids, last.token_ids, last.text,
                                                result.observation, role)
        ep.messages.extend(observation_messages(result.observation, role))
        ep.drift_turns += int(drift)
        self.stats.drift += int(drift)
        room = self._room(ep) - 1  # the next turn needs at least one token
        cut = len(ids) > room  # cut to fit: what the policy would see is the context, full
        ids = ids[: max(room, 0)] if cut else ids
        ep.transcript.add_observation(ids)
        self.stats.observation_tokens += len(ids)
        self.stats.observations_cut += int(cut)
        if cut:
            self._finish(ep, "length")
        else:
            self._next_turn(ep)

    def _room(self, ep: Episode) -> int:
        """Tokens the episode may still add: the context's room, and the response budget's."""
        assert ep.transcript is not None
        room = self.max_context - len(ep.transcript)
        if self.max_response is not None:
            room = min(room, self.max_response - len(ep.transcript.response_ids))
        return room

    def _finish(self, ep: Episode, reason: str) -> None:
        ep.finish_reason = reason
        self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1
        self._end(ep)

    def _fail(self, ep: Episode, reason: str) -> None:
        ep.error = reason
        self.stats.failed += 1
        if ep.request_id is not None:
            self.engine.abort(ep.request_id)
            ep.request_id = None
        self._end(ep)

    def _end(self, ep: Episode) -> None:
        if self.episodes.get(ep.key) is ep:
            del self.episodes[ep.key]
        self.calls.cancel(ep.key)
        self._close_env(ep)
        self._finished.append(ep)

    def _close_env(self, ep: Episode) -> None:
        close = getattr(ep.env, "close", None)
        if callable(close):
            self.calls.fire(close)
