"""The rollout worker: a main-thread loop over its parts that claims, generates, scores and appends.

A worker holds no state that matters: prompts are leased, so killing it loses nothing, and a new
worker anywhere with the Redis URL and the weight server's address joins the run. The main thread
drives the engine (engines are single-threaded); its parts, one module each, are described in
docs/architecture.md (Rollout workers).

Shutdown (SIGTERM/SIGINT, or a budget in tests): stop claiming, finish in-flight prompts for
``rollout.shutdown_grace_s`` while heartbeating, release the rest, exit 0. A second signal skips
the grace period.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import threading
import time
import uuid
import zlib
from collections.abc import Callable
from typing import Any

import torch
from omegaconf import DictConfig

from buffer import WorkerClient
from buffer.gateway import WorkerChannel
from buffer.keys import check_consumer
from rlhf_core.cli import WORKER_ID_ENV, freeze_startup_heap
from rlhf_core.config import Config, ConfigError, env_target, response_budget, to_object, validate
from rlhf_core.models import load_reference, load_tokenizer
from rollout_workers.engine import SamplingParams
from rollout_workers.engine_factory import make_engine
from rollout_workers.environment import EnvFactory
from rollout_workers.episodes import EpisodeRunner
from rollout_workers.gateway_calls import BackgroundChannel, GatewayCalls
from rollout_workers.groups import GroupAssembly, Member
from rollout_workers.leases import LeaseKeeper
from rollout_workers.prompts import PromptRenderer
from rollout_workers.rewards import Scorer
from rollout_workers.samples import SampleScorer
from rollout_workers.scoring import ScoringPool
from rollout_workers.stats import ENGINE_COUNTERS, WorkerStats
from rollout_workers.weight_follower import WeightFollower

log = logging.getLogger(__name__)

IDLE_CLAIM_BLOCK_S = 0.25  # an idle worker waits this long per claim (woken early by new prompts/budget)


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class RolloutWorker:
    """One worker. ``run()`` works until :meth:`request_stop` (or a budget); see the module docstring."""

    def __init__(self, cfg: Config, worker_id: str | None = None, buffer: WorkerClient | None = None) -> None:
        self.cfg = cfg
        self.worker_id = check_consumer(worker_id or default_worker_id())
        self.stop_event = threading.Event()
        self._abort_drain = False
        self._steps = 0  # decoding steps (weights are checked every rollout.weight_check_every)
        # Environment and reward config errors surface before any connection is opened or the policy is loaded.
        env_factory = EnvFactory(cfg.rollout) if env_target(cfg.rollout) else None
        self.scorer = Scorer(cfg.reward, cfg.model, environment=env_factory is not None)
        self._own_buffer = buffer is None
        buffer = buffer or WorkerClient.connect(cfg.buffer.url, cfg.buffer.run_id, cfg.buffer)
        self.stats = WorkerStats()
        self.leases = LeaseKeeper(buffer, self.worker_id, float(cfg.buffer.heartbeat_interval_s), self.stats,
                                  self._stats_record)
        self.tokenizer = load_tokenizer(cfg.model)
        self.renderer = PromptRenderer(self.tokenizer, cfg.rollout.max_prompt_tokens, cfg.rollout.prompt_overflow)
        self.sampling = SamplingParams.from_config(cfg.rollout)
        # Each worker samples with its own stream, reproducibly for a given worker id.
        seed = (int(cfg.rollout.seed) + zlib.crc32(self.worker_id.encode())) % (1 << 31)
        engine_cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, seed=seed))
        self.engine = make_engine(engine_cfg, None, self.tokenizer)
        reference = load_reference(cfg.model) if cfg.rollout.ref_logprobs_on == "worker" else None
        self.episodes: EpisodeRunner | None = None
        if env_factory is not None:
            r = cfg.rollout
            context = int(getattr(self.engine, "max_model_len", 0) or r.max_prompt_tokens + response_budget(r))
            self.episodes = EpisodeRunner(self.engine, self.tokenizer, self.renderer, self.sampling, env_factory,
                                          max_turns=r.max_turns, max_context=context, threads=r.env_threads,
                                          timeout_s=r.env_timeout_s, max_response=response_budget(r))
        rc = cfg.reward
        samples = SampleScorer(self.scorer, self.tokenizer, reference, self.sampling, self.worker_id,
                               env_factory.path if env_factory is not None else None)
        self.scoring: ScoringPool[Member] = ScoringPool(
            samples.score, samples.timed_out, num_threads=rc.num_threads, batch_size=rc.batch_size,
            max_wait_s=rc.max_wait_ms / 1000.0, timeout_s=rc.timeout_s)
        self.gateway: GatewayCalls | None = None
        if cfg.gateway.enabled:
            channel = BackgroundChannel(WorkerChannel(buffer.redis, buffer.keys), self.worker_id)
            self.gateway = GatewayCalls(channel, self.engine, self.worker_id)
        self.exporter = None
        if cfg.rollout.prometheus_port is not None:
            from rlhf_core.prometheus import worker_exporter

            # workers started by rlhf-run are named worker-<i>: worker i serves on port + i
            tail = self.worker_id.rsplit("-", 1)[-1]
            index = int(tail) if tail.isdigit() else 0
            self.exporter = worker_exporter(self.worker_id, cfg.buffer.run_id)
            self.exporter.serve(cfg.rollout.prometheus_port + index if cfg.rollout.prometheus_port else 0,
                                setting="rollout.prometheus_port (worker i serves on it + i)")
        self.groups = GroupAssembly(cfg, self.worker_id, self.leases, self.engine, self.episodes, self.renderer,
                                    self.sampling, self.scoring, self.stats, self.exporter)
        # Last: a constructor that fails before this line leaves no socket behind.
        self.weights = WeightFollower(cfg, self.engine, self.worker_id, self.stats, self.exporter, self.stop_event)

    def _join_run(self) -> bool:
        """Wait for the run's parameters (the learner's init_run); False if stopped first."""
        logged = False
        while not self.stop_event.is_set():
            size = self.leases.group_size()
            if size is not None:
                self.groups.group_size = size
                if size != self.cfg.algo.group_size:
                    log.warning("run %s has group_size %d; using it instead of algo.group_size=%d",
                                self.cfg.buffer.run_id, size, self.cfg.algo.group_size)
                return True
            if not logged:
                log.info("worker %s: run %s is not initialised yet; waiting for the learner", self.worker_id, self.cfg.buffer.run_id)
                logged = True
            self.stop_event.wait(0.25)
        return False

    # ------------------------------------------------------------------ claim + generate

    def _free_slots(self) -> int:
        return int(self.cfg.rollout.slots) - self.engine.num_active() - self.engine.num_waiting()

    def _free_prompt_capacity(self) -> int:
        """Prompts to claim now: enough to fill the free slots, so a freed slot is refilled at the next
        step. Responses still waiting to be scored count as busy slots: when scoring is the
        bottleneck the worker stops claiming instead of piling up leases behind it."""
        free = self._free_slots() - self.scoring.in_flight()
        if self.episodes is not None:
            # An episode whose environment is working holds no slot; calls still waiting for an
            # environment thread count as busy, so the episodes in flight stay bounded.
            free -= self.episodes.queued_for_env()
        # ceil(free / G): an idle worker always takes at least one prompt, even when a group is
        # larger than the slots (the engine queues the rest)
        size = self.groups.group_size
        return max(0, (free + size - 1) // size)

    def _claim(self, block_s: float, limit: int | None) -> None:
        capacity = self._free_prompt_capacity()
        if limit is not None:
            capacity = min(capacity, limit)
        # only a claim that may wait: a taker that sees the flag wakes every idle worker of the run
        waiting = self.gateway.waiting() if self.gateway is not None and block_s > 0 else None
        leases = self.leases.claim(capacity, block_s, waiting)
        if not leases:
            return
        started = 0
        try:
            # Pacing's staleness bound assumes generation with weights >= the version at admission.
            need = max(lease.learner_version for lease in leases)
            if need > self.engine.version:
                self.weights.pull_towards(need, "the learner's version when the prompts were admitted")
            for lease in leases:
                self.groups.start(lease)
                started += 1
        except BaseException:
            # _release_all gives back only the open groups: release this claim's leases not started yet
            self.leases.release([lease for lease in leases[started:] if lease.lease_id not in self.groups],
                                "failed before starting them", "claimed")
            raise

    def _counting_gateway_tokens(self, gateway: GatewayCalls, call: Callable[..., Any], *args: Any) -> Any:
        """``call(*args)`` on the gateway's calls; the tokens of the calls it ends (finished or
        aborted) count as generated, like prompts' (the run's summary, the monitor)."""
        before = gateway.stats["gateway_tokens"]
        out = call(*args)
        self.stats.tokens += gateway.stats["gateway_tokens"] - before
        return out

    def _step(self) -> None:
        t0 = time.monotonic()
        finished = self.engine.step()
        self.stats.t_generate += time.monotonic() - t0
        if self.gateway is not None:
            finished = self._counting_gateway_tokens(self.gateway, self.gateway.after_step, finished, self._free_slots())
        self.groups.add_results(finished)

    # ------------------------------------------------------------------ stats

    def _stats_record(self) -> dict[str, Any]:
        """What each heartbeat carries (built on the heartbeat thread)."""
        extra: dict[str, Any] = dict(self.renderer.counters.as_dict())
        pulls = self.weights.subscriber.stats
        extra.update(active=self.engine.num_active(), waiting=self.engine.num_waiting(), groups=len(self.groups),
                     weight_pulls=pulls["pulls"], weight_timeouts=pulls["timeouts"],
                     score_share=self.score_share(), scoring_threads=self.cfg.reward.num_threads)
        reasons = self.scorer.counters()  # why the built-in rewards scored what they did (reward=math, code_tests)
        if reasons:
            extra["reward_reasons"] = reasons
        for name, attr in ENGINE_COUNTERS.items():  # forward passes (hf), prompt tokens reused and in all
            if hasattr(self.engine, attr):
                extra[name] = getattr(self.engine, attr)
        if self.gateway is not None:
            extra.update(self.gateway.stats, gateway_running=len(self.gateway))
        if self.episodes is not None:
            extra.update(self.episodes.stats.as_dict(self.episodes.calls), env_waiting=self.episodes.waiting_for_env(),
                         episodes=len(self.episodes.episodes))
        stats = self.stats.as_dict(self.weights.version, extra)
        if self.exporter is not None:
            self.exporter.update(stats)
        return stats

    def score_share(self) -> float:
        """The share of the scoring threads' time spent scoring since the worker started (near 1:
        the reward is the bottleneck; more threads, batching or a faster reward would help)."""
        elapsed = max(time.monotonic() - self.stats.started, 1e-9)
        return min(1.0, self.stats.t_score / (elapsed * self.cfg.reward.num_threads))

    # ------------------------------------------------------------------ lifecycle

    def request_stop(self, *_: Any) -> None:
        """Stop claiming and drain (the SIGTERM/SIGINT handler); a second call skips the grace period."""
        if self.stop_event.is_set():
            self._abort_drain = True
            return
        log.info("worker %s: stop requested; finishing in-flight prompts (a second signal releases them at once)", self.worker_id)
        self.stop_event.set()

    def run(self, max_prompts: int | None = None, max_seconds: float | None = None) -> WorkerStats:
        """Work until stopped, or until ``max_prompts`` prompts are completed / ``max_seconds`` pass."""
        self.leases.start()
        deadline = None if max_seconds is None else time.monotonic() + max_seconds
        check_every = max(1, int(self.cfg.rollout.weight_check_every))
        try:
            if self._join_run() and self.weights.wait_for_weights():
                while not self.stop_event.is_set():
                    done = self.stats.prompts + self.stats.prompts_empty
                    if (max_prompts is not None and done >= max_prompts) or (deadline is not None and time.monotonic() > deadline):
                        break
                    self.groups.abandon(self.leases.take_lost())
                    if self.gateway is not None and not self.engine.has_work():  # busy: taken after each step
                        self.gateway.take(self._free_slots())  # before prompts: a client is waiting on these
                    idle = not self.engine.has_work() and not self.groups
                    limit = None if max_prompts is None else max_prompts - done - len(self.groups)
                    self._claim(IDLE_CLAIM_BLOCK_S if idle else 0.0, limit)
                    self._advance(check_every)
            self._drain()
        except BaseException:
            self._release_all("the worker failed")
            raise
        finally:
            self.stop_event.set()
            self.leases.stop()
            self.scoring.close()
            if self.episodes is not None:
                self.episodes.close()
            if self.gateway is not None:  # its running calls are aborted: what they sampled was generated
                self._counting_gateway_tokens(self.gateway, self.gateway.close)
            self.engine.close()
            self.leases.heartbeat()  # the final record: leases 0, final counters
            self.weights.close()
            if self._own_buffer:
                self.leases.buffer.close()
            if self.exporter is not None:
                self.exporter.close()
        return self.stats

    def _advance(self, weight_check_every: int | None) -> None:
        """After claiming: a decoding step (or, with nothing to decode, a short wait), then the
        groups scored meanwhile completed. Weights are followed every ``weight_check_every`` steps
        and while idle (None: not at all, as in the drain)."""
        if self.engine.has_work():
            self._step()
            self._steps += 1
            if weight_check_every is not None and self._steps % weight_check_every == 0:
                self.weights.maybe_update()
            self.groups.collect_episodes()
        else:
            if weight_check_every is not None:
                self.weights.maybe_update()
            self._idle_wait()
        self.groups.emit_finished()

    def _idle_wait(self) -> None:
        """The engine has nothing to decode: wait a little for an environment's answer (episodes)
        or for the scoring thread, instead of spinning."""
        if self.episodes is not None and self.episodes.waiting_for_env():
            self.groups.collect_episodes(block_s=0.005)
        elif self.groups:  # only scoring left: let the scoring thread run
            self.groups.collect_episodes()
            time.sleep(0.002)

    def _drain(self) -> None:
        """Finish in-flight prompts within the grace period (heartbeats go on); release the rest."""
        deadline = time.monotonic() + float(self.cfg.rollout.shutdown_grace_s)
        while self.groups and time.monotonic() < deadline and not self._abort_drain:
            self.groups.abandon(self.leases.take_lost())
            self._advance(None)
        self._release_all("shutdown grace period over")

    def _release_all(self, why: str) -> None:
        """Give every unfinished prompt back to the buffer."""
        self.leases.release(self.groups.abort_all(), why, "unfinished")


def _set_threads() -> int:
    """Intra-op threads: OMP_NUM_THREADS when set (rlhf-run divides the cores among its children),
    else 1: the engine's per-step work is small, and on a shared CPU extra threads mostly spin."""
    raw = os.environ.get("OMP_NUM_THREADS", "")
    n = int(raw) if raw.isdigit() and int(raw) > 0 else 1
    torch.set_num_threads(n)
    return n


def run_worker(cfg: Config, worker_id: str | None = None, install_signals: bool = True, **budget: Any) -> WorkerStats:
    """Entry point body: validate, build, run until SIGTERM/SIGINT (then exit cleanly). ``budget``:
    ``max_prompts`` / ``max_seconds`` for tests and benches. ``install_signals`` (which also freezes
    the startup heap) must be False off the main thread, or in a process the worker does not own."""
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
    reasons = worker.scorer.counters()
    log.info("worker %s done: %s", worker.worker_id, stats.as_dict(worker.engine.version, {"reward_reasons": reasons} if reasons else None))
    return stats
