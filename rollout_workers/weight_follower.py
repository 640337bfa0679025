"""Weight following: the worker's engine on the newest verified policy version.

A first version before any work; then, between decoding steps, a newer one when it is announced or
when claimed prompts were admitted at a version the engine lacks (pacing's staleness bound assumes
generation with weights at least that new). An update lands in place: later tokens carry the new
version. A failed pull is retried only after WEIGHT_RETRY_S or for a newer version; meanwhile
generation goes on with the current weights.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from rlhf_core.config import Config
from rlhf_core.prometheus import WEIGHT_SYNC
from rollout_workers.engine import GenerationEngine
from rollout_workers.stats import WorkerStats
from weight_server import TensorMismatchError, WeightSubscriber

log = logging.getLogger(__name__)

WEIGHT_RETRY_S = 5.0  # pause after a failed pull of an announced version


class WeightFollower:
    """See the module docstring. Opens the subscriber's sockets: build it last, :meth:`close` it."""

    def __init__(self, cfg: Config, engine: GenerationEngine, worker_id: str, stats: WorkerStats, exporter: Any,
                 stop_event: threading.Event) -> None:
        self.cfg, self.engine, self.worker_id, self.stats, self.exporter = cfg, engine, worker_id, stats, exporter
        self.stop_event = stop_event
        self.has_weights = False  # engine.version is meaningful only after the first pull
        self._failed_pull: tuple[int | None, float] = (None, 0.0)  # (announced version, retry after)
        ws = cfg.weight_server
        self.subscriber = WeightSubscriber(ws.address, ws.pub_address, ws, worker_id=worker_id)

    @property
    def version(self) -> int | None:
        """The engine's version; None before the first pull."""
        return self.engine.version if self.has_weights else None

    def pull_newest(self) -> bool:
        """Pull the newest version, verified, into the engine (between steps). False: nothing applied."""
        t0 = time.monotonic()
        target = self.engine.weights_target()
        try:
            got = self.subscriber.pull(None, into=target)  # in place into the model (LoRA: its adapters) when offered
        except TensorMismatchError as exc:
            lora = self.cfg.model.lora
            raise TensorMismatchError(
                f"{exc}. This worker runs model.lora.r={lora.r} (target_modules={list(lora.target_modules)}): "
                "a learner training LoRA adapters publishes only those, so the learner and every worker need the "
                "same model and model.lora settings") from None
        if got is None:
            return False
        version, tensors = got
        if self.has_weights and version == self.engine.version:
            return True
        self.engine.update_weights(tensors if target is None else None, version)
        self.has_weights = True
        self.stats.weight_updates += 1
        self.stats.t_weights += time.monotonic() - t0
        if self.exporter is not None:
            self.exporter.observe(WEIGHT_SYNC, time.monotonic() - t0)
        # per version at debug: the weight server's log has a line for each (worker, version), with its latency
        log.debug("worker %s applied weights version %d", self.worker_id, version)
        return True

    def wait_for_weights(self) -> bool:
        """Block until a first version is applied; False if stopped first."""
        retry_at = 0.0
        tried: int | None = None
        logged = False
        while not self.stop_event.is_set():
            # Pull at once, then on an announcement, and every few seconds in case announcements do not arrive.
            announced = self.subscriber.poll_announcement(timeout_ms=100)
            if announced != tried or time.monotonic() >= retry_at:
                tried, retry_at = announced, time.monotonic() + WEIGHT_RETRY_S
                if self.pull_newest():
                    return True
            if not logged:
                log.info("worker %s: waiting for a first weight version at %s", self.worker_id, self.cfg.weight_server.address)
                logged = True
        return False

    def maybe_update(self) -> None:
        """Pull a newer version if one was announced (non-blocking: cheap between decoding steps)."""
        newest = self.subscriber.poll_announcement(timeout_ms=0)
        if newest is None or newest <= self.engine.version:
            return
        self.pull_towards(newest, "announced")

    def pull_towards(self, wanted: int, why: str) -> None:
        """Pull the newest weights because version ``wanted`` exists (see the module docstring on failures)."""
        last, retry_at = self._failed_pull
        if last is not None and wanted <= last and time.monotonic() < retry_at:
            return
        if self.pull_newest():
            self._failed_pull = (None, 0.0)
            return
        self._failed_pull = (wanted, time.monotonic() + WEIGHT_RETRY_S)
        log.warning("worker %s: could not pull v%d (%s); generating with v%d, retrying in %.0f s",
                    self.worker_id, wanted, why, self.engine.version, WEIGHT_RETRY_S)

    def close(self) -> None:
        self.subscriber.close()
