"""Sessions: an agent's calls as one episode, token in and token out; rewarded sessions as groups.

A session holds a :class:`~rlhf_core.episode.Transcript`: each call's sampled ids exactly as the
worker sampled them (loss mask 1) and, between calls, the ids of what the agent added (mask 0).
A chat call **extends** its session when its messages start with the previous call's messages and
the assistant message the gateway returned (compared as
:func:`~gateway.openai_api.normal_message` shapes), its new messages rendered by the chat
template as what follows the previous turn (:class:`rlhf_core.turns.TemplateConversation`); a
completions call when its prompt starts with the session's text so far. Any other call restarts
the session. A rewarded session joins its group, appended once ``group_size`` are rewarded or
``session_ttl_s`` after the last (:mod:`gateway.settlement`). docs/gateway.md tells the rules.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gateway.openai_api import CONFLICT, INVALID, NOT_FOUND, ApiError
from rlhf_core import metric_names as M
from rlhf_core.episode import Transcript
from rlhf_core.records import Sample
from rlhf_core.turns import TemplateConversation, encode

log = logging.getLogger(__name__)

#: prefix of a gateway group's prompt id and group ids (``gw:<group>``; a kept sample's group is read back off it)
GROUP_PREFIX = "gw:"
#: the longest session or group id (a header's, or the reward body's group): it goes into sample ids
MAX_ID_CHARS = 200
#: a rewarded sample's metadata key marking a session that named no group (a group of one)
ALONE = "group_of_one"
#: the chat template for tokenizers without one (the tiny model, whose alphabet has no newline):
#: ``[role] content`` turns, assistant turns closed by the EOS token, tools and calls in the
#: Hermes ``<tool_call>`` format (which the worker-side parser reads too)
PLAIN_TEMPLATE = (
    "{%- if tools %}[tools] {{ tools | tojson }} [format] <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call> "
    "{% endif -%}"
    "{%- for m in messages %}[{{ m['role'] }}] {{ m['content'] if m['content'] is string else '' }}"
    "{%- for c in (m['tool_calls'] or []) if m['role'] == 'assistant' %}<tool_call>"
    "{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}</tool_call>{% endfor %}"
    "{%- if m['role'] == 'assistant' %}{{ eos_token }}{% endif %} {% endfor -%}"
    "{%- if add_generation_prompt %}[assistant] {% endif -%}"
)


class SessionError(ApiError):
    """A session request that cannot be served; ``status`` 400, 404 or 409 (error code ``session``)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(status, message, {404: NOT_FOUND, 409: CONFLICT}.get(status, INVALID), "session")


@dataclass
class Session:
    session_id: str
    group: str | None
    created: float
    last_used: float
    transcript: Transcript | None = None
    conversation: TemplateConversation | None = None
    expected: list[dict[str, Any]] = field(default_factory=list)  # chat: messages a continuing call starts with
    text: str = ""  # completions: the prompt and completions so far, as sampled
    client_text: str = ""  # the same as the client got it (stop strings cut)
    last_turn: tuple[list[int], str] | None = None  # the previous call's (ids, text)
    turns: int = 0
    drift_turns: int = 0
    finish_reason: str = "stop"
    busy: bool = False  # a call of this session is running
    reward_key: str = ""  # its field in P gw:rewarded, the same for a reward posted again after a 503
    drift_check: Callable[[], bool] | None = None  # the running call's drift check (count_drift takes its answer)


@dataclass
class Rewarded:
    """A rewarded session's sample, kept in the buffer (field ``key`` of ``P gw:rewarded``) until its
    group is appended; its group and session are read off the sample (one an earlier gateway kept too)."""

    key: str
    sample: Sample

    @property
    def group(self) -> str:
        return self.sample.prompt_id.removeprefix(GROUP_PREFIX)

    @property
    def session_id(self) -> str:
        return str(self.sample.metadata.get("session", self.key))

    @property
    def alone(self) -> bool:
        """A session that named no group: a group of one, appended as it is rewarded."""
        return bool(self.sample.metadata.get(ALONE))


