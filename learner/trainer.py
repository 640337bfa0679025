"""The learner's outer loop: read a batch, update, publish v+1, checkpoint, then commit.

Order matters (invariant 3): the batch that produced version v+1 is acked in the buffer only
after v+1 is published and a checkpoint that contains it is on disk. A checkpoint records the
ids of the batches it has trained on; after a crash the restarted learner acks exactly those
(they are in its weights) and receives the rest again (they are not), trained from the restored
weights with staleness measured against the checkpoint's version, so the crash drops none of
them. So no sample is lost and none is trained twice beyond ``buffer.max_reuse``.

A restarted learner may publish its restored weights above the checkpoint's version
(:mod:`learner.publishing`); the version then runs ahead of the updates the weights hold, and
the buffer paces generation by the updates (:mod:`buffer.pacing`). The loop's parts are modules:
:mod:`learner.reader`, :mod:`learner.update`, :mod:`learner.publishing`, :mod:`learner.reporting`
(rank 0's metrics) and :mod:`learner.prompts` (rank 0's prompt producer).

One line per update goes to ``metrics.jsonl`` before that update's checkpoint, so every
checkpointed update has its line. After a crash, the updates published but not checkpointed
are trained again and appear twice: the later line of a ``learner/updates`` value is the one
in the weights.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from buffer import LearnerClient, MonitorClient, ProducerClient
from learner.batch import Collator
from learner.engines import all_reduce_max, shutdown_distributed
from learner.prompts import PromptProducer
from learner.publishing import Publishing
from learner.reader import BatchReader, Read, check_tokenizer
from learner.reporting import UpdateReporter
from rlhf_core.choices import Estimator
from rlhf_core.cli import freeze_startup_heap
from rlhf_core.config import Config, ConfigError, response_budget, validate
from rlhf_core.metric_names import (
    SAMPLES_TRAINED,
    STALENESS_HIST,
    STOP_BUDGET,
    STOP_DATA,
    STOP_REASONS,
    STOP_SIGNAL,
    STOP_TIME,
    TIME,
    TIME_COMPUTE_S,
    TIME_PUBLISH_S,
    TIME_READ_S,
    TIME_WAIT_S,
    UPDATES,
    VERSION,
)
from rlhf_core.models import load_critic, load_policy, load_reference, load_teacher, load_tokenizer

log = logging.getLogger(__name__)


@dataclass
class LearnerResult:
    version: int
    updates: int
    samples: int
    metrics: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=256))  # the latest updates' (bounded)
    stopped_by: str = STOP_BUDGET  # one of rlhf_core.metric_names.STOP_REASONS


class Learner:
    def __init__(self, cfg: Config, buffer: LearnerClient | None = None, output_dir: str | Path | None = None) -> None:
        from learner.algorithms import algorithm
        from learner.checkpoint import load_latest
        from learner.engine_factory import make_engine
        from learner.update import PolicyUpdater

        self.cfg = cfg
        self.output_dir = Path(output_dir or cfg.run.output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.ckpt_dir = Path(cfg.learner.checkpoint_dir or self.output_dir / "checkpoints")
        self.stop_event = threading.Event()
        # A stable consumer name: a restarted learner must get back what it read and did not commit.
        self.consumer = f"learner-{int(os.environ.get('RANK', 0))}"
        torch.manual_seed(cfg.learner.seed)
        self.tokenizer = load_tokenizer(cfg.model)
        self.engine = make_engine(cfg, load_policy(cfg.model))
        eos_ids = check_tokenizer(self.tokenizer, self.engine.module, cfg.rollout.stop_strings)
        algo = algorithm(cfg.algo.estimator)
        self.critic = make_engine(cfg, load_critic(cfg.model)) if algo.needs_critic else None
        needs_ref = (cfg.algo.kl_coef > 0 or algo.needs_reference) and cfg.rollout.ref_logprobs_on != "worker"
        self.ref = load_reference(cfg.model) if needs_ref else None
        self.teacher = load_teacher(cfg) if cfg.distill.enabled else None  # one copy per rank, beside the reference
        self.updater = PolicyUpdater(cfg, self.engine, self.ref, self.critic, self.teacher)
        self.buffer = buffer or LearnerClient.connect(cfg.buffer.url, cfg.buffer.run_id, cfg.buffer)
        self.buffer_producer, self.buffer_monitor = ProducerClient(self.buffer.store), MonitorClient(self.buffer.store)
        self.rank0 = self.engine.is_rank0
        vocab = int(self.engine.module.config.vocab_size) if hasattr(self.engine.module, "config") else None
        if self.rank0:
            self.buffer.init_run(
                batch_size=cfg.learner.batch_size,
                group_size=cfg.algo.group_size,
                max_staleness=cfg.algo.max_staleness,
                max_response_tokens=response_budget(cfg.rollout),
                vocab_size=vocab,
            )
        self.incarnation = uuid.uuid4().hex[:8]
        self.version = restored_version = 0
        self.samples_trained = 0
        self.updates = 0
        self.uncommitted: list[Any] = []  # rank 0: ids of the batches trained since the last checkpoint
        tracker_state: dict[str, str] = {}  # the trackers' run ids in the checkpoint
        self._checkpointed = 0  # self.updates at the last checkpoint (every rank knows it; ids only rank 0)
        extra = load_latest(self.ckpt_dir, self.engine, self.critic)
        if extra is not None:
            self._restore(extra)
            restored_version, tracker_state = self.version, dict(extra.get("trackers") or {})
        grouped = Estimator(cfg.algo.estimator).grouped  # a group may not exceed algo.group_size
        collate = Collator.for_model(self.engine.module, self.updater.device, cfg.algo.group_size if grouped else None)
        self.reader = BatchReader(cfg, self.buffer, self.consumer, self.rank0, eos_ids, collate, restored_version)
        self.prompts: PromptProducer | None = None  # rank 0's, from the start of the run
        self.reporter = UpdateReporter(cfg, self.buffer_monitor, self.output_dir, self.tokenizer, tracker_state) \
            if self.rank0 else None
        # Last: a constructor that fails before this line leaves no socket or thread behind.
        self.publishing = Publishing(cfg, self.engine, self.buffer, self.rank0)

    # ------------------------------------------------------------------ resume

    def _restore(self, extra: dict[str, Any]) -> None:
        self.version = int(extra["version"])
        self.samples_trained = int(extra.get("samples_trained", 0))
        self.updates = self._checkpointed = int(extra.get("updates", 0))
        self.updater.load_state_dict(extra.get("updater", {}))
        if self.rank0 and extra.get("fill") and self.buffer_producer.restore_fill_state(
                extra["fill"], admitted=self.updates * self.cfg.learner.batch_size):
            log.info("a fresh buffer: prompts go on from the checkpoint's cursor (epoch %d, prompt %d)",
                     extra["fill"]["epoch"], extra["fill"]["index"])
        trained_ids = extra.get("trained_ids", [])
        if self.rank0 and trained_ids:
            # in the weights already: ack them so they are not delivered again (idempotent)
            self.buffer.commit_ids(trained_ids)
        log.info("resumed from checkpoint at version %d (%d samples trained)", self.version, self.samples_trained)

    # ------------------------------------------------------------------ the loop

    def checkpoint(self) -> None:
        """Save the weights, then ack the batches they hold. The version being sent is waited for
        first: a batch is acked only once the version it made is published (invariant 3)."""
        from learner.checkpoint import save_checkpoint

        self.publishing.wait()

        extra = {
            "version": self.version,
            "updates": self.updates,
            "samples_trained": self.samples_trained,
            "updater": self.updater.state_dict(),
            "trained_ids": [i for ids in self.uncommitted for i in ids],
            "incarnation": self.incarnation,
            # the prompt cursor: a run resumed on a fresh Redis starts its prompts here
            "fill": self.buffer_producer.fill_state() if self.rank0 else None,
            # the trackers' run ids (rank 0 writes this record)
            "trackers": self.reporter.tracker_state() if self.reporter is not None else {},
        }
        save_checkpoint(self.ckpt_dir, f"v{self.version:08d}", self.engine, self.critic, extra,
                        keep=self.cfg.learner.keep_checkpoints)
        if self.rank0:
            for ids in self.uncommitted:
                self.buffer.commit_ids(ids)
        self.uncommitted.clear()
        self._checkpointed = self.updates

    def run(self, max_updates: int | None = None, max_seconds: float | None = None) -> LearnerResult:
        """Train until ``max_updates`` (default ``learner.max_updates``), ``max_seconds`` (default
        ``run.max_seconds``), the prompts of every epoch (``data.epochs``) are trained on, or a stop
        request, then write the final checkpoint. Collective."""
        max_updates = self.cfg.learner.max_updates if max_updates is None else max_updates
        max_seconds = self.cfg.run.max_seconds if max_seconds is None else max_seconds
        deadline = None if max_seconds is None else time.monotonic() + max_seconds
        result = LearnerResult(self.version, 0, 0)
        self._start()
        ckpt_every = self.cfg.learner.checkpoint_every  # >= 1 (validate)
        t_wait = time.monotonic()  # waiting for data: from the end of one update to the next batch
        while True:
            reason = self._stop_reason(max_updates, deadline)
            if reason == STOP_DATA and self.updates != self._checkpointed:
                # commit what was trained first: in replay mode the entries drawn since the last
                # checkpoint may be drawn again only once committed
                self.checkpoint()
                self.reader.used_up = False
                continue
            if reason:
                result.stopped_by = reason
                if reason == STOP_DATA:
                    log.info("every prompt of data.epochs=%d is trained on (what is left makes no batch): "
                             "stopping after %d updates (learner.max_updates=%d)", self.cfg.data.epochs,
                             self.updates, max_updates)
                break
            if self.prompts is not None:  # a producer that stopped on an error ends the run here, with that error
                self.prompts.check()
            read = self.reader.read(self.version)
            if read is None:
                continue
            metrics = self._train_one(read, t_wait)
            result.metrics.append(metrics)
            if self.reporter is not None:
                self.reporter.emit(metrics, self.version, list(zip(read.samples, read.staleness)))
            # after the metrics line: a checkpointed update always has its line
            if self.updates % ckpt_every == 0:
                self.checkpoint()
            t_wait = time.monotonic()
        self._finish(result)
        return result

    def _start(self) -> None:
        """Publish the starting weights; rank 0 tells the buffer the version and starts the prompt producer."""
        self.version = self.publishing.publish_start(self.version, self.reader.restored_version, self.updates)
        if self.reporter is not None:
            self.reporter.start(self.updates, self.samples_trained)
        if self.rank0:
            # pacing counts the updates: after a restart from a checkpoint, fewer than the version
            self.buffer.set_learner_version(self.version, self.updates)
            if self.cfg.data.source == "none":  # samples come from rlhf-gateway's sessions only
                return
            self.prompts = PromptProducer(self.buffer_producer, self.cfg, self.stop_event)

    def _train_one(self, read: Read, t_wait: float) -> dict[str, Any]:
        """One update on ``read``: train, advance the version, publish it. Returns the update's
        metrics. ``t_wait``: when waiting for the batch began."""
        # waiting: from the end of the last update until this one starts, less rank 0's decoding of
        # the batch (CPU work of its own, reported as learner/time_read_s)
        wait_s = max(0.0, time.monotonic() - t_wait - read.decode_s)
        t_compute = time.monotonic()
        metrics: dict[str, Any] = self.updater.update(self.reader.collate(read.samples), read.version)
        compute_s = time.monotonic() - t_compute
        self.version += 1
        self.updates += 1
        self.samples_trained += len(read.samples)
        if read.ids is not None:
            self.uncommitted.append(read.ids)
        self.publishing.publish(self.version, self.updates, background=True)
        lags = read.staleness
        metrics.update({
            VERSION: self.version,
            UPDATES: self.updates,
            SAMPLES_TRAINED: self.samples_trained,
            TIME_WAIT_S: wait_s,
            TIME_READ_S: read.decode_s,
            TIME_COMPUTE_S: compute_s,
            TIME_PUBLISH_S: self.publishing.last_s,
            STALENESS_HIST: [lags.count(k) for k in range(max(lags) + 1)] if lags else [],
            TIME: time.time(),
        })
        return metrics

    def _finish(self, result: LearnerResult) -> None:
        """Stop the prompt producer, write the final checkpoint (then commit), fill in ``result``."""
        self.stop_event.set()
        self.publishing.wait()
        if self.reporter is not None:
            self.reporter.finish(result.stopped_by)
        # Collective: decided from what every rank knows (only rank 0 holds the batch ids).
        if self.updates != self._checkpointed or self.updates == 0 or result.stopped_by == STOP_SIGNAL:
            self.checkpoint()  # final checkpoint, then commit
        if self.prompts is not None:
            self.prompts.join()
        result.version, result.updates, result.samples = self.version, self.updates, self.samples_trained

    def _stop_reason(self, max_updates: int, deadline: float | None) -> str:
        """Why to stop now ("" to go on), agreed by all ranks (rank 0 may have seen the signal, and
        only rank 0 reads the buffer: STOP_DATA, the prompts of every epoch trained on)."""
        reasons = ("", *STOP_REASONS)
        local = STOP_SIGNAL if self.stop_event.is_set() else STOP_BUDGET if self.updates >= max_updates else \
            STOP_TIME if deadline is not None and time.monotonic() > deadline else \
            STOP_DATA if self.reader.used_up else ""
        agreed = int(all_reduce_max(torch.tensor([float(reasons.index(local))])).item())
        return reasons[agreed]

    def export(self, out_dir: str | Path) -> Path:
        from learner.checkpoint import export_hf

        return export_hf(self.engine, self.tokenizer, out_dir)

    def request_stop(self, *_: Any) -> None:
        log.info("learner: stop requested; finishing the current update and writing a checkpoint")
        self.stop_event.set()

    def close(self) -> None:
        """Stop the prompt producer and close the connections (the process may go on, e.g. in tests)."""
        self.stop_event.set()
        if self.prompts is not None:
            self.prompts.join()
        self.publishing.close()
        if self.reporter is not None:
            self.reporter.close()
        self.buffer.close()


def run_learner(cfg: Config, **budget: Any) -> LearnerResult:
    """Entry-point body: validate once, build, train until the budget or a signal."""
    validate(cfg)
    if cfg.buffer.url is None or cfg.weight_server.address is None:
        raise ConfigError(
            "rlhf-learner needs buffer.url=redis://... and weight_server.address=tcp://... "
            "(rlhf-run starts both for you on one machine)"
        )
    if cfg.buffer.run_id == "auto":
        raise ConfigError("rlhf-learner needs buffer.run_id=<name>: the key namespace its workers use too")
    learner = Learner(cfg)
    freeze_startup_heap()  # this call owns the process
    signal.signal(signal.SIGTERM, learner.request_stop)
    signal.signal(signal.SIGINT, learner.request_stop)
    try:
        result = learner.run(**budget)
        if cfg.learner.export_dir:
            learner.export(cfg.learner.export_dir)  # collective under ZeRO-3: every rank calls it
    finally:
        learner.close()
    shutdown_distributed()  # a rank that failed above leaves the others to torchrun, which stops them
    log.info("learner done at version %d after %d updates (%d samples)", result.version, result.updates, result.samples)
    return result
