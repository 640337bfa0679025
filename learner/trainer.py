"""The learner's outer loop: read a batch, update, publish v+1, checkpoint, then commit.

Order matters (invariant 3): the batch that produced version v+1 is acked in the buffer only
after v+1 is published and a checkpoint that contains it is on disk. A checkpoint records the
ids of the batches it has trained on; after a crash the restarted learner acks exactly those
(they are in its weights) and receives the rest again (they are not), trained from the restored
weights with staleness measured against the checkpoint's version, so the crash drops none of
them. So no sample is lost and none is trained twice beyond ``buffer.max_reuse``.

Versions never repeat with different weights: a restarted learner first offers its restored
weights under the checkpoint's own version. The weight server accepts that only when it holds
exactly those weights under that number (or nothing newer), so a clean restart continues at the
same version; when a version beyond the checkpoint was published before the crash, the
restored weights go out above the newest one, and the workers switch to them. From then on the
version runs ahead of the updates the weights hold; the buffer is told both, and paces
generation by the updates (:mod:`buffer.pacing`).

One line per update goes to ``metrics.jsonl`` before that update's checkpoint, so every
checkpointed update has its line. After a crash, the updates published but not checkpointed
are trained again and appear twice: the later line of a ``learner/updates`` value is the one
in the weights.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
import uuid
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from buffer import Buffer
from buffer.datasets import iter_prompts
from rlhf_core import lora
from rlhf_core.choices import Estimator
from rlhf_core.cli import append_line, freeze_startup_heap
from rlhf_core.config import Config, ConfigError, response_budget, validate
from rlhf_core.dapo import FILTER_REASONS
from rlhf_core.errors import FailureWindow, Unavailable, UserError
from rlhf_core.metric_names import (EVAL_PREFIX, EVAL_STATS, EVAL_VERSION, METRICS_FILE, SAMPLES_TRAINED, STALENESS_HIST,
                                    STOP_BUDGET, STOP_DATA, STOP_REASONS, STOP_SIGNAL, STOP_TIME, STOPPED_BY, TIME,
                                    TIME_COMPUTE_S, TIME_PUBLISH_S, TIME_READ_S, TIME_WAIT_S, UPDATES, VERSION)
from rlhf_core.models import load_policy, load_reference, load_tokenizer, load_critic
from rlhf_core.records import Prompt, Sample
from rlhf_core.tasks import builtin_prompts
from learner.batch import Collator, split_stop_token_misfits
from learner.engines import all_reduce_max, broadcast_samples, shutdown_distributed
from weight_server import StaleVersionError, WeightPublisher

log = logging.getLogger(__name__)

PROMPT_CHECK_S = 0.1  # the prompt producer looks at the queue's depth this often
PROMPT_LEAD_S = 3 * PROMPT_CHECK_S  # ... and tops it up to outlast three looks at the workers' rate
EVAL_CHECK_S = 1.0  # the learner looks for a new evaluation this often (when eval.every > 0)
STATS_EVERY_S = 0.25  # the learner's stats in Redis (monitor, run exporter) are refreshed at most this often
#: what rlhf_core.records.validate_sample says about token ids beyond the run's vocabulary
VOCAB_DEAD_LETTER = "outside the vocabulary"


class TokenizerMismatchError(UserError):
    """Workers tokenize with another vocabulary than the learner's model: nothing can be trained."""


@dataclass
class LearnerResult:
    version: int
    updates: int
    samples: int
    metrics: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=256))  # the latest updates' (bounded)
    stopped_by: str = STOP_BUDGET  # one of rlhf_core.metric_names.STOP_REASONS


def prompt_source(cfg: Config) -> Callable[[int], Iterable[Prompt]]:
    """Prompts of one epoch, from the built-in task or a local dataset."""
    return lambda epoch: iter_prompts(cfg.data, epoch, builtin=builtin_prompts)


