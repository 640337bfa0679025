"""Turning a claimed prompt into the token ids the engine generates from, both steps counted:

* **Chat template.** When the tokenizer has one, the prompt's ``messages`` (or its ``text`` as one
  user turn) go through ``apply_chat_template(..., add_generation_prompt=True)`` and the text is
  tokenized without adding special tokens again; without one the raw ``text`` is tokenized.
* **Length policy.** A prompt longer than ``rollout.max_prompt_tokens`` is rejected
  (``prompt_overflow=reject``: dead-lettered with the reason) or left-truncated (``truncate``).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from rlhf_core.choices import PromptOverflow
from rlhf_core.records import Prompt

log = logging.getLogger(__name__)

class PromptRejected(Exception):
    """A prompt the worker cannot generate from; the message is the dead-letter reason."""


class PromptTooLong(PromptRejected):
    """Over ``rollout.max_prompt_tokens`` with ``rollout.prompt_overflow=reject``."""


@dataclass
class PromptCounters:
    """Monotonic counts for the worker's heartbeat (the monitor shows them per worker)."""

    rendered: int = 0  # prompts turned into ids (truncated ones included)
    truncated: int = 0
    rejected: int = 0  # too long, with prompt_overflow=reject
    empty: int = 0  # no tokens at all after rendering
    tokens_cut: int = 0  # prompt tokens removed by truncation, summed

    def as_dict(self) -> dict[str, int]:
        return {"prompts_rendered": self.rendered, "prompts_truncated": self.truncated, "prompts_rejected": self.rejected,
                "prompts_empty_text": self.empty, "prompt_tokens_cut": self.tokens_cut}


@dataclass
class PromptRenderer:
    """Render + tokenize + length policy. ``render`` is called from the worker's main thread only;
    the lock keeps the counters consistent if a caller ever uses several threads."""

    tokenizer: Any
    max_prompt_tokens: int
    overflow: PromptOverflow = PromptOverflow.reject
    counters: PromptCounters = field(default_factory=PromptCounters)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        if self.overflow not in list(PromptOverflow):
            # composition refuses it in a config (an Enum); this guards direct construction
            raise ValueError(f"prompt_overflow='{self.overflow}' is not one of {', '.join(PromptOverflow)}")
        if self.max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens must be >= 1, got {self.max_prompt_tokens}")

    @property
    def uses_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def text_of(self, prompt: Prompt, tools: list[dict] | None = None) -> str:
        """The prompt as the model sees it (chat template applied when the tokenizer has one, with
        an environment's ``tools`` described in it when given)."""
        if self.uses_chat_template:
            messages = prompt.messages or [{"role": "user", "content": prompt.text}]
            kwargs = {"tools": tools} if tools else {}
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
        if prompt.text or not prompt.messages:
            return prompt.text
        # messages but no template: the turns' contents, one per line (nothing is invented)
        return "\n".join(m["content"] for m in prompt.messages)

    def render(self, prompt: Prompt, tools: list[dict] | None = None) -> tuple[str, list[int]]:
        """Return ``(text, ids)``: the text as the model sees it (before any truncation) and its
        token ids ``[P]``, ``P <= max_prompt_tokens``. Raises :class:`PromptRejected`, also when
        the chat template refuses the prompt or its messages are malformed."""
        try:
            text = self.text_of(prompt, tools)
        except Exception as exc:  # noqa: BLE001 - this prompt cannot be rendered; the caller goes on with others
            raise PromptRejected(f"prompt {prompt.prompt_id!r} could not be rendered: {type(exc).__name__}: {exc}") from exc
        ids = [int(t) for t in self.tokenizer(text, add_special_tokens=not self.uses_chat_template)["input_ids"]]
        with self._lock:
            if not ids:
                self.counters.empty += 1
                raise PromptRejected(f"prompt {prompt.prompt_id!r} has no tokens after rendering (empty text and no messages)")
            if len(ids) > self.max_prompt_tokens:
                if self.overflow == "reject":
                    self.counters.rejected += 1
                    raise PromptTooLong(
                        f"prompt {prompt.prompt_id!r} has {len(ids)} tokens, more than rollout.max_prompt_tokens="
                        f"{self.max_prompt_tokens} (rollout.prompt_overflow=reject); raise the limit or set "
                        "rollout.prompt_overflow=truncate to keep its last tokens"
                    )
                cut = len(ids) - self.max_prompt_tokens
                # keep the end: the instruction closest to the answer matters most
                ids = ids[cut:]
                self.counters.truncated += 1
                self.counters.tokens_cut += cut
                log.info("prompt %s: %d tokens cut from the left (rollout.max_prompt_tokens=%d)",
                         prompt.prompt_id, cut, self.max_prompt_tokens)
            self.counters.rendered += 1
        return text, ids