@dataclass
class _Group:
    name: str
    size: int  # appended once it holds this many
    samples: list[Rewarded] = field(default_factory=list)
    changed: float = 0.0  # monotonic time of the last reward


@dataclass
class GatewayCounters:
    calls: int = 0
    sessions_started: int = 0
    sessions_restarted: int = 0
    sessions_rewarded: int = 0
    sessions_expired: int = 0
    groups_appended: int = 0
    samples_appended: int = 0
    samples_dead_lettered: int = 0
    groups_filtered: int = 0  # algo.filter_groups: all rewards equal (or, with overlong=mask, all truncated)
    samples_filtered: int = 0
    retokenisation_drift: int = 0
    calls_aborted: int = 0
    calls_failed: int = 0
    rewards_recovered: int = 0  # rewarded sessions a gateway before this one kept, found at start
    # requests answered with an error, by its code (worker_stopped, timeout, client_gone, ...): errors_<code>
    errors: collections.Counter = field(default_factory=collections.Counter)

    def as_dict(self) -> dict[str, int]:
        out = {k: v for k, v in self.__dict__.items() if k != "errors"}
        return {**out, **{f"{M.GATEWAY_ERRORS}{code}": n for code, n in sorted(self.errors.items())}}


class Sessions:
    """All sessions of one gateway (one asyncio loop: no locks)."""

    def __init__(self, tokenizer: Any, ttl_s: float, group_size: int, max_response_tokens: int) -> None:
        self.tokenizer, self.ttl_s = tokenizer, float(ttl_s)
        self.group_size, self.max_response_tokens = int(group_size), int(max_response_tokens)
        self.sessions: dict[str, Session] = {}
        self.ended: dict[str, str] = {}  # session id -> "rewarded" | "expired" (bounded)
        self.groups: dict[str, _Group] = {}
        self.counters = GatewayCounters()
        self._flush_seq = itertools.count()

    def open(self, session_id: str, group: str | None) -> Session:
        if session_id in self.ended:
            raise SessionError(409, f"session '{session_id}' was {self.ended[session_id]} already; start a new one "
                                    "(another X-Session-Id)")
        s = self.sessions.get(session_id)
        now = time.monotonic()
        if s is None:
            s = self.sessions[session_id] = Session(session_id, group, now, now)
            self.counters.sessions_started += 1
        if s.busy:
            raise SessionError(409, f"session '{session_id}' has a call running; a session's calls follow each other")
        s.last_used = now
        if group and not s.group:
            s.group = group
        return s

    def chat_context(self, s: Session, messages: list[dict[str, Any]], tools: list[dict] | None) -> list[int]:
        """The ids the session's next turn is generated from, given the call's messages."""
        prefix = len(s.expected)
        extends = s.transcript is not None and s.last_turn is not None and prefix > 0 and s.conversation is not None \
            and messages[:prefix] == s.expected and len(messages) > prefix
        # the template renders tools at the start of the prompt: a call may leave them out (its turn is
        # generated after the tools its session's prompt holds, as with tool_choice "none"), not change them
        same_tools = s.conversation is not None and (not tools or s.conversation.tools == list(tools))
        if extends and same_tools:
            assert s.transcript is not None and s.last_turn is not None and s.conversation is not None  # extends says so
            turn_ids, turn_text = s.last_turn
            ids, s.drift_check = s.conversation.next_turn(s.transcript.context_ids, turn_ids, turn_text, messages[prefix:],
                                                          "user")
            s.transcript.add_observation(ids)
        else:
            if s.transcript is not None:
                self.counters.sessions_restarted += 1
                if extends:
                    log.warning("session %s: the call's tools differ from those of its session's prompt, so it restarted "
                                "the session (its %d earlier turn(s) are not trained): a session's calls keep its tools, "
                                "or leave them out", s.session_id, s.turns)
                else:
                    log.info("session %s: a call that does not extend the conversation restarted it", s.session_id)
            s.conversation = TemplateConversation(self.tokenizer, messages, tools)
            s.transcript = Transcript(s.conversation.initial_ids())
            s.turns = s.drift_turns = 0
        return s.transcript.context_ids

    def count_drift(self, s: Session, drift: bool) -> None:
        """The answer of the call's drift check (``s.drift_check``, run by the caller, on a thread
        while the call is generated): the call counts as retokenisation drift."""
        s.drift_check = None
        s.drift_turns += int(drift)
        self.counters.retokenisation_drift += int(drift)

    def completion_context(self, s: Session, prompt: str | list[int]) -> list[int]:
        t = s.transcript
        if isinstance(prompt, list):  # token ids: extend when they start with the context so far
            if t is not None and prompt[:len(t)] == t.context_ids and len(prompt) > len(t):
                t.add_observation(prompt[len(t):])
                return t.context_ids
            return self._restart(s, list(prompt), "").context_ids
        for known in (s.text, s.client_text):  # the sampled text first: a stop string written back is not added twice
            if t is not None and known and prompt.startswith(known) and len(prompt) > len(known):
                t.add_observation(encode(self.tokenizer, prompt[len(known):]))
                s.text = s.client_text = prompt
                return t.context_ids
        return self._restart(s, encode(self.tokenizer, prompt), prompt).context_ids

    def _restart(self, s: Session, ids: list[int], text: str) -> Transcript:
        """Start the session's transcript over from ``ids``; returns it."""
        if s.transcript is not None:
            self.counters.sessions_restarted += 1
        s.transcript, s.text, s.client_text, s.turns, s.drift_turns = Transcript(ids), text, text, 0, 0
        return s.transcript

    @staticmethod
    def snapshot(s: Session) -> tuple[Any, ...]:
        """What a call may change, to put back if it fails (the agent may retry it)."""
        t, conv = s.transcript, s.conversation
        tr = None if t is None else (list(t.prompt_ids), list(t.response_ids), list(t.logprobs), list(t.versions),
                                     list(t.mask), list(t.turns))
        cv = None if conv is None else (list(conv.messages), conv.rendered, conv.drifted)
        return (t, tr, conv, cv, list(s.expected), s.text, s.client_text, s.last_turn, s.turns, s.drift_turns,
                s.finish_reason)

    def restore(self, s: Session, snap: tuple[Any, ...]) -> None:
        t, tr, conv, cv, s.expected, s.text, s.client_text, s.last_turn, s.turns, s.drift_turns, s.finish_reason = snap
        if t is not None and tr is not None:
            t.prompt_ids, t.response_ids, t.logprobs, t.versions, t.mask, t.turns = tr
        if conv is not None and cv is not None:
            conv.messages, conv.rendered, conv.drifted = cv
        s.transcript, s.conversation, s.drift_check = t, conv, None
        if t is None:  # a first call that failed leaves no session behind
            self.sessions.pop(s.session_id, None)

    @staticmethod
    def completed(s: Session, sampled: str, returned: str) -> None:
        """A completions call's text: as sampled, and as the client got it."""
        s.text += sampled
        s.client_text += returned

    def room(self, s: Session) -> int:
        """Response tokens the session may still sample (a sample's response is capped by the run)."""
        assert s.transcript is not None
        return self.max_response_tokens - len(s.transcript.response_ids)

    def record(self, s: Session, token_ids: list[int], logprobs: list[float], versions: list[int], text: str,
               finish_reason: str) -> None:
        """The call's sampled turn, exactly as sampled."""
        assert s.transcript is not None
        s.transcript.add_policy(token_ids, logprobs, versions)
        s.last_turn = (list(token_ids), text)
        s.turns += 1
        s.finish_reason = finish_reason
        s.last_used = time.monotonic()

    def end(self, session_id: str, reward: float, components: dict[str, float], group: str | None) -> Rewarded:
        """Check that ``session_id`` may be rewarded and make its sample; the session is held (busy)
        until :meth:`rewarded` ends it, once the sample is kept, or :meth:`reopen` gives it back."""
        s = self.sessions.get(session_id)
        if s is None:
            if session_id in self.ended:
                raise SessionError(409 if self.ended[session_id] == "rewarded" else 404,
                                   f"session '{session_id}' was {self.ended[session_id]} already")
            raise SessionError(404, f"no session '{session_id}': sessions start with a call carrying X-Session-Id "
                                    "(or 'user'), and expire after gateway.session_ttl_s without calls")
        if s.busy:
            raise SessionError(409, f"session '{session_id}' has a call running; reward it when the call has returned")
        if s.transcript is None or not s.transcript.turns:
            raise SessionError(400, f"session '{session_id}' has no completed call to reward")
        name = group or s.group or session_id
        alone = {} if group or s.group else {ALONE: True}
        # a reward posted again after a failed keep overwrites that one: the session is in its group once
        key = s.reward_key = s.reward_key or uuid.uuid4().hex
        sample = s.transcript.to_sample(
            sample_id=key, prompt_id=GROUP_PREFIX + name, group_id=GROUP_PREFIX + name, reward=reward, reward_components=components,
            finish_reason=s.finish_reason, worker_id="gateway", group_size=1, group_index=0,
            created_at=time.time() - (time.monotonic() - s.created), finished_at=time.time(),
            metadata={"session": session_id, "turns": s.turns, "retokenisation_drift": s.drift_turns, **alone})
        s.busy = True
        return Rewarded(key, sample)

    def reopen(self, r: Rewarded) -> None:
        """The reward could not be kept: the session goes on as it was (the agent may post it again)."""
        self.sessions[r.session_id].busy = False

    def rewarded(self, r: Rewarded) -> None:
        """End the session of ``r`` (its sample is kept) and add it to its group."""
        del self.sessions[r.session_id]
        self._end(r.session_id, "rewarded")
        self.counters.sessions_rewarded += 1
        self._add(r, time.monotonic())

    def recovered(self, key: str, sample: Sample) -> Rewarded:
        """A kept sample found at start (a gateway before this one accepted its reward): back in its
        group, its session ended, the time since its reward counted towards the group's TTL."""
        r = Rewarded(key, sample)
        self._end(r.session_id, "rewarded")
        self.counters.rewards_recovered += 1
        self._add(r, time.monotonic() - min(max(0.0, time.time() - sample.finished_at), self.ttl_s))
        return r

    def _add(self, r: Rewarded, at: float) -> None:
        g = self.groups.setdefault(r.group, _Group(r.group, 1 if r.alone else self.group_size))
        g.samples.append(r)
        g.changed = max(g.changed, at)

    def expire(self, now: float | None = None) -> None:
        """Drop sessions idle past the TTL."""
        now = time.monotonic() if now is None else now
        for sid, s in list(self.sessions.items()):
            if not s.busy and now - s.last_used > self.ttl_s:
                del self.sessions[sid]
                self._end(sid, "expired")
                self.counters.sessions_expired += 1

    def due(self, now: float | None = None) -> list[str]:
        """Groups to append now: those with ``group_size`` rewarded sessions (a session without a
        group: its own), and those short of it that waited ``ttl_s`` since their last reward."""
        now = time.monotonic() if now is None else now
        return [name for name, g in self.groups.items() if len(g.samples) >= g.size or now - g.changed > self.ttl_s]

    def group(self, name: str) -> tuple[list[str], list[Sample]]:
        """The kept fields and the samples of group ``name`` (at most ``group_size``, oldest first),
        as one group of the buffer; :meth:`appended` drops them once the buffer has them."""
        g = self.groups[name]
        rewarded = g.samples[: g.size]
        group_id = f"{GROUP_PREFIX}{name}:{next(self._flush_seq)}:{int(time.time() * 1000)}"
        samples = [dataclasses.replace(r.sample, sample_id=f"{group_id}/{i}", group_id=group_id,
                                       group_size=len(rewarded), group_index=i) for i, r in enumerate(rewarded)]
        return [r.key for r in rewarded], samples

    def appended(self, name: str, keys: list[str]) -> None:
        g, done = self.groups.get(name), set(keys)
        if g is None:
            return
        g.samples = [r for r in g.samples if r.key not in done]
        if not g.samples:
            del self.groups[name]

    def _end(self, session_id: str, how: str) -> None:
        self.ended[session_id] = how
        while len(self.ended) > 100_000:
            self.ended.pop(next(iter(self.ended)))