def produce_prompts(buffer: Buffer, cfg: Config, stop: threading.Event,
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


class Learner:
    def __init__(self, cfg: Config, buffer: Buffer | None = None, output_dir: str | Path | None = None) -> None:
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
        self.eos_ids = _check_tokenizer(self.tokenizer, self.engine.module, cfg.rollout.stop_strings)
        algo = algorithm(cfg.algo.estimator)
        self.critic = make_engine(cfg, load_critic(cfg.model)) if algo.needs_critic else None
        needs_ref = (cfg.algo.kl_coef > 0 or algo.needs_reference) and cfg.rollout.ref_logprobs_on != "worker"
        self.ref = load_reference(cfg.model) if needs_ref else None
        self.updater = PolicyUpdater(cfg, self.engine, self.ref, self.critic)
        self.buffer = buffer or Buffer.connect(cfg.buffer.url, cfg.buffer.run_id, cfg.buffer)
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
        self.version = self._restored_version = 0
        self.samples_trained = 0
        self.updates = 0
        self.uncommitted: list[Any] = []  # rank 0: ids of the batches trained since the last checkpoint
        self._tracker_state: dict[str, str] = {}  # the trackers' run ids in the checkpoint
        self._checkpointed = 0  # self.updates at the last checkpoint (every rank knows it; ids only rank 0)
        extra = load_latest(self.ckpt_dir, self.engine, self.critic)
        if extra is not None:
            self._restore(extra)
        # Read before a crash and not in the checkpoint: trained again from the restored weights.
        self._replay = set(self.buffer.pending_for(self.consumer)) if self.rank0 else set()
        self._publish_dtype = {"as_trained": None, "bfloat16": torch.bfloat16, "float16": torch.float16}[
            cfg.learner.publish_dtype
        ]
        self.adapters_only = lora.enabled(cfg.model.lora)  # what a version holds: LoRA adapters, or everything
        self.metrics_path = self.output_dir / METRICS_FILE
        self._producer: threading.Thread | None = None
        self._producer_error: Exception | None = None
        self._used_up = False  # rank 0: the buffer said no batch can come any more from the prompts (Buffer.exhausted)
        self._misfits = FailureWindow(window=64, max_share=0.5, min_count=8)  # samples vs the learner's EOS ids
        self._vocab = vocab
        self.collate = Collator.for_model(self.engine.module, self.updater.device,
                                          cfg.algo.group_size if Estimator(cfg.algo.estimator).grouped else None)
        self._last_batch_time = time.time()  # dead letters older than this are not a reason to stop
        self.exporter = None
        if self.rank0 and cfg.learner.prometheus_port is not None:
            from rlhf_core.prometheus import learner_exporter

            self.exporter = learner_exporter(cfg.buffer.run_id)
            self.exporter.serve(cfg.learner.prometheus_port, setting="learner.prometheus_port")
        self.trackers = None
        if self.rank0 and cfg.run.loggers:
            from learner.trackers import Trackers

            self.trackers = Trackers(cfg, self.output_dir, self._tracker_state)
        self._last_trained: list[tuple[Sample, int]] = []  # the batch just trained, with staleness (the trackers' table)
        self._last_metrics: dict[str, Any] | None = None  # the newest update's, published at the end if throttled
        self._stats_at = -STATS_EVERY_S
        self._filter_checked, self._filter_counts = -EVAL_CHECK_S, {}
        self._eval_checked, self._eval_seen = -EVAL_CHECK_S, None  # the newest evaluation copied into metrics
        # Last: a constructor that fails before this line leaves no socket or thread behind.
        ws = cfg.weight_server
        self.publisher = WeightPublisher(ws.address, ws) if self.rank0 else None
        # rank 0 sends version v+1 on this thread while update v+2 trains (see publish)
        self._sender = ThreadPoolExecutor(1, thread_name_prefix="publish") if self.rank0 else None
        self._sending: Future | None = None

    # ------------------------------------------------------------------ resume

    def _restore(self, extra: dict[str, Any]) -> None:
        self.version = self._restored_version = int(extra["version"])
        self._tracker_state = dict(extra.get("trackers") or {})
        self.samples_trained = int(extra.get("samples_trained", 0))
        self.updates = self._checkpointed = int(extra.get("updates", 0))
        self.updater.load_state_dict(extra.get("updater", {}))
        if self.rank0 and extra.get("fill") and self.buffer.restore_fill_state(
                extra["fill"], admitted=self.updates * self.cfg.learner.batch_size):
            log.info("a fresh buffer: prompts go on from the checkpoint's cursor (epoch %d, prompt %d)",
                     extra["fill"]["epoch"], extra["fill"]["index"])
        trained_ids = extra.get("trained_ids", [])
        if self.rank0 and trained_ids:
            # in the weights already: ack them so they are not delivered again (idempotent)
            self.buffer.commit_ids(trained_ids)
        log.info("resumed from checkpoint at version %d (%d samples trained)", self.version, self.samples_trained)

    def _publish_start(self) -> None:
        """Publish the weights this learner starts from (initial or restored) under a number that
        never names other weights, and make it ``self.version``. Collective.

        First offer: the checkpoint's own version (0 when fresh) when the server holds nothing
        newer. The server takes it when it holds nothing at that number, or exactly these weights
        there (a restart after a clean checkpoint): training continues at the same version. It
        refuses other weights under a held number, and then (or when a version beyond the
        checkpoint was already published) the weights go out as the newest version + 1.

        "Published" counts the buffer's learner version too: a run restarted whole (``rlhf-run
        resume=``) has a fresh weight server, but its Redis data keeps samples tagged with the
        versions the dead learner published, and those numbers must not name other weights
        (such samples would look newer than the learner and be dead-lettered).
        """
        newest = self._newest_published()
        offer = self.version if newest is None or newest <= self.version else newest + 1
        for _ in range(3):  # a refusal means another publisher got there first: look again
            # only rank 0 asks the weight server; the others take its answer
            self.version = int(all_reduce_max(torch.tensor([float(offer)])).item())
            refused = float(not self.publish(refusable=True))
            if not all_reduce_max(torch.tensor([refused])).item():
                if self.version != self._restored_version:
                    what = (f"restored weights (checkpoint version {self._restored_version})" if self.updates
                            else "initial weights")
                    log.info("published the %s as version %d: the weight server already held versions up to %d, "
                             "published before a crash", what, self.version, self.version - 1)
                return
            newest = self._newest_published()
            offer = (newest if newest is not None else self.version) + 1
        raise UserError(f"the weight server at {self.cfg.weight_server.address} keeps refusing version {offer}: is a "
                        "second learner publishing to it? Give each run its own weight server")

    def _newest_published(self) -> int | None:
        """Rank 0: the newest version the weight server holds or the buffer was told of (None on other ranks)."""
        if not self.publisher:
            return None
        held = self.publisher.latest_version()
        told = self.buffer.learner_version()  # 0 when never set: no higher than any checkpoint's
        return told if held is None else max(held, told)

    # ------------------------------------------------------------------ the loop

    def publish(self, refusable: bool = False, background: bool = False) -> bool:
        """Publish the current weights as ``self.version``. Collective: every rank gathers (under
        ZeRO-3 module by module) CPU copies of the weights; rank 0 sends them to the weight server.

        ``background``: rank 0 sends on its publish thread and returns at once, so the next
        update trains while the weight server takes this version; the buffer learns the new
        version when the send is done. At most one send is in flight: the next publish, a
        checkpoint's commit (a batch is acked only once its version is published) and the end
        of the run wait for it, and re-raise its error.

        Returns False (rank 0, only when ``refusable``) if the server holds other weights under
        that version or a newer one; other ranks return True.
        """
        self.wait_published()
        t0 = time.monotonic()
        # with LoRA the adapters alone: the base weights every side loads from model.path never change
        tensors = (self.engine.named_trainable_parameters(self._publish_dtype) if self.adapters_only
                   else self.engine.named_full_parameters(self._publish_dtype))
        if self.publisher is None:
            for _ in tensors:  # keep in step with rank 0's gathers
                pass
            return True
        if background:
            # the copies are a snapshot: the next optimizer step changes the weights in place
            self._sending = self._sender.submit(self._send, self.version, self.updates, list(tensors), t0)
            return True
        try:
            self.publisher.publish(self.version, tensors)
        except StaleVersionError:
            if not refusable:
                raise
            for _ in tensors:  # finish the gathers the other ranks are in (a no-op when consumed)
                pass
            return False
        self._last_publish_s = time.monotonic() - t0
        return True

    def _send(self, version: int, updates: int, tensors: list[tuple[str, torch.Tensor]], t0: float) -> None:
        """The publish thread: send ``version``, then tell the buffer (workers pace against ``updates``)."""
        self.publisher.publish(version, tensors)
        self.buffer.set_learner_version(version, updates)
        self._last_publish_s = time.monotonic() - t0

    def wait_published(self) -> None:
        """Wait for the send in flight, if any; re-raise what it raised."""
        sending, self._sending = self._sending, None
        if sending is not None:
            sending.result()

    def checkpoint(self) -> None:
        """Save the weights, then ack the batches they hold. The version being sent is waited for
        first: a batch is acked only once the version it made is published (invariant 3)."""
        from learner.checkpoint import save_checkpoint

        self.wait_published()

        extra = {
            "version": self.version,
            "updates": self.updates,
            "samples_trained": self.samples_trained,
            "updater": self.updater.state_dict(),
            "trained_ids": [i for ids in self.uncommitted for i in ids],
            "incarnation": self.incarnation,
            # the prompt cursor: a run resumed on a fresh Redis starts its prompts here
            "fill": self.buffer.fill_state() if self.rank0 else None,
            # the trackers' run ids (those not in run.loggers now kept too: named again, they resume their run)
            "trackers": {**self._tracker_state, **(self.trackers.state() if self.trackers is not None else {})},
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
                self._used_up = False
                continue
            if reason:
                result.stopped_by = reason
                if reason == STOP_DATA:
                    log.info("every prompt of data.epochs=%d is trained on (what is left makes no batch): "
                             "stopping after %d updates (learner.max_updates=%d)", self.cfg.data.epochs,
                             self.updates, max_updates)
                break
            batch, samples = self._read()
            if not samples:
                continue
            metrics = self._train_one(batch, samples, t_wait)
            result.metrics.append(metrics)
            self._emit(metrics)
            # after the metrics line: a checkpointed update always has its line
            if self.updates % ckpt_every == 0:
                self.checkpoint()
            t_wait = time.monotonic()
        self._finish(result)
        return result

    def _start(self) -> None:
        """Publish the starting weights; rank 0 tells the buffer the version and starts the prompt producer."""
        self._last_publish_s = 0.0
        self._publish_start()
        if self.exporter is not None:  # the base of its counters: 0, or the restored checkpoint's totals
            self.exporter.update({UPDATES: self.updates, SAMPLES_TRAINED: self.samples_trained})
        if self.rank0:
            # pacing counts the updates: after a restart from a checkpoint, fewer than the version
            self.buffer.set_learner_version(self.version, self.updates)
            if self.cfg.data.source == "none":  # samples come from rlhf-gateway's sessions only
                return
            self._producer = threading.Thread(target=self._produce_prompts, name="prompts", daemon=True)
            self._producer.start()

    def _read(self) -> tuple[Any, list[Sample]]:
        """Rank 0 reads a batch (waiting up to 1 s); every rank gets the same samples (broadcast as
        wire bytes). When nothing came, rank 0 checks the dead letters for a tokenizer mismatch.
        A prompt producer that stopped on an error ends the run here, with that error."""
        if self._producer_error is not None:
            raise self._producer_error
        # newest: while re-delivered batches are read against the checkpoint's version, the
        # version being sent on the publish thread may already have made samples
        batch = self.buffer.read_batch(self.consumer, self._read_version(), self.cfg.learner.batch_size,
                                       timeout_s=1.0, newest=self.version) if self.rank0 else None
        if batch is not None:
            batch.samples = self._drop_stop_token_misfits(batch.samples)
            if not batch.samples:  # all dead-lettered: acked untrained, its admission back (pacing would stall)
                self.buffer.discard(batch)
                batch = None
        samples = broadcast_samples(batch.samples if batch is not None else [] if self.rank0 else None)
        if not samples and self.rank0:
            self._check_dead_letters()
            # the run's own prompts are its only source (no rlhf-gateway): it ends once they are used up
            if self.cfg.data.source != "none" and not self.cfg.gateway.enabled:
                self._used_up = self.buffer.exhausted(self.consumer, self._read_version(), self.cfg.learner.batch_size,
                                                      self.cfg.data.epochs)
        return batch, samples

    def _drop_stop_token_misfits(self, samples: list[Sample]) -> list[Sample]:
        """Dead-letter the few samples whose end-of-sequence tokens contradict the learner's (one
        such record once crash-looped the learner: re-delivered after every restart). When most
        recent samples misfit (more than half of the last 64, once 8 are seen), the tokenizers
        differ: BatchError, and the batch stays in the buffer."""
        keep, misfits = split_stop_token_misfits(samples, self.eos_ids, self._misfits)
        for s, reason in misfits:
            log.warning("dead-lettering %s", reason)
            self.buffer.dead_letter(reason, s.worker_id or "?", s.encode())
        return keep

    def _train_one(self, batch: Any, samples: list[Sample], t_wait: float) -> dict[str, Any]:
        """One update on ``samples``: train, advance the version, publish it. Returns the update's
        metrics. ``batch`` is rank 0's read (None elsewhere); ``t_wait`` when waiting for it began."""
        self._last_batch_time = time.time()
        # the version staleness is measured against (agreed: only rank 0 knows the replay)
        read_version = batch.learner_version if batch is not None else -1
        read_version = int(all_reduce_max(torch.tensor([float(read_version)])).item())
        if batch is not None and self._replay:
            # re-delivered entries come first: a batch without one means none is coming back
            self._replay = self._replay - set(batch.ids) if self._replay & set(batch.ids) else set()
        # waiting: from the end of the last update until this one starts, less rank 0's decoding of
        # the batch (CPU work of its own, reported as learner/time_read_s)
        read_s = batch.decode_s if batch is not None else 0.0
        wait_s = max(0.0, time.monotonic() - t_wait - read_s)
        lags = [read_version - smp.oldest_version for smp in samples]
        t_compute = time.monotonic()
        metrics = self.updater.update(self.collate(samples), read_version)
        compute_s = time.monotonic() - t_compute
        self.version += 1
        self.updates += 1
        self.samples_trained += len(samples)
        self._last_trained = list(zip(samples, lags)) if self.trackers is not None else []
        if batch is not None:
            self.uncommitted.append(list(batch.ids))
        self.publish(background=True)
        metrics.update({
            VERSION: self.version,
            UPDATES: self.updates,
            SAMPLES_TRAINED: self.samples_trained,
            TIME_WAIT_S: wait_s,
            TIME_READ_S: read_s,
            TIME_COMPUTE_S: compute_s,
            TIME_PUBLISH_S: self._last_publish_s,
            STALENESS_HIST: [lags.count(k) for k in range(max(lags) + 1)] if lags else [],
            TIME: time.time(),
        })
        return metrics

    def _emit(self, metrics: dict[str, Any]) -> None:
        """Rank 0: one line in metrics.jsonl (a full disk stops the learner with one line naming it,
        exit 2: a restart would meet the same disk), the monitor's stats in Redis, Prometheus, TensorBoard."""
        if not self.rank0:
            return
        if self.cfg.eval.every:
            self._merge_eval(metrics)
        if self.cfg.algo.filter_groups:
            self._merge_filter_counts(metrics)
        append_line(self.metrics_path, json.dumps(metrics))
        self._last_metrics = metrics
        now = time.monotonic()
        if now - self._stats_at >= STATS_EVERY_S:  # its readers sample once a second; a Redis write per update is waste
            self._stats_at = now
            self.buffer.publish_stats("learner", metrics)
        if self.exporter is not None:
            self.exporter.update(metrics)
        if self.trackers is not None:
            self.trackers.log_update(metrics, self.version)
            if self.trackers.due(self.version):
                self.trackers.log_details(self._sample_rows(), self._worker_stats(), self.version)

    def _merge_eval(self, metrics: dict[str, Any]) -> None:
        """Copy a new evaluation (the evaluator's record in the buffer, looked at once a second)
        into this update's metrics: metrics.jsonl and the trackers then have it, at this step."""
        now = time.monotonic()
        if now - self._eval_checked < EVAL_CHECK_S:
            return
        self._eval_checked = now
        try:
            stats = self.buffer.stats(EVAL_STATS)
        except Exception:  # noqa: BLE001  # evaluation is a view: it never stops training
            log.debug("no evaluation record", exc_info=True)
            return
        if not stats or stats.get(EVAL_VERSION) == self._eval_seen:
            return
        self._eval_seen = stats.get(EVAL_VERSION)
        metrics.update({k: v for k, v in stats.items() if k.startswith(EVAL_PREFIX)})

    def _merge_filter_counts(self, metrics: dict[str, Any]) -> None:
        """The group filter's counts (``algo.filter_groups``: groups the workers dropped, per reason,
        from the buffer's counters, read at most once a second) into every metrics line:
        ``filter/groups_filtered``, ``filter/groups_filtered_<reason>``, ``filter/filtered_frac``
        (of the groups completed)."""
        now = time.monotonic()
        if now - self._filter_checked >= EVAL_CHECK_S:
            self._filter_checked = now
            try:
                c = self.buffer.metrics()["counters"]
            except Exception:  # noqa: BLE001  # a view: it never stops training
                log.debug("no buffer counters for the filter metrics", exc_info=True)
            else:
                filtered = float(c.get("groups_filtered", 0))
                self._filter_counts = {
                    "filter/groups_filtered": filtered,
                    "filter/samples_filtered": float(c.get("samples_filtered", 0)),
                    **{f"filter/groups_filtered_{r}": float(c.get(f"groups_filtered_{r}", 0)) for r in FILTER_REASONS},
                    "filter/filtered_frac": filtered / max(1.0, filtered + float(c.get("groups_appended", 0))),
                }
        metrics.update(self._filter_counts)

    def _sample_rows(self) -> list[list[Any]]:
        """The trackers' table: prompt and response text, reward, staleness, worker of the batch just trained."""
        def text(ids: Any) -> str:
            ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
            return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer else str(ids)

        return [[text(s.prompt_ids), text(s.response_ids), float(s.reward), lag, s.worker_id]
                for s, lag in self._last_trained[: self.cfg.run.log_samples]]

    def _worker_stats(self) -> dict[str, Any]:
        """Per-worker stats from the buffer snapshot (empty when Redis does not answer: never stops training)."""
        try:
            consumers = self.buffer.metrics().get("consumers", {})
        except Exception:  # noqa: BLE001
            log.debug("no buffer snapshot for the trackers", exc_info=True)
            return {}
        return {name: c.get("stats", {}) for name, c in consumers.items() if isinstance(c, dict)}

    def _finish(self, result: LearnerResult) -> None:
        """Stop the prompt producer, write the final checkpoint (then commit), fill in ``result``."""
        self.stop_event.set()
        self.wait_published()
        if self.rank0:  # the final stats, whatever the throttle held back, and why the run stopped (the summary's)
            self.buffer.publish_stats("learner", {**(self._last_metrics or {}), STOPPED_BY: result.stopped_by})
        # Collective: decided from what every rank knows (only rank 0 holds the batch ids).
        if self.updates != self._checkpointed or self.updates == 0 or result.stopped_by == STOP_SIGNAL:
            self.checkpoint()  # final checkpoint, then commit
        if self._producer is not None:
            self._producer.join(timeout=10)
        result.version, result.updates, result.samples = self.version, self.updates, self.samples_trained

    def _read_version(self) -> int:
        """The learner version a read filters staleness against: the current one, except while the
        batches read before a crash are delivered again. Those were admitted against the versions
        of the lost updates (>= the checkpoint's), and the restored weights are the checkpoint's;
        measured against the newer number a bump above the lost versions gave, they could be
        dropped as stale, which would lose them to the crash."""
        return self._restored_version if self._replay else self.version

    def _stop_reason(self, max_updates: int, deadline: float | None) -> str:
        """Why to stop now ("" to go on), agreed by all ranks (rank 0 may have seen the signal, and
        only rank 0 reads the buffer: STOP_DATA, the prompts of every epoch trained on)."""
        reasons = ("", *STOP_REASONS)
        local = STOP_SIGNAL if self.stop_event.is_set() else STOP_BUDGET if self.updates >= max_updates else \
            STOP_TIME if deadline is not None and time.monotonic() > deadline else STOP_DATA if self._used_up else ""
        agreed = int(all_reduce_max(torch.tensor([float(reasons.index(local))])).item())
        return reasons[agreed]

    def _check_dead_letters(self) -> None:
        """Rank 0, after a read that found nothing: if a whole batch worth of samples was dead-lettered
        since the last batch because of token ids beyond the learner's vocabulary, the workers use
        another tokenizer and no batch will ever come; stop with a message that says so."""
        want = self.cfg.learner.batch_size
        try:
            recent = self.buffer.dead_letters(count=want)
        except Exception:  # noqa: BLE001  # a diagnostic must never stop training
            log.debug("cannot read dead letters", exc_info=True)
            return
        vocab = [d for d in recent if d["kind"] == "sample" and VOCAB_DEAD_LETTER in d["reason"]
                 and _float(d["ts"]) >= self._last_batch_time]
        if len(vocab) < want:
            return
        producers = sorted({d["producer"] for d in vocab})
        raise TokenizerMismatchError(
            f"no batch can form: the last {len(vocab)} samples from worker(s) {', '.join(producers)} were "
            f"dead-lettered by the buffer ({vocab[-1]['reason']}). The learner's model has {self._vocab} tokens, so the workers "
            "tokenize with another tokenizer: point model.path / model.tokenizer_path of workers and learner at the "
            "same model, then restart them"
        )

    def _produce_prompts(self) -> None:
        """The producer thread: :func:`produce_prompts` until every epoch is queued or the run
        stops; what ends it early is raised by the training loop at its next read."""
        try:
            produce_prompts(self.buffer, self.cfg, self.stop_event)
        except Exception as exc:  # noqa: BLE001  # handed to the training loop, which ends the run on it
            if isinstance(exc, UserError):
                log.error("prompt producer stopped: %s", exc)
            else:
                log.exception("prompt producer failed")
            self._producer_error = exc

    def export(self, out_dir: str | Path) -> Path:
        from learner.checkpoint import export_hf

        return export_hf(self.engine, self.tokenizer, out_dir)

    def request_stop(self, *_: Any) -> None:
        log.info("learner: stop requested; finishing the current update and writing a checkpoint")
        self.stop_event.set()

    def close(self) -> None:
        """Stop the prompt producer and close the connections (the process may go on, e.g. in tests)."""
        self.stop_event.set()
        if self._producer is not None:
            self._producer.join(timeout=10)
        if self._sender is not None:
            self._sender.shutdown(wait=True)
        if self.publisher is not None:
            self.publisher.close()
        if self.exporter is not None:
            self.exporter.close()
        if self.trackers is not None:
            self.trackers.close()
        self.buffer.close()


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return 0.0


def _check_tokenizer(tokenizer: Any, model: torch.nn.Module, stop_strings: Iterable[str] = ()) -> frozenset[int]:
    """Refuse a tokenizer that does not fit the model; return the end-of-sequence ids the workers
    stop generation at (the tokenizer's and the model's generation config's, as the workers do),
    which every sample is checked against (a tokenizer mismatch). None with ``stop_strings``: a
    response may then stop on any token."""
    config = getattr(model, "config", None)
    vocab = getattr(config, "vocab_size", None)
    eos: set[int] = set()
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos.add(int(tokenizer.eos_token_id))
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    eos.update([int(gen_eos)] if isinstance(gen_eos, int) else [int(t) for t in gen_eos or []])
    if tokenizer is not None and vocab is not None:
        specials = {name: getattr(tokenizer, f"{name}_token_id", None) for name in ("eos", "pad", "bos")}
        out = {n: i for n, i in specials.items() if isinstance(i, int) and not 0 <= i < vocab}
        if len(tokenizer) > vocab or out:
            raise ConfigError(
                f"the tokenizer ({len(tokenizer)} tokens; special ids {specials}) does not fit the model's vocabulary "
                f"of {vocab} (model.path={getattr(config, 'name_or_path', '?')}): model.tokenizer_path must name the "
                "tokenizer the model was trained with"
            )
    return frozenset() if stop_strings else frozenset(eos)


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
