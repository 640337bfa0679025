"""Periodic evaluation: the policy of the newest version once loaded and of every
``eval.every``-th version after it, sampled ``eval.n`` times on the first ``eval.num_prompts``
held-out prompts of ``eval.data``, scored by the run's own rewards.

A rollout worker without the prompt queue (the same engine, renderer, :class:`~rollout_workers.rewards.Scorer`
and :class:`~rollout_workers.scoring.ScoringPool`), so its prompts are never trained on. Each
evaluation, tagged with its version, records ``eval/reward_mean``, ``eval/reward_std``,
``eval/pass@k`` for each ``k`` of ``eval.k`` (:func:`pass_at_k`, a pass being a reward >=
``eval.pass_threshold``, averaged over prompts) and counts, into ``eval.jsonl`` and the buffer's
stats (``MonitorClient.stats("eval")``). docs/architecture.md (Rollout workers: Evaluation) says
who reads them. A stop request lets an evaluation in progress finish; a second one abandons it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import signal
import statistics
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from buffer import BufferClient
from buffer.datasets import iter_prompts
from rlhf_core.cli import append_line
from rlhf_core.config import Config, ConfigError, validate
from rlhf_core.metric_names import EVAL_FILE, EVAL_REWARD_MEAN, EVAL_STATS, EVAL_VERSION
from rlhf_core.models import load_tokenizer
from rlhf_core.records import Prompt
from rlhf_core.tasks import builtin_prompts
from rollout_workers.engine import GenRequest, GenResult, SamplingParams
from rollout_workers.engine_factory import make_engine
from rollout_workers.prompts import PromptRejected, PromptRenderer
from rollout_workers.rewards import RewardError, ScoreItem, Scorer
from rollout_workers.scoring import ScoringPool
from weight_server import WeightSubscriber

log = logging.getLogger("rollout_workers.evaluator")  # also when run as __main__

ANNOUNCE_WAIT_MS = 500  # how long one wait for a new version announcement blocks
SCORE_WAIT_S = 0.1  # how long one wait for scores blocks (a second stop request is seen within it)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021) from ``n`` samples of which ``c`` pass: ``1 - C(n - c, k) / C(n, k)``,
    the chance that a draw of ``k`` of the ``n`` without replacement holds at least one that passes."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def eval_metrics(rewards: Sequence[Sequence[float]], ks: Iterable[int], threshold: float) -> dict[str, float]:
    """Mean reward and pass@k over prompts; ``rewards[i]`` holds prompt i's scored samples (a
    prompt with fewer than ``k`` of them is left out of pass@k for that ``k``)."""
    flat = [r for per in rewards for r in per]
    out = {EVAL_REWARD_MEAN: statistics.fmean(flat) if flat else math.nan,
           "eval/reward_std": statistics.pstdev(flat) if flat else math.nan}
    for k in ks:
        est = [pass_at_k(len(per), sum(r >= threshold for r in per), k) for per in rewards if len(per) >= k]
        out[f"eval/pass@{k}"] = statistics.fmean(est) if est else math.nan
    return out


def eval_prompts(cfg: Config) -> list[Prompt]:
    """The first ``eval.num_prompts`` prompts of ``eval.data`` (its epoch 0 order)."""
    data = cfg.eval.data
    prompts: list[Prompt] = []
    for p in iter_prompts(data, 0, builtin=builtin_prompts):
        if cfg.eval.num_prompts is not None and len(prompts) >= cfg.eval.num_prompts:
            break
        prompts.append(p)
    if not prompts:
        raise ConfigError(f"eval.data ({data.source} {data.path or data.task}) holds no prompts")
    return prompts


class Evaluator:
    """See the module docstring. ``run()`` evaluates until stopped (or ``max_evals``)."""

    def __init__(self, cfg: Config, buffer: BufferClient | None = None, output_dir: str | Path | None = None) -> None:
        self.cfg, ev = cfg, cfg.eval
        self.stop_event = threading.Event()
        self._abort = False
        self.tokenizer = load_tokenizer(cfg.model)
        self.renderer = PromptRenderer(self.tokenizer, cfg.rollout.max_prompt_tokens, cfg.rollout.prompt_overflow)
        self.prompts = eval_prompts(cfg)
        self.scorer = Scorer(cfg.reward, cfg.model)
        rc = cfg.reward
        self.scoring: ScoringPool[str] = ScoringPool(
            self.scorer.score_batch, lambda key, reason: RewardError(reason), num_threads=rc.num_threads,
            batch_size=rc.batch_size, max_wait_s=0.0, timeout_s=rc.timeout_s)
        self.sampling = SamplingParams.from_config(
            cfg.rollout, **({} if ev.temperature is None else {"temperature": float(ev.temperature)}))
        engine_cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, seed=int(ev.seed)))
        self.engine = make_engine(engine_cfg, None, self.tokenizer)
        self._own_buffer = buffer is None
        self.buffer = buffer or BufferClient.connect(cfg.buffer.url, cfg.buffer.run_id, cfg.buffer)
        self.path = Path(output_dir or cfg.run.output_dir) / EVAL_FILE
        self.due = 0  # the next version to evaluate (or the first one after it that exists)
        self.records: list[dict[str, Any]] = []
        ws = cfg.weight_server  # last: a constructor that fails before this line leaves no socket behind
        self.weights = WeightSubscriber(ws.address, ws.pub_address, ws, worker_id="evaluator")

    # ------------------------------------------------------------------ one evaluation

    def evaluate(self) -> dict[str, Any]:
        """Sample and score every prompt ``eval.n`` times with the engine's current weights."""
        t0, n = time.monotonic(), self.cfg.eval.n
        rendered: dict[str, tuple[Prompt, str]] = {}
        for i, prompt in enumerate(self.prompts):
            try:
                text, ids = self.renderer.render(prompt)
            except PromptRejected as exc:
                log.warning("evaluator: prompt %s left out: %s", prompt.prompt_id, exc)
                continue
            rendered[str(i)] = (prompt, text)
            for j in range(n):
                self.engine.add(GenRequest(f"{i}/{j}", ids, self.sampling))
        results: list[GenResult] = []
        while self.engine.has_work():
            if self._abort:
                self.engine.abort_all()
                raise InterruptedError("evaluation abandoned by a second stop request")
            results.extend(self.engine.step())
        self.scoring.submit([(r.request_id, ScoreItem.of(*rendered[r.request_id.split("/")[0]], r.text,
                                                         r.token_ids.tolist())) for r in results])
        scores: dict[str, Any] = {}
        while len(scores) < len(results):
            if self._abort:
                raise InterruptedError("evaluation abandoned by a second stop request while its rewards were scored")
            scores.update(self.scoring.poll(flush=True, wait_s=SCORE_WAIT_S))
        per_prompt: dict[str, list[float]] = {key: [] for key in rendered}
        failed = 0
        for r in results:
            score = scores[r.request_id]
            if isinstance(score, RewardError):
                failed += 1
                continue
            per_prompt[r.request_id.split("/")[0]].append(score[0])
        ev = self.cfg.eval
        out: dict[str, Any] = {EVAL_VERSION: self.engine.version,
                               **eval_metrics(list(per_prompt.values()), ev.k, ev.pass_threshold)}
        out.update({
            "eval/response_len_mean": statistics.fmean(r.num_tokens for r in results) if results else math.nan,
            "eval/prompts": len(rendered), "eval/samples": len(results), "eval/failed": failed,
            "eval/seconds": time.monotonic() - t0, "time": time.time(),
        })
        return out

    def record(self, metrics: dict[str, Any]) -> None:
        """One evaluation into ``eval.jsonl`` and the buffer's stats (the learner and monitor read them)."""
        self.records.append(metrics)
        append_line(self.path, json.dumps(metrics))
        self.buffer.publish_stats(EVAL_STATS, metrics)
        ks = ", ".join(f"pass@{k} {metrics[f'eval/pass@{k}']:.3f}" for k in self.cfg.eval.k)
        log.info("evaluator: version %d: reward %.4f, %s (%d prompts x %d, %.1f s)", metrics[EVAL_VERSION],
                 metrics[EVAL_REWARD_MEAN], ks, metrics["eval/prompts"], self.cfg.eval.n, metrics["eval/seconds"])

    # ------------------------------------------------------------------ the loop

    def _pull_newest(self) -> bool:
        got = self.weights.pull(None, into=self.engine.weights_target())
        if got is None:
            return False
        version, tensors = got
        self.engine.update_weights(tensors, version)
        return True

    def run(self, max_evals: int | None = None) -> list[dict[str, Any]]:
        every = int(self.cfg.eval.every)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        have = False
        try:
            while not self.stop_event.is_set() and (max_evals is None or len(self.records) < max_evals):
                newest = self.weights.poll_announcement(timeout_ms=ANNOUNCE_WAIT_MS)
                if not have or (newest is not None and newest >= self.due > self.engine.version):
                    have = self._pull_newest() or have
                if not have or self.engine.version < self.due:
                    continue
                self.record(self.evaluate())
                self.due = (self.engine.version // every + 1) * every
        except InterruptedError as exc:
            log.info("evaluator: %s", exc)
        finally:
            self.close()
        return self.records

    def close(self) -> None:
        """Scoring threads (never waiting for a stuck reward call), engine, connections."""
        self.scoring.close(wait_s=1.0)
        self.engine.close()
        self.weights.close()
        if self._own_buffer:
            self.buffer.close()

    def request_stop(self, *_: Any) -> None:
        """Finish the evaluation in progress, then stop; a second request abandons it."""
        if self.stop_event.is_set():
            self._abort = True
        self.stop_event.set()


def run_evaluator(cfg: Config, **budget: Any) -> list[dict[str, Any]]:
    """Entry-point body (``python -m rollout_workers.evaluator``, started by ``rlhf-run`` when
    ``eval.every`` > 0)."""
    validate(cfg)
    if cfg.eval.every < 1:
        raise ConfigError("the evaluator needs eval.every >= 1 (learner versions between evaluations)")
    if cfg.buffer.url is None or cfg.weight_server.address is None or cfg.buffer.run_id == "auto":
        raise ConfigError("the evaluator needs buffer.url, buffer.run_id and weight_server.address/pub_address "
                          "(rlhf-run passes them)")
    from rlhf_core.cli import freeze_startup_heap
    from rollout_workers.worker import _set_threads

    _set_threads()
    evaluator = Evaluator(cfg)
    freeze_startup_heap()  # this call owns the process
    signal.signal(signal.SIGTERM, evaluator.request_stop)
    signal.signal(signal.SIGINT, evaluator.request_stop)
    return evaluator.run(**budget)


def main() -> None:
    from rlhf_core.cli import hydra_entry
    from rlhf_core.config import to_object

    @hydra_entry()
    def app(cfg: Any) -> int:
        run_evaluator(to_object(cfg))
        return 0

    app()


if __name__ == "__main__":
    main()
