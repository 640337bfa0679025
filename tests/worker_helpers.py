"""Helpers for the rollout-worker integration tests: a stand-in learner and worker runners.

The learner does not exist in these tests; :class:`FakeLearner` plays it against the real
servers: ``init_run`` on the buffer, prompts enqueued, weights published through a real
``WeightPublisher`` to a real ``WeightServer``, groups read back with ``LearnerClient.read_batch``.
Worker configs are composed by Hydra from the same override strings a child process gets on
its command line, so the in-process and the child-process tests exercise the same config path.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from buffer.keys import WORKERS_GROUP
from buffer_clients import Clients
from rlhf_core.config import Config, ModelConfig, response_budget
from rlhf_core.models import load_policy, load_tokenizer
from rlhf_core.records import Prompt, Sample
from rlhf_core.sampling import response_logprobs
from servers import wait_for  # noqa: F401  (one implementation; the worker tests import it from here)

TESTS_DIR = Path(__file__).resolve().parent
VOCAB = 99  # the tiny tokenizer


def overrides(redis_url: str, run_id: str, ws: Any, model_cfg: ModelConfig, **settings: Any) -> list[str]:
    """Hydra overrides of a worker joining ``run_id``; ``settings`` are ``group__key=value``
    (``rollout__slots=4``) or full override strings in ``extra``."""
    base = {
        "buffer.url": redis_url,
        "buffer.run_id": run_id,
        "buffer.lease_timeout_s": 2.0,
        "buffer.heartbeat_interval_s": 0.5,
        "weight_server.address": ws.address,
        "weight_server.pub_address": ws.pub_address,
        "model.cache_dir": model_cfg.cache_dir,
        "algo.group_size": 4,
        "rollout.slots": 8,
        "rollout.max_new_tokens": 8,
    }
    extra = settings.pop("extra", [])
    base.update({k.replace("__", "."): v for k, v in settings.items()})
    return [f"{k}={v}" for k, v in base.items()] + list(extra)


def gate_overrides(gate_file: Path, free: int = 0) -> list[str]:
    """Overrides adding ``reward_fns.gate``: the first ``free`` samples a worker process scores go
    through, every later one waits while ``gate_file`` exists (created here). A test holds a
    worker in a known state with it (no group can complete) and opens the gate by removing the
    file; a worker shuts down only once its scoring thread is let go (or after 10 s). The gate
    holds a reward call for as long as the test wants: no reward.timeout_s."""
    gate_file.touch()
    return ["+reward.functions.gate._target_=reward_fns.gate", f"+reward.functions.gate.path='{gate_file}'",
            f"+reward.functions.gate.free={free}", "reward.timeout_s=null"]


def compose_unvalidated(override_list: Sequence[str]) -> Config:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module

    from rlhf_core.config import register_configs, to_object

    register_configs()
    with initialize_config_module(config_module="conf", version_base="1.3"):
        return to_object(hydra_compose("config", overrides=list(override_list)))


def compose(override_list: Sequence[str]) -> Config:
    from rlhf_core.config import validate

    cfg = compose_unvalidated(override_list)
    validate(cfg)  # what run_worker checks first in a child process
    return cfg


class FakeLearner:
    """Plays the learner: run parameters, prompts, weights, reading groups back.

    ``batch_size`` only sets the run's pacing: at learner version 0 the buffer admits
    ``(max_staleness + 1) * batch_size`` samples, 192 = 48 prompts of 4 by default.
    """

    def __init__(self, cfg: Config, batch_size: int = 64, max_staleness: int = 2) -> None:
        from weight_server import WeightPublisher

        self.cfg = cfg
        self.tokenizer = load_tokenizer(cfg.model)
        self.base = load_policy(cfg.model).eval()  # the weights on disk (what a worker starts with)
        self.published: dict[int, dict[str, torch.Tensor]] = {}
        self.threads: list[WorkerThread] = []  # stopped by the test fixture before the servers go
        self.buffer = Clients.connect(cfg.buffer.url, cfg.buffer.run_id, cfg.buffer)
        try:
            self.params = self.buffer.learner.init_run(
                batch_size=batch_size, group_size=cfg.algo.group_size, max_staleness=max_staleness,
                max_response_tokens=response_budget(cfg.rollout), vocab_size=VOCAB)
            self.publisher = WeightPublisher(cfg.weight_server.address, cfg.weight_server)
        except BaseException:
            self.buffer.close()
            raise

    def thread(self, cfg: Config, worker_id: str, **budget: Any) -> WorkerThread:
        wt = WorkerThread(cfg, worker_id, **budget)
        self.threads.append(wt)
        return wt

    def close(self) -> None:
        try:
            self.publisher.close()
        finally:
            self.buffer.close()

    # ---- weights
    def publish(self, version: int, seed: int | None = None, scale: float = 0.05) -> dict[str, torch.Tensor]:
        """Publish the on-disk weights, perturbed by N(0, scale) noise from ``seed`` (None: as on disk),
        so a worker that did not apply them produces different log-probs."""
        gen = torch.Generator().manual_seed(seed if seed is not None else 0)
        state = {}
        for name, t in self.base.state_dict().items():
            t = t.detach().clone()
            if seed is not None and t.is_floating_point():
                t += scale * torch.randn(t.shape, generator=gen)
            state[name] = t
        self.publisher.publish(version, state)
        self.published[version] = state
        return state

    def model_at(self, version: int) -> torch.nn.Module:
        model = load_policy(self.cfg.model).eval()
        model.load_state_dict(self.published[version])
        return model

    # ---- prompts
    def enqueue(self, n: int, prefix: str = "p", text: str | None = None, **metadata: Any) -> list[Prompt]:
        prompts = [Prompt(f"{prefix}{i}", text if text is not None else f"{i % 10}:", metadata={"start": i % 10, **metadata},
                          index=i) for i in range(n)]
        self.buffer.producer.enqueue_prompts(prompts)
        return prompts

    # ---- reading
    def read_groups(self, n_groups: int, learner_version: int = 0, timeout_s: float = 30.0) -> list[list[Sample]]:
        """Exactly ``n_groups`` groups (one ``read_batch`` of one group each), then checks nothing more is there."""
        groups: list[list[Sample]] = []
        deadline = time.monotonic() + timeout_s
        while len(groups) < n_groups:
            left = deadline - time.monotonic()
            assert left > 0, f"only {len(groups)} of {n_groups} groups arrived within {timeout_s} s"
            batch = self.buffer.learner.read_batch("learner", learner_version, self.cfg.algo.group_size, timeout_s=min(left, 1.0))
            if batch is not None:
                groups.extend(batch.samples[g.start:g.end] for g in batch.groups)
        assert self.buffer.learner.read_batch("learner", learner_version, self.cfg.algo.group_size, timeout_s=0.2) is None
        return groups

    def counters(self) -> dict[str, Any]:
        return self.buffer.monitor.metrics()["counters"]

    def consumer(self, worker_id: str) -> dict[str, Any]:
        return self.buffer.monitor.metrics()["consumers"][worker_id]

    def consumer_stats_prompts(self, worker_id: str) -> int:
        """Groups the worker reported in its last heartbeat (0 before its first)."""
        return int(self.buffer.monitor.metrics()["consumers"].get(worker_id, {}).get("stats", {}).get("prompts", 0))

    def leases_of(self, worker_id: str) -> list[str]:
        """Prompt ids (stream ids) this worker holds right now, straight from Redis's pending list."""
        rows = self.buffer.redis.xpending_range(self.buffer.keys.prompts, WORKERS_GROUP, "-", "+", 1000, consumername=worker_id)
        return [r["message_id"].decode() for r in rows]

    def leases_total(self) -> int:
        return int(self.buffer.redis.xpending(self.buffer.keys.prompts, WORKERS_GROUP)["pending"])


