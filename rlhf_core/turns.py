"""The tokens between two policy turns: what the environment said, in the chat template's format.

An episode's context is token ids (:class:`rlhf_core.episode.Transcript`): the policy's turns as
sampled and, after each, the ids this module gives for the observation. Two formats:

* **Chat template** (:class:`TemplateConversation`). After a turn, the template renders the
  conversation with the turn and the observation; when that starts with the rendering before the
  turn followed by the turn's own text, the rest is what the template puts between the turn and
  the next one (end-of-turn tokens the policy did not write, the observation, the next generation
  prompt), tokenised and appended. A template that re-renders history otherwise gets the delta
  from a fixed two-message conversation. Either way the whole conversation's rendering, tokenised,
  is compared with the context ids; a difference counts as **retokenisation drift** and the
  episode still trains on its own ids. The comparison tokenises only the text since the last
  added token it placed (text between added tokens tokenises apart), and once drift is found
  later checks count it without tokenising (:meth:`TemplateConversation._drift`).
* **Plain text** (:class:`PlainConversation`, no template: the tiny model). The observation's
  text is tokenised as it is and appended; the task's environment writes its own separators.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

Message = Mapping[str, Any]
Observation = str | Message | list | None

#: a fixed conversation the template renders to find what surrounds an observation and how an
#: assistant message ends (the contents are placeholders no template changes)
_BASE = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a0a1a2"}]


class EnvContractError(Exception):
    """An environment broke its contract (a step result or an observation of the wrong shape); the episode dies."""


def observation_messages(observation: Observation, role: str) -> list[dict[str, Any]]:
    """An observation as chat messages (a string gets ``role``)."""
    if observation is None:
        return []
    if isinstance(observation, str):
        return [{"role": role, "content": observation}]
    if isinstance(observation, Mapping):
        return [dict(observation)]
    if isinstance(observation, list) and all(isinstance(m, Mapping) for m in observation):
        return [dict(m) for m in observation]
    raise EnvContractError(f"an observation must be None, a string, a message dict or a list of them, got "
                            f"{type(observation).__name__}")


def observation_text(observation: Observation) -> str:
    """An observation as plain text (no chat template): a string as it is, messages' contents joined."""
    return "".join(str(m.get("content", "")) for m in observation_messages(observation, "user"))


def encode(tokenizer: Any, text: str) -> list[int]:
    """Ids of ``text`` without added BOS/EOS (templates and tasks write their own special tokens)."""
    return [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]] if text else []


