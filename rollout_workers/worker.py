"""The rollout worker loop: claim, generate, score, append, heartbeat, follow the weights.

A worker holds no state that matters. Prompts are leased from the buffer, so killing a worker
at any moment loses nothing (its leases expire and another worker reclaims them); a new worker
anywhere with the Redis URL and the weight server's address joins the run with the newest weights.

Threads:

* **main** drives the engine (engines are single-threaded): claim within the admission budget,
  ``engine.add`` a group of ``group_size`` requests per prompt, ``engine.step`` (one decoding
  step), hand each finished response to the scoring pool at once (no batch barrier), append a
  group and ack its prompt in one atomic ``Buffer.complete`` as soon as its last sample is
  scored, and between decoding steps apply a newer weight version in place (tokens sampled
  after the swap carry the new version: per-token versions). The KV cache of running sequences
  is kept, so a token after the swap is drawn from the new weights on top of keys/values the
  old ones computed; its behaviour log-prob is that distribution's, exactly (tested).
* **score** (``reward.num_threads`` at once, :mod:`rollout_workers.scoring`) runs reward
  functions/models and, optionally, reference log-probs over batches of finished groups,
  overlapping generation; a reward call past ``reward.timeout_s`` is abandoned and its samples
  dead-lettered.
* **env** (``rollout.env_threads``, and one asyncio loop for async environments) runs the
  environments of multi-turn episodes (:mod:`rollout_workers.episodes`): with ``rollout.env``
  set, each of a group's ``group_size`` members is an episode of several turns, each turn one
  engine request over the whole context so far, and the main thread keeps decoding every other
  episode while one's environment works.
* **heartbeat** renews the leases every ``buffer.heartbeat_interval_s`` while a step, a weight
  pull or a shutdown drain runs, and publishes :class:`WorkerStats` for the monitor; leases
  that another worker took over (this one was too slow) are reported back and abandoned.

The ``Buffer`` object is shared by the three threads under one lock: it tracks this worker's
leases client-side and is documented as not thread-safe for one consumer.

Shutdown (SIGTERM/SIGINT, or a budget in tests): stop claiming, finish in-flight prompts for
``rollout.shutdown_grace_s`` while heartbeating, release the rest (re-delivered at once, not
counted as a failed delivery), exit 0. A second signal skips the grace period.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import signal
import socket
import threading
import time
import uuid
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
from omegaconf import DictConfig

from buffer import Buffer, Lease
from buffer.gateway import WorkerChannel
from buffer.keys import check_consumer
from rlhf_core import metric_names as M
from rlhf_core.cli import WORKER_ID_ENV, freeze_startup_heap
from rlhf_core.config import ENV_COMPONENT, Config, ConfigError, env_target, response_budget, to_object, validate
from rlhf_core.dapo import group_filter
from rlhf_core.errors import FailureWindow, UserError
from rlhf_core.models import load_reference, load_tokenizer
from rlhf_core.prometheus import GENERATION, SCORING, WEIGHT_SYNC
from rlhf_core.records import Sample, rle_encode
from rlhf_core.sampling import response_logprobs
from rollout_workers.engine import GenRequest, GenResult, RequestError, SamplingParams
from rollout_workers.engine_factory import make_engine
from rollout_workers.environment import EnvFactory
from rollout_workers.episodes import Episode, EpisodeRunner
from rollout_workers.gateway_calls import BackgroundChannel, GatewayCalls
from rollout_workers.prompts import PromptRejected, PromptRenderer
from rollout_workers.rewards import (EMPTY_DEAD_LETTER, CallWatch, RewardError, Scorer, ScoreItem, is_empty_response,
                                     reward_failing)
from rollout_workers.scoring import ScoringPool
from weight_server import TensorMismatchError, WeightSubscriber

log = logging.getLogger(__name__)

IDLE_CLAIM_BLOCK_S = 0.25  # an idle worker waits this long per claim (woken early by new prompts/budget)
BUSY_CLAIM_BACKOFF_S = 0.05  # a busy worker whose claim got nothing retries after this (not every step)
WEIGHT_RETRY_S = 5.0  # pause after a failed pull of an announced version
MAX_LOGGED_REASONS = 1024  # dead-letter reasons counted for rate-limited logging
_REASON_DETAILS = re.compile(r"'[^']*'|\d+")  # what differs between two reasons of one kind
#: heartbeat stats key -> engine attribute, for engines that count their forward passes (hf)
ENGINE_COUNTERS = {M.WORKER_ENGINE_STEPS: "num_steps", M.WORKER_ENGINE_PREFILLS: "num_prefills",
                   M.WORKER_ENGINE_REUSED: "num_reused_tokens", M.WORKER_ENGINE_PROMPT: "num_prompt_tokens"}


class PromptsRejected(UserError):
    """Most recent prompts were rejected (too long for the context, unrenderable): the data or the
    limits are wrong, and the run would otherwise idle with nothing to train on."""


@dataclass
class WorkerStats:
    """Throughput accounting, written with every heartbeat into the buffer's consumer record
    (``Buffer.metrics()["consumers"][worker_id]["stats"]``) where the monitor reads it."""

    started: float = field(default_factory=time.monotonic)
    prompts: int = 0  # groups appended (prompts completed with >= 1 sample)
    prompts_empty: int = 0  # prompts acked with no sample (all dead-lettered, or the prompt rejected)
    samples: int = 0
    tokens: int = 0  # generated tokens of finished responses
    dead_letters: int = 0
    duplicates: int = 0  # completions refused: another worker completed the prompt first
    leases_lost: int = 0  # groups abandoned because another worker reclaimed their lease
    released: int = 0  # prompts given back at shutdown
    weight_updates: int = 0
    t_generate: float = 0.0  # in engine.step
    t_score: float = 0.0  # scoring threads' busy time, summed over threads (overlaps generation)
    reward_calls: int = 0  # calls of a reward function or model (per sample, or per batch when batched)
    reward_timeouts: int = 0  # reward calls abandoned after reward.timeout_s
    empty_responses: int = 0  # responses with no text (handled as reward.empty_response says)
    t_wait: float = 0.0  # in claim: waiting for prompts / admission budget
    groups_filtered: int = 0  # groups dropped by algo.filter_groups (their prompts acked, budget returned)
    samples_filtered: int = 0
    t_weights: float = 0.0  # pulling and applying weights

    def as_dict(self, version: int | None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        elapsed = max(time.monotonic() - self.started, 1e-9)
        d: dict[str, Any] = {k: v for k, v in dataclasses.asdict(self).items() if k != "started"}
        d.update(
            version=version,
            prompts_per_s=self.prompts / elapsed,
            samples_per_s=self.samples / elapsed,
            tokens_per_s=self.tokens / elapsed,
            reward_calls_per_s=self.reward_calls / elapsed,
            uptime_s=elapsed,
        )
        d.update(extra or {})
        return d


@dataclass(eq=False)  # hashed by identity: a prompt claimed again after a lost lease is another group
class _Group:
    """One claimed prompt being generated: ``size`` requests ``{lease_id}/{i}``; finished
    responses wait in ``results`` until the group is whole, then go to scoring together."""

    lease: Lease
    group_id: str
    prompt_text: str
    prompt_ids: list[int]
    created_at: float
    size: int
    results: dict[int, GenResult | Episode] = field(default_factory=dict)  # an Episode with rollout.env
    # per index: (sample, None, b"") or (None, reason, raw sample) for the dead-letter stream
    outcomes: dict[int, tuple[Sample | None, str | None, bytes]] = field(default_factory=dict)


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class RolloutWorker:
    """One worker. ``run()`` works until :meth:`request_stop` (or a budget); see the module docstring."""

    def __init__(self, cfg: Config, worker_id: str | None = None, buffer: Buffer | None = None) -> None:
        self.cfg = cfg
        self.worker_id = check_consumer(worker_id or default_worker_id())
        self.stop_event = threading.Event()
        self._abort_drain = False
        # Environment and reward config errors surface before any connection is opened or the policy is loaded.
        self.env_factory = EnvFactory(cfg.rollout) if env_target(cfg.rollout) else None
        self.scorer = Scorer(cfg.reward, cfg.model, environment=self.env_factory is not None)
        self.reward_failures = FailureWindow(cfg.reward.failure_window, cfg.reward.max_failure_share)
        self.prompt_rejections = FailureWindow(window=64, max_share=0.5, min_count=16)  # prompts too long, unrenderable
        self._logged_reasons: dict[str, int] = {}  # dead-letter reason -> times seen (logging is rate-limited)
        self._own_buffer = buffer is None
        self.buffer = buffer or Buffer.connect(cfg.buffer.url, cfg.buffer.run_id, cfg.buffer)
        self._buf_lock = threading.Lock()
        self.group_size = 0  # from the run's parameters once joined (the learner's init_run decides)
        self.tokenizer = load_tokenizer(cfg.model)
        self.renderer = PromptRenderer(self.tokenizer, cfg.rollout.max_prompt_tokens, cfg.rollout.prompt_overflow)
        self.sampling = SamplingParams.from_config(cfg.rollout)
        # Each worker samples with its own stream, reproducibly for a given worker id.
        seed = (int(cfg.rollout.seed) + zlib.crc32(self.worker_id.encode())) % (1 << 31)
        engine_cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, seed=seed))
        self.engine = make_engine(engine_cfg, None, self.tokenizer)
        self.reference = load_reference(cfg.model) if cfg.rollout.ref_logprobs_on == "worker" else None
        self.episodes: EpisodeRunner | None = None
        if self.env_factory is not None:
            r = cfg.rollout
            context = int(getattr(self.engine, "max_model_len", 0) or r.max_prompt_tokens + response_budget(r))
            self.episodes = EpisodeRunner(self.engine, self.tokenizer, self.renderer, self.sampling, self.env_factory,
                                          max_turns=r.max_turns, max_context=context, threads=r.env_threads,
                                          timeout_s=r.env_timeout_s, max_response=response_budget(r))
        rc = cfg.reward
        self.scoring: ScoringPool[tuple[_Group, int]] = ScoringPool(
            self._score_batch, self._timed_out, num_threads=rc.num_threads, batch_size=rc.batch_size,
            max_wait_s=rc.max_wait_ms / 1000.0, timeout_s=rc.timeout_s)
        self.gateway: GatewayCalls | None = None
        if cfg.gateway.enabled:
            channel = BackgroundChannel(WorkerChannel(self.buffer.redis, self.buffer.keys), self.worker_id)
            self.gateway = GatewayCalls(channel, self.engine, self.worker_id)
        self.has_weights = False  # engine.version is meaningful only after the first pull
        self.groups: dict[str, _Group] = {}  # by lease id
        self.stats = WorkerStats()
        self._lost: set[str] = set()  # lease ids the heartbeat found taken over; guarded by _buf_lock
        self._last_stats: dict[str, Any] = {"version": None}  # the heartbeat's last stats that built
        self._hb_stop = threading.Event()
        self._hb_thread: threading.Thread | None = None
        self._next_claim_at = 0.0
        self._failed_pull: tuple[int | None, float] = (None, 0.0)  # (announced version, retry after)
        self.exporter = None
        if cfg.rollout.prometheus_port is not None:
            from rlhf_core.prometheus import worker_exporter

            # workers started by rlhf-run are named worker-<i>: worker i serves on port + i
            tail = self.worker_id.rsplit("-", 1)[-1]
            index = int(tail) if tail.isdigit() else 0
            self.exporter = worker_exporter(self.worker_id, cfg.buffer.run_id)
            self.exporter.serve(cfg.rollout.prometheus_port + index if cfg.rollout.prometheus_port else 0,
                                setting="rollout.prometheus_port (worker i serves on it + i)")
        # Last: a constructor that fails before this line leaves no socket behind.
        ws = cfg.weight_server
        self.weights = WeightSubscriber(ws.address, ws.pub_address, ws, worker_id=self.worker_id)

    # ------------------------------------------------------------------ joining

    def _join_run(self) -> bool:
        """Wait for the run's parameters (the learner's init_run); False if stopped first."""
        logged = False
        while not self.stop_event.is_set():
            with self._buf_lock:
                ready = self.buffer.initialised()
            if ready:
                with self._buf_lock:
                    self.group_size = int(self.buffer.run_params()["group_size"])
                if self.group_size != self.cfg.algo.group_size:
                    log.warning("run %s has group_size %d; using it instead of algo.group_size=%d",
                                self.cfg.buffer.run_id, self.group_size, self.cfg.algo.group_size)
                return True
            if not logged:
                log.info("worker %s: run %s is not initialised yet; waiting for the learner", self.worker_id, self.cfg.buffer.run_id)
                logged = True
            self.stop_event.wait(0.25)
        return False

    # ------------------------------------------------------------------ weights

    def pull_newest(self) -> bool:
        """Pull the newest version, verified, into the engine (between steps). False: nothing applied."""
        t0 = time.monotonic()
        target = self.engine.weights_target()
        try:
            got = self.weights.pull(None, into=target)  # in place into the model (LoRA: its adapters) when offered
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
        """Block until a first version is applied (the learner publishes one at start); False if stopped."""
        retry_at = 0.0
        tried: int | None = None
        logged = False
        while not self.stop_event.is_set():
            # Pull at once (a late joiner gets the newest version), then when a new version is
            # announced, and every few seconds in case announcements cannot reach us: no request
            # storm while the learner starts.
            announced = self.weights.poll_announcement(timeout_ms=100)
            if announced != tried or time.monotonic() >= retry_at:
                tried, retry_at = announced, time.monotonic() + WEIGHT_RETRY_S
                if self.pull_newest():
                    return True
            if not logged:
                log.info("worker %s: waiting for a first weight version at %s", self.worker_id, self.cfg.weight_server.address)
                logged = True
        return False

    def _maybe_update_weights(self) -> None:
        newest = self.weights.poll_announcement(timeout_ms=0)  # non-blocking: cheap between decoding steps
        if newest is None or newest <= self.engine.version:
            return
        self._pull_towards(newest, "announced")

    def _pull_towards(self, wanted: int, why: str) -> None:
        """Pull the newest weights because version ``wanted`` exists. A failed pull (server down:
        it costs weight_server.request_timeout_s) is retried only after a pause or for a newer
        version; meanwhile generation goes on with the current weights."""
        last, retry_at = self._failed_pull
        if last is not None and wanted <= last and time.monotonic() < retry_at:
            return
        if self.pull_newest():
            self._failed_pull = (None, 0.0)
            return
        self._failed_pull = (wanted, time.monotonic() + WEIGHT_RETRY_S)
        log.warning("worker %s: could not pull v%d (%s); generating with v%d, retrying in %.0f s",
                    self.worker_id, wanted, why, self.engine.version, WEIGHT_RETRY_S)

    # ------------------------------------------------------------------ claim + generate

    def _free_slots(self) -> int:
        return int(self.cfg.rollout.slots) - self.engine.num_active() - self.engine.num_waiting()

    def _free_prompt_capacity(self) -> int:
        """Prompts to claim now: fill the slots plus up to one group waiting, so a freed slot is
        refilled at the next step (continuous batching) without holding many idle leases.

        Responses still waiting to be scored count as busy slots: when scoring is the bottleneck
        the worker stops claiming instead of piling up leases (and admission budget) behind it."""
        free = self._free_slots() - self.scoring.in_flight()
        if self.episodes is not None:
            # An episode whose environment is working holds no slot: the engine decodes others
            # meanwhile, which is how environment latency is hidden. Calls still waiting for an
            # environment thread count as busy, so the episodes in flight stay bounded.
            free -= self.episodes.queued_for_env()
        # ceil(free / G): an idle worker always takes at least one prompt, even when a group is
        # larger than the slots (the engine queues the rest)
        return max(0, (free + self.group_size - 1) // self.group_size)

    def _claim(self, block_s: float, limit: int | None) -> None:
        capacity = self._free_prompt_capacity()
        if limit is not None:
            capacity = min(capacity, limit)
        now = time.monotonic()
        if capacity <= 0 or (block_s == 0 and now < self._next_claim_at):
            return
        # only a claim that may wait: a taker that sees the flag wakes every idle worker of the run
        waiting = self.gateway.waiting() if self.gateway is not None and block_s > 0 else contextlib.nullcontext(None)
        with self._buf_lock, waiting as interrupt:
            leases = self.buffer.claim(self.worker_id, max_prompts=capacity, block_s=block_s, interrupt=interrupt)
        self.stats.t_wait += time.monotonic() - now
        if not leases:
            self._next_claim_at = time.monotonic() + BUSY_CLAIM_BACKOFF_S
            return
        started = 0
        try:
            # Pacing's staleness bound assumes generation with weights >= the version at admission.
            need = max(lease.learner_version for lease in leases)
            if need > self.engine.version:
                self._pull_towards(need, "the learner's version when the prompts were admitted")
            for lease in leases:
                self._start_group(lease)
                started += 1
        except BaseException:
            # _release_all gives back only self.groups: the leases of this claim not started yet
            # would stay pending until they expire (and come back to the next worker oldest first).
            # A lease completed meanwhile (a rejected prompt) is no longer held: its release is a no-op.
            self._release([lease for lease in leases[started:] if lease.lease_id not in self.groups],
                          "failed before starting them", "claimed")
            raise

    def _reject_prompt(self, lease: Lease, reason: str) -> None:
        seen = self._seen(reason)
        if seen == 1 or seen % 100 == 0:
            log.warning("worker %s: prompt %s dead-lettered (%d time(s) for this reason): %s", self.worker_id,
                        lease.prompt.prompt_id, seen, reason)
        with self._buf_lock:
            # dead letter + ack with no samples (its admission budget goes back), in one atomic step
            self.buffer.complete(lease, [], rejected=[("prompt", reason, lease.prompt.encode())])
        self.stats.dead_letters += 1
        self.stats.prompts_empty += 1
        if self.prompt_rejections.record(True, reason):
            raise PromptsRejected(
                f"{self.prompt_rejections.failures} of the last {len(self.prompt_rejections.recent)} prompts were "
                f"rejected, the last because: {reason}. Fix the data or the limits (rollout.max_prompt_tokens, "
                "rollout.prompt_overflow=truncate, the model's context); no batch can form while most are rejected"
            )

    def _start_group(self, lease: Lease) -> None:
        prompt = lease.prompt
        held = self.groups.get(lease.lease_id)
        if held is not None:
            # its own lease, expired while this process was paused (SIGSTOP, swapping) and claimed
            # back by this worker: the prompt is still being generated here, so that goes on under
            # the new delivery (adding its requests again would fail on their ids, dead-lettering it)
            log.info("worker %s: prompt %s came back to this worker, which still generates it (its lease expired "
                     "while the process was paused)", self.worker_id, prompt.prompt_id)
            held.lease = lease
            with self._buf_lock:  # a heartbeat may have found the old delivery lost: this one is held
                self._lost.discard(lease.lease_id)
            return
        if self.episodes is not None:  # each member an episode; its environment's reset renders its prompt
            group = _Group(lease, f"{prompt.prompt_id}:e{prompt.epoch}:{lease.lease_id}", prompt.text, [], time.time(),
                           self.group_size)
            self.groups[lease.lease_id] = group
            for i in range(self.group_size):
                self.episodes.start(f"{lease.lease_id}/{i}", prompt, tag=(group, i))
            return
        try:
            text, ids = self.renderer.render(prompt)
        except PromptRejected as exc:
            self._reject_prompt(lease, str(exc))
            return
        # Deterministic ids (the lease id is the prompt's stream id): a re-delivered prompt gets the same ones.
        group = _Group(lease, f"{prompt.prompt_id}:e{prompt.epoch}:{lease.lease_id}", text, ids, time.time(), self.group_size)
        added: list[str] = []
        try:
            for i in range(self.group_size):
                request_id = f"{lease.lease_id}/{i}"
                self.engine.add(GenRequest(request_id, ids, self.sampling))
                added.append(request_id)
        except RequestError as exc:  # e.g. longer than the model's context
            for request_id in added:
                self.engine.abort(request_id)
            self._reject_prompt(lease, str(exc))
            return
        self.groups[lease.lease_id] = group
        self.prompt_rejections.record(False)

    def _counting_gateway_tokens(self, call: Callable[..., Any], *args: Any) -> Any:
        """``call(*args)`` on the gateway's calls; the tokens of the calls it ends (finished or
        aborted) count as generated, like prompts' (the run's summary, the monitor)."""
        before = self.gateway.stats["gateway_tokens"]
        out = call(*args)
        self.stats.tokens += self.gateway.stats["gateway_tokens"] - before
        return out

    def _step(self) -> None:
        t0 = time.monotonic()
        finished = self.engine.step()
        self.stats.t_generate += time.monotonic() - t0
        if self.gateway is not None:
            finished = self._counting_gateway_tokens(self.gateway.after_step, finished, self._free_slots())
        for result in finished:
            if self.episodes is not None:  # a turn: its episode goes on (or ends) in _collect_episodes
                self.stats.tokens += result.num_tokens
                self.episodes.on_result(result)
                continue
            lease_id, _, index = result.request_id.rpartition("/")
            group = self.groups.get(lease_id)
            if group is None:  # abandoned group
                continue
            self.stats.tokens += result.num_tokens
            self.stats.empty_responses += int(is_empty_response(result.text))
            if self.exporter is not None:
                self.exporter.observe(GENERATION, time.time() - group.created_at)
            group.results[int(index)] = result
            if len(group.results) == group.size:  # scored a whole group at a time: batches hold whole groups
                self.scoring.submit([((group, i), (group, i, r)) for i, r in sorted(group.results.items())])

    def _collect_episodes(self, block_s: float = 0.0) -> None:
        """Environments' answers in (next turns queued); finished episodes into their groups, and
        a group whose episodes all finished to scoring. ``block_s``: wait that long for an answer
        when nothing else is to be done."""
        if self.episodes is None:
            return
        for ep in self.episodes.poll(block_s):
            group, index = ep.tag
            if self.groups.get(group.lease.lease_id) is not group:  # abandoned or released meanwhile
                continue
            if self.exporter is not None:
                self.exporter.observe(GENERATION, time.time() - group.created_at)
            group.results[index] = ep
            if len(group.results) == group.size:
                self.scoring.submit([((group, i), (group, i, r)) for i, r in sorted(group.results.items())])

    # ------------------------------------------------------------------ score + emit

    def _new_sample(self, group: _Group, index: int, result: GenResult | Episode) -> Sample:
        prompt = group.lease.prompt
        if isinstance(result, Episode):
            return self._episode_sample(group, index, result)
        return Sample(
            sample_id=f"{group.group_id}/{index}",
            prompt_id=prompt.prompt_id,
            group_id=group.group_id,
            prompt_ids=np.asarray(group.prompt_ids, dtype=np.int32),
            response_ids=result.token_ids,
            behaviour_logprobs=result.logprobs,
            versions=rle_encode(result.versions.tolist()),
            reward=0.0,
            finish_reason=result.finish_reason,
            worker_id=self.worker_id,
            group_size=group.size,
            group_index=index,
            created_at=group.created_at,
            metadata={"prompt_epoch": prompt.epoch, "prompt_index": prompt.index},
        )

    def _episode_sample(self, group: _Group, index: int, ep: Episode) -> Sample:
        """An episode as one sample: its transcript (policy tokens as sampled, loss mask 0 elsewhere)."""
        prompt = group.lease.prompt
        meta = {"prompt_epoch": prompt.epoch, "prompt_index": prompt.index, "turns": len(ep.turns),
                "retokenisation_drift": ep.drift_turns}
        common = dict(sample_id=f"{group.group_id}/{index}", prompt_id=prompt.prompt_id, group_id=group.group_id,
                      finish_reason=ep.finish_reason or "abort", worker_id=self.worker_id, group_size=group.size,
                      group_index=index, created_at=group.created_at, metadata=meta)
        if ep.transcript is None:  # failed before its first turn: an empty record for the dead letter
            return Sample(prompt_ids=np.zeros(0, dtype=np.int32), response_ids=np.zeros(0, dtype=np.int32),
                          behaviour_logprobs=np.zeros(0, dtype=np.float32), versions=[], reward=0.0, **common)
        return ep.transcript.to_sample(**common)

    def _dead(self, sample: Sample, reason: str) -> tuple[None, str, bytes]:
        sample.reward = float("nan")
        sample.finished_at = time.time()
        return None, reason, sample.encode()

    def _score_batch(self, entries: list[tuple[_Group, int, GenResult]], watch: CallWatch
                     ) -> list[tuple[Sample | None, str | None, bytes]]:
        """Runs on a scoring thread: one batch of finished responses (whole groups, in order).
        Per response ``(sample, None, b"")``, or ``(None, reason, raw)`` for the dead-letter stream."""
        if self.episodes is not None:
            return self._score_episodes(entries, watch)
        items = [ScoreItem.of(group.lease.prompt, group.prompt_text, result.text, result.token_ids.tolist())
                 for group, _, result in entries]
        scores = self.scorer.score_batch(items, watch)
        out: list[tuple[Sample | None, str | None, bytes]] = []
        for (group, index, result), score in zip(entries, scores):
            sample = self._new_sample(group, index, result)
            if result.num_tokens == 0:
                score = RewardError("response has no tokens")
            if isinstance(score, RewardError):
                out.append(self._dead(sample, str(score)))
                continue
            sample.reward, sample.reward_components = score
            if self.reference is not None:
                sample.ref_logprobs = self._ref_logprobs(group.prompt_ids, result.token_ids)
            sample.finished_at = time.time()
            out.append((sample, None, b""))
        return out

    def _score_episodes(self, entries: list[tuple[_Group, int, Episode]], watch: CallWatch
                        ) -> list[tuple[Sample | None, str | None, bytes]]:
        """Scoring thread, episodes: the environment's reward (component ``env``) plus the run's
        reward functions and models, if any, on the whole conversation."""
        samples = [self._new_sample(group, index, ep) for group, index, ep in entries]
        live = [i for i, (_, _, ep) in enumerate(entries) if ep.error is None]
        scores: dict[int, Any] = {i: (0.0, {}) for i in live}
        if self.scorer.functions or self.scorer.models:
            items = []
            for i in live:
                group, _, ep = entries[i]
                assert ep.transcript is not None
                text = self.tokenizer.decode(ep.transcript.response_ids, skip_special_tokens=True)
                meta = {**group.lease.prompt.metadata, "turns": [t.text for t in ep.turns], "env_reward": ep.env_reward}
                items.append(ScoreItem(ep.prompt_text, text, list(ep.transcript.response_ids), meta,
                                       ep.prompt_messages, ep.messages, raw_prompt=group.lease.prompt.text))
            scores.update(zip(live, self.scorer.score_batch(items, watch)))
        out: list[tuple[Sample | None, str | None, bytes]] = []
        for i, ((_, _, ep), sample) in enumerate(zip(entries, samples)):
            score = scores.get(i)
            if ep.error is not None:
                score = RewardError(ep.error)
            elif ep.env_reward is None and not (self.scorer.functions or self.scorer.models):
                score = RewardError(f"the episode ended ({ep.finish_reason}) without a reward: environment "
                                    f"{self.env_factory.path if self.env_factory else '?'} returned none from step() "
                                    "and no reward function is configured; return one when done, or set reward.functions")
            elif sample.num_policy_tokens == 0:
                score = RewardError("the episode has no token the policy sampled")
            if isinstance(score, RewardError):
                out.append(self._dead(sample, str(score)))
                continue
            total, parts = score
            if ep.env_reward is not None:
                total, parts = total + ep.env_reward, {**parts, ENV_COMPONENT: ep.env_reward}
            sample.reward, sample.reward_components = total, parts
            if self.reference is not None:
                sample.ref_logprobs = self._ref_logprobs(sample.prompt_ids.tolist(), sample.response_ids)
            sample.finished_at = time.time()
            out.append((sample, None, b""))
        return out

    def _timed_out(self, key: tuple[_Group, int], reason: str) -> tuple[None, str, bytes]:
        """The outcome of a sample whose reward call was abandoned (main thread)."""
        group, index = key
        return self._dead(self._new_sample(group, index, group.results[index]), reason)

    def _collect_scores(self) -> None:
        """Scores that came back (or timed out) into their groups; due batches started."""
        flush = not self.engine.has_work()  # nothing more will finish soon: do not wait to fill a batch
        for (group, index), outcome in self.scoring.poll(flush=flush):
            if self.groups.get(group.lease.lease_id) is group:  # not abandoned or released meanwhile
                group.outcomes[index] = outcome
        pool = self.scoring
        self.stats.t_score, self.stats.reward_calls, self.stats.reward_timeouts = pool.busy_s, pool.calls, pool.timeouts
        if self.exporter is not None:
            for seconds in pool.take_durations():
                self.exporter.observe(SCORING, seconds)

    @torch.no_grad()
    def _ref_logprobs(self, prompt_ids: list[int], response_ids: np.ndarray) -> np.ndarray:
        """``[R]`` reference log-probs under the same processed distribution the learner uses for KL."""
        device = next(self.reference.parameters()).device
        ids = torch.tensor([list(prompt_ids) + [int(t) for t in response_ids]], device=device)
        logits = self.reference(input_ids=ids).logits[:, len(prompt_ids) - 1 : -1]
        sp = self.sampling
        lp = response_logprobs(logits, ids[:, len(prompt_ids):], sp.temperature, sp.top_k, sp.top_p)
        return lp[0].float().cpu().numpy()

    def _emit_finished_groups(self) -> None:
        """Append every group whose samples are all scored, in one Redis round trip (each group
        still appended and acked atomically on its own)."""
        ready: list[tuple[str, _Group, list[Sample], list[tuple[str, bytes]]]] = []
        self._collect_scores()
        for lease_id, group in self.groups.items():
            if len(group.outcomes) < group.size:
                continue
            outcomes = [group.outcomes[i] for i in range(group.size)]
            samples = [s for s, _, _ in outcomes if s is not None]
            dead = [(reason, raw) for s, reason, raw in outcomes if s is None]
            ready.append((lease_id, group, samples, dead))
        if not ready:
            return
        # DAPO's dynamic sampling: a group that teaches nothing is completed as filtered (prompt acked,
        # budget returned: pacing admits another prompt, so learner batches stay full of useful groups)
        reasons = [group_filter(self.cfg.algo, samples) for _, _, samples, _ in ready]
        with self._buf_lock:  # per group: append + dead letters + ack, one atomic step
            statuses = self.buffer.complete_many([
                self.buffer.prepare(group.lease, samples, rejected=[("sample", r, raw) for r, raw in dead], filtered=why)
                for (_, group, samples, dead), why in zip(ready, reasons)
            ])
        for (lease_id, group, samples, dead), status in zip(ready, statuses):
            del self.groups[lease_id]
            self.stats.dead_letters += len(dead)
            for reason, _ in dead:
                self._log_dead_letter(group, reason)
            if status == "duplicate":
                self.stats.duplicates += 1
                log.info("worker %s: prompt %s was already completed by another worker", self.worker_id, group.lease.prompt.prompt_id)
            elif status == "appended":
                self.stats.prompts += 1
                self.stats.samples += len(samples)
            elif status == "filtered":
                self.stats.prompts_empty += 1
                self.stats.groups_filtered += 1
                self.stats.samples_filtered += len(samples)
            else:
                self.stats.prompts_empty += 1
        for _, _, samples, dead in ready:  # after the groups are stored: a stop loses nothing scored
            # empty responses dead-lettered by reward.empty_response=dead_letter are the user's choice, not
            # a failing reward: a policy that mostly answers nothing must not stop the run blaming the reward
            outcomes = [(False, "")] * len(samples) + [(True, reason) for reason, _ in dead if reason != EMPTY_DEAD_LETTER]
            if any([self.reward_failures.record(failed, reason) for failed, reason in outcomes]):
                raise reward_failing(self.reward_failures)

    def _log_dead_letter(self, group: _Group, reason: str) -> None:
        """The first occurrence of each reason, then every 100th (a reward failing on every sample
        once wrote 126 MB of log in two minutes)."""
        seen = self._seen(reason)
        if seen == 1 or seen % 100 == 0:
            log.warning("worker %s: a sample of prompt %s dead-lettered (%d time(s) for this reason): %s",
                        self.worker_id, group.lease.prompt.prompt_id, seen, reason)

    def _seen(self, reason: str) -> int:
        """Times a reason of this kind was seen: ``reason`` with its quoted names and numbers left out
        (most reasons name their prompt, or the request, and count its tokens). The counts start again
        at MAX_LOGGED_REASONS kinds (a kind seen that often is logged once more)."""
        kind = _REASON_DETAILS.sub("#", reason[:200])
        if len(self._logged_reasons) >= MAX_LOGGED_REASONS:
            self._logged_reasons.clear()
        seen = self._logged_reasons[kind] = self._logged_reasons.get(kind, 0) + 1
        return seen

    def _abandon_lost_leases(self) -> None:
        """Stop generating for prompts another worker reclaimed (this one was silent too long)."""
        with self._buf_lock:
            lost, self._lost = self._lost, set()
        for lease_id in lost:
            group = self.groups.pop(lease_id, None)
            if group is None:
                continue
            for i in range(group.size):
                if self.episodes is not None:
                    self.episodes.abort(f"{lease_id}/{i}")
                else:
                    self.engine.abort(f"{lease_id}/{i}")
            self.stats.leases_lost += 1
            log.warning("worker %s: lease of prompt %s was taken over by another worker; abandoned", self.worker_id, group.lease.prompt.prompt_id)

    # ------------------------------------------------------------------ heartbeat + lifecycle

    def _heartbeat_loop(self) -> None:
        interval = float(self.cfg.buffer.heartbeat_interval_s)
        while not self._hb_stop.wait(interval):
            self.heartbeat()

    def heartbeat(self) -> None:
        """Renew this worker's leases, with its stats for the monitor. Stats that fail to build (read
        here while the main thread changes what they count) go out as the last ones that built: a
        heartbeat thread that died on them left the leases to expire under a working worker."""
        try:
            stats = self._stats_record()
        except Exception as exc:  # noqa: BLE001
            log.warning("worker %s: its stats failed (%s: %s); heartbeating with the last ones", self.worker_id,
                        type(exc).__name__, exc)
            stats = self._last_stats
        self._last_stats = stats
        try:
            with self._buf_lock:
                lost = self.buffer.heartbeat(self.worker_id, stats["version"], stats)
                self._lost.update(lost)
        except Exception as exc:  # Redis away for longer than the client's retries: the main loop will notice
            log.warning("worker %s: heartbeat failed: %s", self.worker_id, exc)

    def _stats_record(self) -> dict[str, Any]:
        extra = dict(self.renderer.counters.as_dict())
        extra.update(active=self.engine.num_active(), waiting=self.engine.num_waiting(), groups=len(self.groups),
                     weight_pulls=self.weights.stats["pulls"], weight_timeouts=self.weights.stats["timeouts"],
                     score_share=self.score_share(), scoring_threads=self.cfg.reward.num_threads)
        for name, attr in ENGINE_COUNTERS.items():  # forward passes (hf), prompt tokens reused and in all
            if hasattr(self.engine, attr):
                extra[name] = getattr(self.engine, attr)
        if self.gateway is not None:
            extra.update(self.gateway.stats, gateway_running=len(self.gateway))
        if self.episodes is not None:
            extra.update(self.episodes.stats.as_dict(self.episodes.calls), env_waiting=self.episodes.waiting_for_env(),
                         episodes=len(self.episodes.episodes))
        stats = self.stats.as_dict(self.engine.version if self.has_weights else None, extra)
        if self.exporter is not None:
            self.exporter.update(stats)
        return stats

    def score_share(self) -> float:
        """The share of the scoring threads' time spent scoring since the worker started (near 1:
        the reward is the bottleneck; more threads, batching or a faster reward would help)."""
        elapsed = max(time.monotonic() - self.stats.started, 1e-9)
        return min(1.0, self.stats.t_score / (elapsed * self.cfg.reward.num_threads))

    def request_stop(self, *_: Any) -> None:
        """Stop claiming and drain (the SIGTERM/SIGINT handler); a second call skips the grace period."""
        if self.stop_event.is_set():
            self._abort_drain = True
            return
        log.info("worker %s: stop requested; finishing in-flight prompts (a second signal releases them at once)", self.worker_id)
        self.stop_event.set()

    def run(self, max_prompts: int | None = None, max_seconds: float | None = None) -> WorkerStats:
        """Work until stopped, or until ``max_prompts`` prompts are completed / ``max_seconds`` pass."""
        self.heartbeat()
        self._hb_thread = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        self._hb_thread.start()
        deadline = None if max_seconds is None else time.monotonic() + max_seconds
        check_every = max(1, int(self.cfg.rollout.weight_check_every))
        steps = 0
        try:
            if self._join_run() and self.wait_for_weights():
                while not self.stop_event.is_set():
                    done = self.stats.prompts + self.stats.prompts_empty
                    if (max_prompts is not None and done >= max_prompts) or (deadline is not None and time.monotonic() > deadline):
                        break
                    self._abandon_lost_leases()
                    if self.gateway is not None and not self.engine.has_work():  # busy: taken after each step
                        self.gateway.take(self._free_slots())  # before prompts: a client is waiting on these
                    idle = not self.engine.has_work() and not self.groups
                    limit = None if max_prompts is None else max_prompts - done - len(self.groups)
                    self._claim(IDLE_CLAIM_BLOCK_S if idle else 0.0, limit)
                    if self.engine.has_work():
                        self._step()
                        steps += 1
                        if steps % check_every == 0:
                            self._maybe_update_weights()
                        self._collect_episodes()
                    else:
                        self._maybe_update_weights()
                        self._idle_wait()
                    self._emit_finished_groups()
            self._drain()
        except BaseException:
            self._release_all("the worker failed")
            raise
        finally:
            self.stop_event.set()
            self._hb_stop.set()
            if self._hb_thread is not None:
                self._hb_thread.join(timeout=10)
            self.scoring.close()
            if self.episodes is not None:
                self.episodes.close()
            if self.gateway is not None:  # its running calls are aborted: what they sampled was generated
                self._counting_gateway_tokens(self.gateway.close)
            self.engine.close()
            self.heartbeat()  # the final record: leases 0, final counters
            self.weights.close()
            if self._own_buffer:
                self.buffer.close()
            if self.exporter is not None:
                self.exporter.close()
        return self.stats

    def _idle_wait(self) -> None:
        """The engine has nothing to decode: wait a little for an environment's answer (episodes)
        or for the scoring thread, instead of spinning."""
        if self.episodes is not None and self.episodes.waiting_for_env():
            self._collect_episodes(block_s=0.005)
        elif self.groups:  # only scoring left: let the scoring thread run
            self._collect_episodes()
            time.sleep(0.002)

    def _drain(self) -> None:
        """Finish in-flight prompts within the grace period (heartbeats go on); release the rest."""
        deadline = time.monotonic() + float(self.cfg.rollout.shutdown_grace_s)
        while self.groups and time.monotonic() < deadline and not self._abort_drain:
            self._abandon_lost_leases()
            if self.engine.has_work():
                self._step()
                self._collect_episodes()
            else:
                self._idle_wait()
            self._emit_finished_groups()
        self._release_all("shutdown grace period over")

    def _release_all(self, why: str) -> None:
        """Give every unfinished prompt back to the buffer (best effort: on a crash Redis may be away,
        and then the leases simply expire)."""
        if not self.groups:
            return
        try:
            if self.episodes is not None:
                self.episodes.abort_all()
            self.engine.abort_all()
        except Exception as exc:  # an engine that failed mid-step: the leases matter more
            log.warning("worker %s: engine abort failed: %s", self.worker_id, exc)
        leases = [g.lease for g in self.groups.values()]
        self.groups.clear()
        self._release(leases, why, "unfinished")

    def _release(self, leases: list[Lease], why: str, which: str) -> None:
        """Give ``leases`` back to the buffer (best effort: on a crash Redis may be away, and then
        they simply expire)."""
        if not leases:
            return
        try:
            with self._buf_lock:
                n = self.buffer.release(leases)
        except Exception as exc:
            log.warning("worker %s: could not release %d prompt(s) (%s); they come back after the lease timeout",
                        self.worker_id, len(leases), exc)
            return
        self.stats.released += n
        log.info("worker %s: %s; released %d %s prompt(s)", self.worker_id, why, n, which)


def _set_threads() -> int:
    """Intra-op threads: OMP_NUM_THREADS when set (rlhf-run divides the cores among its children),
    else 1. The engine's per-step work is small; on a shared CPU extra threads mostly spin against
    the other processes (the hf engine tests measured 20x slower steps with the default)."""
    raw = os.environ.get("OMP_NUM_THREADS", "")
    n = int(raw) if raw.isdigit() and int(raw) > 0 else 1
    torch.set_num_threads(n)
    return n


def run_worker(cfg: Config, worker_id: str | None = None, install_signals: bool = True, **budget: Any) -> WorkerStats:
    """Entry point body: validate, build, run until SIGTERM/SIGINT (then exit cleanly).

    ``budget``: ``max_prompts`` / ``max_seconds`` for tests and benches. ``install_signals``
    must be False when called off the main thread, or in a process the worker does not own (it
    also freezes the startup heap, :func:`~rlhf_core.cli.freeze_startup_heap`).
    """
    if isinstance(cfg, DictConfig):
        cfg = to_object(cfg)
    validate(cfg)
    if cfg.buffer.url is None:
        raise ConfigError("rlhf-worker needs buffer.url=redis://host:port of the run's Redis (and weight_server.address)")
    if cfg.weight_server.address is None or cfg.weight_server.pub_address is None:
        raise ConfigError("rlhf-worker needs weight_server.address=tcp://host:port and weight_server.pub_address=tcp://host:port")
    if cfg.buffer.run_id == "auto":
        raise ConfigError("rlhf-worker needs buffer.run_id=<the run id that rlhf-run printed> to join a run")
    threads = _set_threads()
    frac = cfg.rollout.gpu_memory_fraction
    if frac is not None and cfg.rollout.engine == "hf" and torch.cuda.is_available():
        torch.cuda.set_per_process_memory_fraction(float(frac))  # leave the rest of a shared GPU to the learner
    early: list[int] = []
    if install_signals:  # a signal while the model loads must still end in a clean exit
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, _frame: early.append(signum))
    worker = RolloutWorker(cfg, worker_id or os.environ.get(WORKER_ID_ENV) or None)
    rc = cfg.reward
    log.info("worker %s: run %s, engine %s, %d slot(s), %d torch thread(s) (OMP_NUM_THREADS, reward models included); "
             "rewards %s: %d scoring thread(s) (reward.num_threads), batches of up to %d samples (reward.batch_size), "
             "timeout %s (reward.timeout_s)", worker.worker_id, cfg.buffer.run_id, cfg.rollout.engine, cfg.rollout.slots,
             threads, worker.scorer.describe(), rc.num_threads, rc.batch_size,
             "none" if rc.timeout_s is None else f"{rc.timeout_s:g} s")
    if install_signals:  # this call owns the process
        freeze_startup_heap()
        signal.signal(signal.SIGTERM, worker.request_stop)
        signal.signal(signal.SIGINT, worker.request_stop)
        if early:
            worker.request_stop()
    stats = worker.run(**budget)
    log.info("worker %s done: %s", worker.worker_id, stats.as_dict(worker.engine.version))
    return stats