def check_sample(s: Sample, prompt: Prompt, tokenizer: Any, group_size: int, max_new_tokens: int, versions: set[int]) -> None:
    """Every field a learner relies on."""
    assert s.prompt_id == prompt.prompt_id
    assert s.prompt_ids.tolist() == tokenizer(prompt.text)["input_ids"]
    r = s.num_response_tokens
    assert 1 <= r <= max_new_tokens
    assert s.response_ids.dtype == np.int32 and s.behaviour_logprobs.shape == (r,)
    assert 0 <= int(s.response_ids.min()) and int(s.response_ids.max()) < VOCAB
    assert np.isfinite(s.behaviour_logprobs).all() and (s.behaviour_logprobs <= 0).all()
    assert sum(c for _, c in s.versions) == r and {v for v, _ in s.versions} <= versions
    assert np.isfinite(s.reward) and all(np.isfinite(v) for v in s.reward_components.values())
    eos = tokenizer.eos_token_id
    assert eos not in s.response_ids[:-1].tolist()  # generation stops at the first EOS
    if s.response_ids[-1] == eos:
        assert s.finish_reason == "stop"
    else:
        assert (s.finish_reason, r) == ("length", max_new_tokens)
    assert s.group_size == group_size and 0 <= s.group_index < group_size
    assert s.sample_id == f"{s.group_id}/{s.group_index}"
    assert s.created_at <= s.finished_at


