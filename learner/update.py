"""One learner version's work: a collated batch in, one update of the configured algorithm,
metrics out.

:meth:`PolicyUpdater.update` does, in order:

1. the batch's statistics (:func:`learner.stats.batch_metrics`);
2. shape rewards (``algo.overlong=shaping``: DAPO's soft over-long penalty,
   :func:`rlhf_core.dapo.overlong_penalty`), then normalise them with running statistics
   (``algo.normalize_rewards``); the advantages see the shaped rewards, the ``reward/*``
   metrics the samples' own;
3. the algorithm's ``prepare`` (``learner/algorithms/``, looked up once from
   ``algo.estimator``): this rank's rows (every rank is given the SAME batch; rank ``r``
   trains rows ``r, r + W, ...``, padded with blank filler rows so every rank makes the same
   number of forward/backward calls, which ZeRO-3 requires), the no-grad passes it needs
   (:class:`learner.passes.ModelPasses`: pi_prox, reference and teacher log-probs, critic values)
   and its advantages;
4. ``ppo_epochs`` x ``num_minibatches`` optimizer steps, each accumulating the algorithm's
   ``loss`` over sort-by-length micro-batches. Every micro-batch loss is scaled by its share of
   the minibatch (tokens, sequences or pairs, counted over all ranks), so the accumulated
   gradient equals that of one pass over the whole minibatch.

With one epoch of one minibatch pi_prox is read off the training pass instead
(:func:`prox_is_training_pass`). Metrics carry the prefixes ``learner/``, ``loss/``,
``staleness/``, ``reward/``, ``mismatch/`` (:mod:`learner.algorithms.mismatch`).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from learner import algorithms
from learner.algorithms import Work
from learner.batch import TrainBatch
from learner.engines import TrainEngine, all_reduce_max, all_reduce_sum
from learner.lm_head import no_filtering
from learner.passes import ModelPasses
from learner.stats import MetricSums, RunningMoments, batch_metrics, flops_metrics, peak_flops
from rlhf_core import metric_names as M
from rlhf_core.config import Config, ConfigError, response_budget
from rlhf_core.dapo import overlong_penalty


def prox_is_training_pass(cfg: Config, module: torch.nn.Module) -> bool:
    """Whether pi_prox can be read off the training forward pass instead of a pass of its own.

    pi_prox is the policy before this update. With one epoch of one minibatch, every micro-batch
    is forwarded before the single optimizer step, so the training pass runs exactly those
    weights: its log-probs, detached, are pi_prox, and the separate no-grad pass (a third of an
    update's compute) is redundant. That holds only when the algorithm reads pi_prox at all,
    nothing needs it before training (KL in the reward, V-trace targets, a critic's GAE does
    not: it reads values), no token can turn -inf under top-k/top-p (the loss mask is fixed
    before training), and train mode computes what eval mode does (no dropout).
    """
    a, lc, r = cfg.algo, cfg.learner, cfg.rollout
    if lc.ppo_epochs != 1 or lc.num_minibatches != 1 or not algorithms.algorithm(a.estimator).proximal or a.vtrace:
        return False
    if a.kl_coef > 0 and a.kl_mode == "reward":
        return False
    if not no_filtering(r):
        return False
    return not has_dropout(module)


def has_dropout(module: torch.nn.Module) -> bool:
    """A dropout module with p > 0 (LoRA's ``model.lora.dropout`` is one per adapted layer), or a
    dropout probability > 0 in the model's config (HF attention applies ``config.attention_dropout``
    functionally, in train mode only)."""
    if any(isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0 for m in module.modules()):
        return True
    to_dict = getattr(getattr(module, "config", None), "to_dict", None)
    items = to_dict().items() if callable(to_dict) else ()
    return any(("dropout" in k or "pdrop" in k) and isinstance(v, float) and v > 0 for k, v in items)


class PolicyUpdater:
    """Runs updates of ``engine`` (and ``critic_engine`` for an algorithm with a critic). See the
    module docstring.

    Args:
        cfg: the run's config (``algo``, ``learner``, ``rollout`` are read).
        engine: the policy's :class:`learner.engines.TrainEngine`.
        ref_model: frozen reference policy (plain module on this rank's device) or None.
        critic_engine: the critic's engine (``rlhf_core.models.load_critic``) or None.
        teacher: frozen teacher of ``distill.teacher.path`` (``rlhf_core.models.load_teacher``) or None.
    """

    def __init__(self, cfg: Config, engine: TrainEngine, ref_model: torch.nn.Module | None = None,
                 critic_engine: TrainEngine | None = None, teacher: torch.nn.Module | None = None) -> None:
        self.cfg, self.algo, self.lcfg, self.rollout = cfg, cfg.algo, cfg.learner, cfg.rollout
        self.distill = cfg.distill
        self.engine, self.critic = engine, critic_engine
        self.algorithm = algorithms.algorithm(cfg.algo.estimator)
        self.policy_loss = algorithms.policy_loss(cfg.algo.policy_loss)
        self.reward_stats = RunningMoments()
        self.passes = ModelPasses(cfg, engine, ref_model, critic_engine, teacher)  # what the algorithm asks of the models
        self.device = self.passes.device
        # ds_numel: under ZeRO-3 a parameter here is an empty placeholder for its partitions
        self.trainable_params = sum(int(getattr(p, "ds_numel", p.numel())) for p in engine.module.parameters()
                                    if p.requires_grad)
        self.total_params = sum(int(getattr(p, "ds_numel", p.numel())) for p in engine.module.parameters())
        self.peak_flops = peak_flops(self.device, self.lcfg.peak_tflops)
        if self.algorithm.needs_critic and self.critic is None:
            raise ConfigError(f"algo.estimator={cfg.algo.estimator} needs a critic: build one with "
                              "rlhf_core.models.load_critic and pass critic_engine")
        # built once (the rules on the config are validate's: rlhf_core.config)
        self.is_config = self.algo.importance_sampling() if self.policy_loss.importance_sampling else None
        self.prox_from_training_pass = prox_is_training_pass(cfg, engine.module)
        self.version = 0  # the version of the weights held: set by each update (tokens of it have lag 0)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {"reward_stats": self.reward_stats.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.reward_stats.load_state_dict(state["reward_stats"])

    # ------------------------------------------------------------------ the update
    def update(self, batch: TrainBatch, learner_version: int) -> dict[str, float]:
        """One learner version's optimisation on ``batch`` (the same batch on every rank)."""
        t_start = time.perf_counter()
        self.version = learner_version
        m = MetricSums()
        batch_metrics(batch, learner_version, self.algo.group_size, m)
        rewards = self._rewards(batch, m)
        lr = self.engine.lr
        t0 = time.perf_counter()
        work = self.algorithm.prepare(self, batch, rewards, m)
        m.set("learner/time_prepare_s", time.perf_counter() - t0)
        steps = self._train(work, learner_version, m) if work is not None else 0
        m.reduce(all_reduce_sum, all_reduce_max)
        out = m.result()
        elapsed = time.perf_counter() - t_start
        out.update({
            M.VERSION: float(learner_version),
            "learner/lr": lr,
            "learner/optimizer_steps": float(steps),
            M.TIME_COMPUTE_S: elapsed,
            M.SAMPLES_PER_S: batch.num_rows / elapsed,
            M.TOKENS_PER_S: float(batch.policy_mask.sum()) / elapsed,
        })
        # the tokens trained, forward and backward, once per epoch; per device: each rank trains
        # its share of them in this time, on its own peak
        trained = work.tokens * self.lcfg.ppo_epochs if work is not None else 0.0
        out.update(flops_metrics(self.total_params, trained / self.engine.world_size, elapsed, self.peak_flops,
                                 trainable=self.trainable_params))
        return out

    def _rewards(self, batch: TrainBatch, m: MetricSums) -> torch.Tensor:
        """``[B]`` the rewards the advantages see: shaped, then normalised, as configured."""
        rewards = batch.rewards
        if self.algo.overlong == "shaping":  # DAPO eq. 13, on the rewards before any baseline sees them
            penalty = overlong_penalty(batch.response_lengths, max_len=response_budget(self.rollout),
                                       buffer=self.algo.overlong_buffer)
            rewards = rewards + penalty
            m.set("reward/overlong_penalty_mean", penalty.double().mean())
            m.set("reward/overlong_penalized_frac", (penalty < 0).double().mean())
            m.set("reward/shaped_mean", rewards.double().mean())
        if self.algo.normalize_rewards:
            self.reward_stats.update(rewards)
            rewards = self.reward_stats.normalize(rewards, self.algo.reward_norm_eps).float()
            m.set("reward/normalized_mean", rewards.mean())
            m.set("reward/running_mean", self.reward_stats.mean)
            m.set("reward/running_std", self.reward_stats.std)
        return rewards

    def _train(self, work: Work, version: int, m: MetricSums) -> int:
        """``ppo_epochs`` x ``num_minibatches`` optimizer steps over ``work``; returns the steps."""
        lc = self.lcfg
        t1 = time.perf_counter()
        parts = [self._minibatches(len(work.weights), version, e) for e in range(lc.ppo_epochs)]
        # per (epoch, minibatch), over ALL ranks: the denominators that make micro-batch losses add up exactly
        flat = torch.tensor([float(work.weights[p].sum()) for ep in parts for p in ep], dtype=torch.float64)
        all_reduce_sum(flat)
        denoms = iter(flat.tolist())
        lengths = work.local.lengths.view(-1, work.rows_per_unit).sum(-1).cpu()
        per_micro = max(1, lc.micro_batch_size // work.rows_per_unit)
        steps = 0
        self.engine.train(True)
        if self.critic is not None:
            self.critic.train(True)
        for ep_parts in parts:
            # every micro-batch cut before the first forward: cutting reads lengths off the device,
            # which between two micro-batches would leave the device idle while the host waits.
            # Sort-by-length: longest first, so an out-of-memory error shows on the first one.
            plan = []
            for part in ep_parts:
                units = part[torch.argsort(lengths[part], descending=True, stable=True)]
                plan.append([work.local.select([u * work.rows_per_unit + k for u in units[i : i + per_micro].tolist()
                                                for k in range(work.rows_per_unit)])
                             for i in range(0, len(units), per_micro)])
            for mbs in plan:
                denom = next(denoms)
                for mb in mbs:
                    self.algorithm.loss(self, mb, denom, m)
                norm = self.engine.step()
                m.add("learner/grad_norm", norm)
                m.add_max("learner/grad_norm_max", norm)
                if self.critic is not None:
                    m.add("learner/critic_grad_norm", self.critic.step())
                steps += 1
        m.set("learner/time_train_s", time.perf_counter() - t1)
        return steps

    def _minibatches(self, n: int, version: int, epoch: int) -> list[torch.Tensor]:
        """This rank's ``n`` local units shuffled (seeded by version and epoch, so a resumed run
        replays the same order) and split into ``num_minibatches`` parts (fewer if n is smaller)."""
        g = torch.Generator().manual_seed(self.lcfg.seed * 1_000_003 + version * 1009 + epoch)
        perm = torch.randperm(n, generator=g)
        k = min(self.lcfg.num_minibatches, n)
        return [p for p in torch.tensor_split(perm, k)]
