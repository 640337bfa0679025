"""The prompt producer: a thread of rank 0 that keeps the buffer's prompt queue topped up, epoch
by epoch (the cursor kept in Redis), until every epoch is queued or training stops."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable

from buffer import ProducerClient
from buffer.datasets import iter_prompts
from rlhf_core.config import Config
from rlhf_core.errors import Unavailable, UserError
from rlhf_core.records import Prompt
from rlhf_core.tasks import builtin_prompts

log = logging.getLogger(__name__)

PROMPT_CHECK_S = 0.1  # the prompt producer looks at the queue's depth this often
PROMPT_LEAD_S = 3 * PROMPT_CHECK_S  # ... and tops it up to outlast three looks at the workers' rate


def prompt_source(cfg: Config) -> Callable[[int], Iterable[Prompt]]:
    """Prompts of one epoch, from the built-in task or a local dataset."""
    return lambda epoch: iter_prompts(cfg.data, epoch, builtin=builtin_prompts)


def produce_prompts(buffer: ProducerClient, cfg: Config, stop: threading.Event,
                    source: Callable[[int], Iterable[Prompt]] | None = None) -> None:
    """Keep the prompt queue topped up (epoch by epoch, cursor kept in Redis) until every epoch is
    queued or ``stop`` is set. Only Redis unreachable past ``buffer.max_retry_s`` is retried (it
    may come back, and the training loop's own reads end the run if it does not); anything else
    (bad data, corrupt state, a bug) is raised: the cursor stays before the prompt that failed, so
    trying again would fail on it for ever and the run would stall without a word."""
    source = source or prompt_source(cfg)
    groups = max(1, cfg.learner.batch_size // cfg.algo.group_size)
    # Workers must never find the queue empty: an empty queue stalls generation until the
    # next top-up. The queue is checked every PROMPT_CHECK_S and holds at least what workers
    # take in PROMPT_LEAD_S at their recent rate (the tiny model on 2 CPU cores takes ~600
    # prompts/s: a fixed 32 ran dry between checks, idling the worker ~45 ms about every
    # 17th update).
    low = max(32, 4 * groups)
    while not stop.is_set():
        try:
            buffer.fill_prompts(source, epochs=cfg.data.epochs, low_watermark=low, high_watermark=4 * low,
                                lead_s=PROMPT_LEAD_S)
            if buffer.fill_state()["done"]:
                log.info("all %d epochs of prompts are enqueued", cfg.data.epochs)
                return
        except Unavailable as exc:
            log.warning("prompt producer: %s; trying again", exc)
        stop.wait(PROMPT_CHECK_S)


class PromptProducer:
    """:func:`produce_prompts` on a thread of its own; what ends it early is kept, and raised by
    the training loop at its next read (:meth:`check`)."""

    def __init__(self, buffer: ProducerClient, cfg: Config, stop: threading.Event) -> None:
        self.buffer, self.cfg, self.stop = buffer, cfg, stop
        self.error: Exception | None = None
        self.thread = threading.Thread(target=self._run, name="prompts", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            produce_prompts(self.buffer, self.cfg, self.stop)
        except Exception as exc:  # noqa: BLE001  # handed to the training loop, which ends the run on it
            if isinstance(exc, UserError):
                log.error("prompt producer stopped: %s", exc)
            else:
                log.exception("prompt producer failed")
            self.error = exc

    def check(self) -> None:
        """Raise what stopped the producer, if anything did."""
        if self.error is not None:
            raise self.error

    def join(self) -> None:
        self.thread.join(timeout=10)