def recompute(model: torch.nn.Module, s: Sample, temperature: float, top_k: int, top_p: float,
              kv_from: tuple[torch.nn.Module, int] | None = None) -> np.ndarray:
    """The learner's recomputation: one plain forward pass over prompt + response. ``kv_from``:
    ``(old, n)``, the first ``n`` tokens' K/V from the model ``old`` (what a worker's engine reused
    from an older version), their logits too; ``model`` computes the rest on that K/V."""
    full = torch.tensor(np.concatenate([s.prompt_ids, s.response_ids]), dtype=torch.long)[None]
    with torch.no_grad():
        if kv_from is None:
            logits = model(input_ids=full).logits
        else:
            old, n = kv_from
            head = old(input_ids=full[:, :n], use_cache=True)
            tail = model(input_ids=full[:, n:], past_key_values=head.past_key_values).logits
            logits = torch.cat([head.logits, tail], dim=1)
        logits = logits[:, len(s.prompt_ids) - 1 : -1]
    tokens = torch.from_numpy(s.response_ids.astype(np.int64))[None]
    return response_logprobs(logits, tokens, temperature, top_k, top_p)[0].numpy()


class WorkerThread:
    """A RolloutWorker in a thread of the test process (built in the caller's thread, so
    construction errors surface there)."""

    def __init__(self, cfg: Config, worker_id: str, **budget: Any) -> None:
        from rollout_workers.worker import RolloutWorker

        self.worker = RolloutWorker(cfg, worker_id)
        self.error: BaseException | None = None
        self.stats = None
        self.thread = threading.Thread(target=self._run, kwargs=budget, name=f"worker-{worker_id}", daemon=True)

    def _run(self, **budget: Any) -> None:
        try:
            self.stats = self.worker.run(**budget)
        except BaseException as exc:  # re-raised in join()
            self.error = exc

    def start(self) -> WorkerThread:
        self.thread.start()
        return self

    def join(self, timeout: float = 30.0) -> None:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"worker did not finish within {timeout} s"
        if self.error is not None:
            raise self.error

    def stop(self, timeout: float = 30.0) -> None:
        self.worker.request_stop()
        self.join(timeout)

    def halt(self, timeout: float = 15.0) -> None:
        """Teardown, whatever the test did: stop at once (a second request skips the drain's grace
        period) and join. A worker never started is run stopped, which closes what it opened."""
        self.worker.request_stop()
        self.worker.request_stop()
        if self.thread.ident is None:
            self.thread.start()
        self.thread.join(timeout)


def spawn_worker(override_list: Sequence[str], worker_id: str, workdir: Path) -> subprocess.Popen:
    """``python -m rollout_workers <overrides>`` as a child process; its log is ``workdir/<id>.log``."""
    workdir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.update(RLHF_WORKER_ID=worker_id, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(TESTS_DIR), env.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "rollout_workers", *override_list,
           f"hydra.run.dir={workdir / worker_id}", "hydra.output_subdir=null"]
    log = open(workdir / f"{worker_id}.log", "wb")
    try:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    finally:
        log.close()


def log_tail(workdir: Path, worker_id: str, n: int = 40) -> str:
    path = workdir / f"{worker_id}.log"
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:]) if path.exists() else "(no log)"