class PlainConversation:
    """No chat template: an observation is its text, tokenised as it is."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def after_turn(self, context_ids: Sequence[int], turn_ids: Sequence[int], content: str, observation: Observation,
                   role: str) -> tuple[list[int], bool]:
        """``(ids to append, drift)``; drift is never counted without a template."""
        return encode(self.tokenizer, observation_text(observation)), False


class TemplateConversation:
    """One episode's conversation through the tokenizer's chat template (see the module
    docstring), from ``messages`` so far, with the environment's ``tools`` (or None)."""

    def __init__(self, tokenizer: Any, messages: Sequence[dict[str, Any]], tools: Sequence[dict] | None = None) -> None:
        self.tokenizer, self.tools = tokenizer, list(tools) if tools else None
        self.messages = [dict(m) for m in messages]
        self.rendered = self.render(self.messages, generation_prompt=True)
        # (chars, ids): the rendering's first `chars` characters tokenise to the context's first
        # `ids` ids, and an added token starts at `chars` (see _drift); (0, 0): nothing known yet
        self._checked = (0, 0)
        self.drifted = False  # a check found drift: the ids kept since then still differ there
        self._added = {int(i): t.content for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}

    def render(self, messages: Sequence[dict[str, Any]], generation_prompt: bool) -> str:
        kwargs = {"tools": self.tools} if self.tools else {}
        return self.tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=generation_prompt,
                                                  **kwargs)

    def initial_ids(self) -> list[int]:
        return encode(self.tokenizer, self.rendered)

    def after_turn(self, context_ids: Sequence[int], turn_ids: Sequence[int], content: str, observation: Observation,
                   role: str) -> tuple[list[int], bool]:
        """The ids to append after a turn (``turn_ids``, already at the end of ``context_ids``) for
        ``observation`` (a string gets ``role``), and whether the template's rendering of the
        whole conversation, tokenised, differs from the context ids with them (drift)."""
        ids, drift = self.next_turn(context_ids, turn_ids, content, observation, role)
        return ids, drift()

    def next_turn(self, context_ids: Sequence[int], turn_ids: Sequence[int], content: str, observation: Observation,
                  role: str) -> tuple[list[int], Callable[[], bool]]:
        """:meth:`after_turn` with its drift check as a function to run before the next turn (it may
        tokenise a whole conversation, releasing the GIL: a server runs it on a thread)."""
        turn_text = self.tokenizer.decode(list(turn_ids), skip_special_tokens=False)
        obs = observation_messages(observation, role)
        self.messages.append({"role": "assistant", "content": content})
        self.messages.extend(obs)
        full = self.render(self.messages, generation_prompt=True)
        head = self.rendered + turn_text
        if full.startswith(head):
            delta = full[len(head):]
        else:  # history re-rendered otherwise: a fixed conversation gives what follows a turn
            delta = self._turn_end(turn_text) + self._observation_delta(obs)
        ids = encode(self.tokenizer, delta)
        previous, self.rendered = self.rendered, full
        context = [*context_ids, *ids]
        return ids, lambda: self._drift(full, previous, context)

    def _drift(self, full: str, previous: str, context: list[int]) -> bool:
        """Whether ``full`` (the whole conversation's rendering), tokenised, differs from ``context``.
        Only ``full[chars:]`` is tokenised, from the last place ``_checked`` holds: an added token
        starts there, so the text before it tokenises as when checked, as long as the template
        renders it as before (``previous``). A difference is confirmed on the whole text before it
        counts; after that every check answers True at once."""
        if self.drifted:
            return True
        chars, n = self._checked
        if chars and full[:chars] != previous[:chars]:  # the template re-rendered history
            chars, n = 0, 0
        if encode(self.tokenizer, full[chars:]) != context[n:]:
            if not chars or encode(self.tokenizer, full) != context:
                self.drifted = True
                return True
            chars, n = 0, 0
        self._checked = self._last_added(full, context, n) or (chars, n)
        return False

    def _last_added(self, full: str, context: list[int], since: int) -> tuple[int, int] | None:
        """Where the last added token of ``context`` (which ``full`` tokenises to) starts in
        ``full`` and in ``context``; None when ``context[since:]`` has none."""
        for i in range(len(context) - 1, since - 1, -1):
            content = self._added.get(context[i])
            if content is not None:
                at = full.rfind(content)
                return (at, i) if at > 0 else None
        return None

    def _turn_end(self, turn_text: str) -> str:
        """What the template writes after an assistant message's content that the turn did not
        (``<|im_end|>\\n`` minus the ``<|im_end|>`` the policy sampled). A start of it that ends
        inside a special token's text does not count: a turn cut after a literal ``<`` has not
        written a part of ``<|im_end|>`` (a special token is written whole or not at all)."""
        base = self.render(_BASE, generation_prompt=False)
        content = _BASE[-1]["content"]
        at = base.rfind(content)
        end = base[at + len(content):] if at >= 0 else ""
        specials = [t for t in getattr(self.tokenizer, "all_special_tokens", []) if t]
        inside = {i for sp in specials for at in _find_all(end, sp) for i in range(at + 1, at + len(sp))}
        for k in range(len(end), 0, -1):  # the longest start of `end` the turn already wrote
            if k not in inside and turn_text.endswith(end[:k]):
                return end[k:]
        return end

    def _observation_delta(self, obs: list[dict[str, Any]]) -> str:
        base = self.render(_BASE, generation_prompt=False)
        with_obs = self.render([*_BASE, *obs], generation_prompt=True)
        if with_obs.startswith(base):
            return with_obs[len(base):]
        common = 0  # a template that renders the base otherwise once more follows: keep what differs
        for a, b in zip(base, with_obs):
            if a != b:
                break
            common += 1
        return with_obs[common:]


def _find_all(text: str, part: str) -> list[int]:
    out, at = [], text.find(part)
    while at >= 0:
        out.append(at)
        at = text.find(part, at + 1)
    return out
