"""One learner version's work: samples in, one PPO-family (or online-DPO) update, metrics out.

:meth:`PolicyUpdater.update` does, in order:

1. collate the samples (:func:`learner.batch.collate`), check vocabulary and groups;
2. shape rewards (``algo.overlong=shaping``: DAPO's soft over-long penalty,
   :func:`rlhf_core.dapo.overlong_penalty`), then normalise them with running statistics
   (``algo.normalize_rewards``); the advantages see the shaped rewards, the ``reward/*``
   metrics the samples' own;
3. shard the rows over data-parallel ranks (every rank is given the SAME full sample list;
   rank ``r`` trains rows ``r, r + W, ...``, padded with blank filler rows so every rank
   makes the same number of forward/backward calls, which ZeRO-3 requires);
4. recompute, without gradients, the proximal log-probs pi_prox with the rollout's sampling
   settings (so they are comparable to the workers' behaviour log-probs), critic values,
   and reference log-probs when the workers did not send them and KL or DPO needs them.
   With one epoch of one minibatch pi_prox is read off the training pass instead
   (:func:`prox_is_training_pass`);
5. advantages (:mod:`learner.batch_advantages`), with global statistics across ranks;
6. ``ppo_epochs`` x ``num_minibatches`` optimizer steps, each accumulating gradients over
   sort-by-length micro-batches. Every micro-batch loss is scaled by its share of the
   minibatch (tokens, sequences or pairs, per ``algo.agg_mode``, counted over all ranks), so
   the accumulated gradient equals that of one pass over the whole minibatch.

The loss mask of every loss, KL, entropy, advantage and statistic is ``TrainBatch.policy_mask``
(the tokens the policy sampled: a multi-turn episode's observations are out), AND finite
log-probs, AND (``algo.overlong=mask``) not a truncated response. It is fixed before training;
a token that the weights of a later optimizer step filter out (top-k/top-p: log-prob -inf) adds
no KL and no ``approx_kl`` (``loss/filtered_out_frac`` counts them).

Policy losses: ``decoupled`` (AReaL: clip pi/pi_prox, weight by pi_prox/mu with TIS/MIS) or
``ppo`` (plain PPO with old = behaviour, no correction: the baseline that shows what
staleness does). Metrics carry the prefixes ``learner/``, ``loss/``, ``staleness/``, ``reward/``.
"""

from __future__ import annotations

import time
from typing import Any, Iterable, Sequence

import torch

from learner import batch_advantages as batch_adv
from learner.batch import (
    BatchError, TrainBatch, check_stop_tokens, chunked_response_logprobs, collate, fused_head, fused_response_logprobs,
    lm_parts, micro_batches, response_logits, response_values,
)
from learner.engines import TrainEngine, all_reduce_max, all_reduce_sum
from learner.dpo_loss import dpo_loss
from learner.losses import (
    ISConfig, decoupled_ppo_loss, entropy_bonus, entropy_from_logits, kl_estimate, ppo_clip_loss, value_loss,
)
from learner.masked import aggregate, masked_max, masked_mean, masked_sum
from learner.stats import MetricSums, RunningMoments, flops_metrics, peak_flops
from rlhf_core import metric_names as M
from rlhf_core.config import AlgoConfig, Config, ConfigError, response_budget
from rlhf_core.dapo import overlong_penalty
from rlhf_core.errors import UserError
from rlhf_core.records import Sample
from rlhf_core.sampling import process_logits, token_logprobs


class MissingReferenceError(UserError):
    """KL or DPO needs reference log-probs that neither the samples nor the learner provide."""


def importance_sampling(algo: AlgoConfig) -> ISConfig:
    """The decoupled loss's IS settings: correction and level, with the cap and band of that level
    (``algo.tis_cap``/``mis_*`` per token, ``algo.seq_tis_cap``/``seq_mis_*`` on the geometric mean)."""
    seq = "seq_" if algo.is_level == "sequence" else ""
    try:
        return ISConfig(correction=algo.is_correction, level=algo.is_level, tis_cap=getattr(algo, f"{seq}tis_cap"),
                        mis_low=getattr(algo, f"{seq}mis_low"), mis_high=getattr(algo, f"{seq}mis_high"))
    except ValueError as exc:
        raise ConfigError(f"algo.is_level={algo.is_level} uses algo.{seq}tis_cap, algo.{seq}mis_low and "
                          f"algo.{seq}mis_high: {exc}; fix them in the algo config") from None


def no_filtering(rollout: Any) -> bool:
    """Sampling without top-k or top-p (any temperature > 0): every token keeps a finite log-prob."""
    return rollout.temperature > 0 and not (rollout.top_k or 0) > 0 and (rollout.top_p is None or rollout.top_p >= 1.0)


def prox_is_training_pass(cfg: Config, module: torch.nn.Module) -> bool:
    """Whether pi_prox can be read off the training forward pass instead of a pass of its own.

    pi_prox is the policy before this update. With one epoch of one minibatch, every micro-batch
    is forwarded before the single optimizer step, so the training pass runs exactly those
    weights: its log-probs, detached, are pi_prox, and the separate no-grad pass (a third of an
    update's compute) is redundant. That holds only when nothing needs pi_prox before training
    (KL in the reward, V-trace targets, a critic's GAE does not: it reads values), when no token
    can turn -inf under top-k/top-p (the loss mask is fixed before training), and when train
    mode computes what eval mode does (no dropout).
    """
    a, lc, r = cfg.algo, cfg.learner, cfg.rollout
    if lc.ppo_epochs != 1 or lc.num_minibatches != 1 or a.estimator == "dpo" or a.vtrace:
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
    config = getattr(module, "config", None)
    items = config.to_dict().items() if hasattr(config, "to_dict") else ()
    return any(("dropout" in k or "pdrop" in k) and isinstance(v, float) and v > 0 for k, v in items)


class PolicyUpdater:
    """Runs updates of ``engine`` (and ``critic_engine`` for gae). See the module docstring.

    Args:
        cfg: the run's config (``algo``, ``learner``, ``rollout`` are read).
        engine: the policy's :class:`learner.engines.TrainEngine`.
        ref_model: frozen reference policy (plain module on this rank's device) or None.
        critic_engine: the critic's engine (``rlhf_core.models.load_critic``) or None.
        eos_ids: the end-of-sequence ids the workers stop at; when given, every batch is checked
            against them (a worker with another tokenizer is refused with a clear message).
    """

    def __init__(self, cfg: Config, engine: TrainEngine, ref_model: torch.nn.Module | None = None,
                 critic_engine: TrainEngine | None = None, eos_ids: Iterable[int] | None = None) -> None:
        self.cfg, self.algo, self.lcfg, self.rollout = cfg, cfg.algo, cfg.learner, cfg.rollout
        self.engine, self.ref_model, self.critic = engine, ref_model, critic_engine
        # checked against every batch (tokenizer mismatch); stop strings end responses on other tokens
        self.eos_ids = frozenset(eos_ids or ()) if not self.rollout.stop_strings else frozenset()
        self.reward_stats = RunningMoments()
        model_cfg = engine.module.config
        # config.vocab_size, not the embedding's shape: under ZeRO-3 the weight is a placeholder.
        self.vocab_size = int(model_cfg.vocab_size)
        pad = model_cfg.pad_token_id if model_cfg.pad_token_id is not None else model_cfg.eos_token_id
        self.pad_id = int(pad if isinstance(pad, int) else (pad[0] if pad else 0))
        self.device = next(engine.module.parameters()).device
        # ds_numel: under ZeRO-3 a parameter here is an empty placeholder for its partitions
        self.trainable_params = sum(int(getattr(p, "ds_numel", p.numel())) for p in engine.module.parameters()
                                    if p.requires_grad)
        self.total_params = sum(int(getattr(p, "ds_numel", p.numel())) for p in engine.module.parameters())
        self.peak_flops = peak_flops(self.device, self.lcfg.peak_tflops)
        self._check_config()
        # built once; plain PPO has no IS weights, so its unused caps are not checked
        self.is_config = importance_sampling(self.algo) if self.algo.policy_loss == "decoupled" else None
        self.prox_from_training_pass = prox_is_training_pass(cfg, engine.module)

    def _check_config(self) -> None:
        a, lc = self.algo, self.lcfg
        if a.estimator == "gae" and self.critic is None:
            raise ConfigError("algo.estimator=gae needs a critic: build one with rlhf_core.models.load_critic and pass critic_engine")
        if a.estimator in batch_adv.GROUP_ESTIMATORS + ("dpo",) and lc.batch_size % a.group_size:
            raise ConfigError(f"learner.batch_size {lc.batch_size} is not divisible by algo.group_size {a.group_size}")
        if a.estimator == "dpo" and a.group_size < 2:
            raise ConfigError(f"algo.estimator=dpo pairs responses of one prompt, so algo.group_size must be >= 2, got {a.group_size}")
        if lc.micro_batch_size < 1 or lc.ppo_epochs < 1 or lc.num_minibatches < 1:
            raise ConfigError(f"learner.micro_batch_size {lc.micro_batch_size}, ppo_epochs {lc.ppo_epochs} and "
                              f"num_minibatches {lc.num_minibatches} must all be >= 1")

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {"reward_stats": self.reward_stats.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.reward_stats.load_state_dict(state["reward_stats"])

    def loss_mask(self, batch: TrainBatch) -> torch.Tensor:
        """``[B, T]`` tokens that enter the losses: the policy's (``policy_mask``), minus every token
        of a truncated response under ``algo.overlong=mask`` (DAPO's over-long filtering)."""
        mask = batch.policy_mask
        if self.algo.overlong == "mask":
            mask = mask & ~batch.truncated[:, None]
        return mask

    # ------------------------------------------------------------------ forward helpers
    def _logp_entropy(self, forward: Any, mb: TrainBatch, entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[b, T]`` log-probs of the response under the rollout's sampling distribution, and
        its per-token entropy when asked (same processed logits; differentiable only when the
        entropy bonus is on, otherwise a detached statistic that keeps no graph)."""
        r = self.rollout
        model = self.engine.module if forward == self.engine.forward else forward
        parts = lm_parts(model) if mb.response_ids.numel() > self.lcfg.logits_chunk_tokens else None
        weight = fused_head(parts[1]) if parts is not None else None
        if weight is not None and not (entropy and self.algo.entropy_coef) and no_filtering(r):
            # the common case (plain head, no top-k/top-p, entropy only a statistic): a written-out backward
            return fused_response_logprobs(parts[0], weight, mb, r.temperature, self.lcfg.logits_chunk_tokens, entropy,
                                           compiled=self.engine.compiled, keep_logits=self.lcfg.keep_head_logits)
        if parts is not None:  # long responses x a large vocabulary: never all the logits at once
            logp, ent = chunked_response_logprobs(
                *parts, mb, lambda x: process_logits(x, r.temperature, r.top_k, r.top_p), self.lcfg.logits_chunk_tokens,
                entropy_from_logits if entropy else None)
            return logp, (ent if ent is None or self.algo.entropy_coef else ent.detach())
        processed = process_logits(response_logits(forward, mb), r.temperature, r.top_k, r.top_p)
        logp = token_logprobs(processed, mb.response_ids)
        if not entropy:
            return logp, None
        if self.algo.entropy_coef:
            return logp, entropy_from_logits(processed)
        with torch.no_grad():
            return logp, entropy_from_logits(processed.detach())

    @torch.no_grad()
    def _recompute(self, forward: Any, batch: TrainBatch, kind: str) -> torch.Tensor:
        """``[B, T]`` no-grad log-probs (``kind="logp"``) or critic values (``"values"``), micro-batched."""
        out = torch.zeros(batch.response_ids.shape, dtype=torch.float32, device=self.device)
        # cut (and the row indices copied to the device) before the first forward, as in _ppo_update
        plan = [(rows.to(self.device), mb) for rows, mb in micro_batches(batch, self.lcfg.micro_batch_size)]
        for rows, mb in plan:
            x = self._logp_entropy(forward, mb, False)[0] if kind == "logp" else response_values(forward, mb)
            out[rows, : x.shape[1]] = x.float()
        return torch.where(batch.response_mask, out, torch.zeros_like(out))

    def proximal_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """``[B, T]`` pi_prox: the current weights' log-probs of the sampled tokens, in eval mode."""
        self.engine.train(False)
        return self._recompute(self.engine.forward, batch, "logp")

    def _reference_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        if batch.ref_logprobs is not None:
            return batch.ref_logprobs
        if self.ref_model is None:
            raise MissingReferenceError(
                f"algo.kl_coef={self.algo.kl_coef} / algo.estimator={self.algo.estimator} needs reference log-probs, but "
                "the samples carry none and the learner has no reference model: set rollout.ref_logprobs_on=worker "
                "or give the learner a reference model (rlhf_core.models.load_reference)"
            )
        return self._recompute(self.ref_model, batch, "logp")

    # ------------------------------------------------------------------ the update
    def update(self, samples: Sequence[Sample], learner_version: int) -> dict[str, float]:
        """One learner version's optimisation on ``samples`` (the same list on every rank)."""
        t_start = time.perf_counter()
        batch = collate(samples, self.pad_id, self.device, self.vocab_size)
        if self.eos_ids:
            check_stop_tokens(samples, self.eos_ids)
        if self.algo.estimator in batch_adv.GROUP_ESTIMATORS + ("dpo",):
            biggest = int(batch.group_sizes.max())
            if biggest > self.algo.group_size:
                raise BatchError(
                    f"a group has {biggest} samples but algo.group_size is {self.algo.group_size}: the workers and "
                    "the learner must run with the same algo.group_size"
                )
        m = MetricSums()
        self._batch_metrics(batch, samples, learner_version, m)
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
        lr = self.engine.lr
        if self.algo.estimator == "dpo":
            steps, trained = self._dpo_update(batch, rewards, learner_version, m)
        else:
            steps, trained = self._ppo_update(batch, rewards, learner_version, m)
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
        # per device: each rank trains its share of the batch's tokens in this time, on its own peak
        out.update(flops_metrics(self.total_params, trained / self.engine.world_size, elapsed, self.peak_flops,
                                 trainable=self.trainable_params))
        return out

    def _shard(self, n: int) -> tuple[list[int], list[bool]]:
        """This rank's row indices out of ``n`` (strided), padded with blank fillers to ``ceil(n / W)``."""
        rank, world = self.engine.rank, self.engine.world_size
        rows = list(range(rank, n, world))
        per_rank = -(-n // world)
        fill = per_rank - len(rows)
        return rows + [0] * fill, [False] * len(rows) + [True] * fill

    def _minibatches(self, n: int, version: int, epoch: int) -> list[torch.Tensor]:
        """This rank's ``n`` local rows shuffled (seeded by version and epoch, so a resumed run
        replays the same order) and split into ``num_minibatches`` parts (fewer if n is smaller)."""
        g = torch.Generator().manual_seed(self.lcfg.seed * 1_000_003 + version * 1009 + epoch)
        perm = torch.randperm(n, generator=g)
        k = min(self.lcfg.num_minibatches, n)
        return [p for p in torch.tensor_split(perm, k)]

    def _global_counts(self, parts: list[list[torch.Tensor]], mask: torch.Tensor) -> list[list[float]]:
        """Per (epoch, minibatch): tokens (token-mean) or sequences with a token (seq-* modes)
        over ALL ranks: the denominators that make micro-batch losses add up exactly."""
        per_row = mask.sum(-1).double() if self.algo.agg_mode == "token-mean" else (mask.sum(-1) > 0).double()
        flat = torch.tensor([float(per_row[p].sum()) for ep in parts for p in ep], dtype=torch.float64)
        all_reduce_sum(flat)
        it = iter(flat.tolist())
        return [[next(it) for _ in ep] for ep in parts]

    def _ppo_update(self, batch: TrainBatch, rewards: torch.Tensor, version: int, m: MetricSums) -> tuple[int, float]:
        """Returns the optimizer steps taken and the tokens trained (forward and backward): every
        token of the batch (prompt and response), once per epoch."""
        a, lc = self.algo, self.lcfg
        t0 = time.perf_counter()
        rows, fillers = self._shard(batch.num_rows)
        local = batch.select(rows, drop=fillers)
        # None: read off the training pass (see prox_is_training_pass)
        prox = None if self.prox_from_training_pass else self.proximal_logprobs(local)
        m.set("learner/prox_pass", float(prox is not None))
        need_ref = a.kl_coef > 0
        ref = self._reference_logprobs(local) if need_ref else None
        # A token that top-k/top-p now filters out has log-prob -inf under pi_prox (or the
        # reference): no ratio exists for it, so it leaves the loss (counted in a metric).
        finite = torch.isfinite(local.behaviour_logprobs)
        if prox is not None:
            finite &= torch.isfinite(prox)
        if ref is not None:
            finite &= torch.isfinite(ref)
            ref = torch.where(finite, ref, torch.zeros_like(ref))
        mask = self.loss_mask(local) & finite
        if prox is not None:
            prox = torch.where(mask, prox, torch.zeros_like(prox))
        old_values = None
        if self.critic is not None:
            self.critic.train(False)
            old_values = self._recompute(self.critic.forward, local, "values")
        kl = batch_adv.kl_per_token(a, prox, ref, mask) if (need_ref and a.kl_mode == "reward") else None
        group_adv = None
        if a.estimator in batch_adv.GROUP_ESTIMATORS:
            group_adv = batch_adv.group_relative_advantages(a.estimator, rewards, batch.group_sizes)[torch.tensor(rows, device=self.device)]
        adv, returns = batch_adv.compute_advantages(
            a, rewards[torch.tensor(rows, device=self.device)], mask, group_adv=group_adv, values=old_values, kl=kl,
            behav_logp=local.behaviour_logprobs, prox_logp=prox, all_reduce=all_reduce_sum,
        )
        if prox is not None:
            self._staleness_metrics(local, prox, mask, m)
        n_tok = float(mask.sum())
        m.add("loss/advantage_mean", masked_mean(adv, mask), n_tok)
        m.add("loss/advantage_abs_mean", masked_mean(adv.abs(), mask), n_tok)
        m.add("learner/nonfinite_logprob_frac", masked_mean((~finite).float(), local.policy_mask), float(local.policy_mask.sum()))
        extras = {"adv": adv, "loss_mask": mask.float()}
        if prox is not None:
            extras["prox"] = prox
        if ref is not None:
            extras["ref"] = ref
        if old_values is not None:
            extras.update(old_values=old_values, returns=returns)
        local = local.with_extras(**extras)
        m.set("learner/time_prepare_s", time.perf_counter() - t0)

        t1 = time.perf_counter()
        parts = [self._minibatches(local.num_rows, version, e) for e in range(lc.ppo_epochs)]
        counts = self._global_counts(parts, mask)
        steps = 0
        self.engine.train(True)
        if self.critic is not None:
            self.critic.train(True)
        for epoch, ep_parts in enumerate(parts):
            # every micro-batch cut before the first forward: cutting reads lengths off the device,
            # which between two micro-batches would leave the device idle while the host waits
            plan = [[mb for _, mb in micro_batches(local.select(part), lc.micro_batch_size)] for part in ep_parts]
            for mbs, denom in zip(plan, counts[epoch]):
                for mb in mbs:
                    self._ppo_micro(mb, denom, m)
                norm = self.engine.step()
                m.add("learner/grad_norm", norm)
                m.add_max("learner/grad_norm_max", norm)
                if self.critic is not None:
                    m.add("learner/critic_grad_norm", self.critic.step())
                steps += 1
        m.set("learner/time_train_s", time.perf_counter() - t1)
        return steps, float(batch.attention_mask.sum()) * lc.ppo_epochs

    def _ppo_micro(self, mb: TrainBatch, denom: float, m: MetricSums) -> None:
        a = self.algo
        mask = mb.token_extras["loss_mask"] > 0
        # counts stay on the device (no host sync inside the micro-batch loop)
        w = mask.sum()
        count = w if a.agg_mode == "token-mean" else (mask.sum(-1) > 0).sum()
        # DeepSpeed averages gradients over ranks; the share is of the global minibatch, so x W.
        share = count * (self.engine.world_size / denom) if denom > 0 else 0.0
        norm_len = response_budget(self.rollout)
        logp, entropy = self._logp_entropy(self.engine.forward, mb, True)
        # The mask was fixed before training: from the update's second optimizer step on, a token
        # can leave these weights' top-k/nucleus (log-prob -inf). It has no KL (k3 would be
        # inf - inf = nan); it stays in the denominators, as every masked-out token's 0 does.
        live = mask & torch.isfinite(logp.detach())
        m.add("loss/filtered_out_frac", masked_mean((~live).float(), mask), w)
        adv = mb.token_extras["adv"]
        prox = mb.token_extras.get("prox")
        if prox is None:  # the weights before the update are these: pi_prox is this pass, detached
            prox = torch.where(mask, logp.detach(), torch.zeros_like(logp))
            self._staleness_metrics(mb, prox, mask, m)
        clip = {"clip_eps_low": a.clip_eps_low, "clip_eps_high": a.clip_eps_high, "dual_clip_c": a.dual_clip_c,
                "agg_mode": a.agg_mode, "norm_len": norm_len}
        if a.policy_loss == "decoupled":
            loss, st = decoupled_ppo_loss(logp, prox, mb.behaviour_logprobs, adv, mask, is_config=self.is_config, **clip)
        else:  # plain PPO: the behaviour policy is "old", no correction for staleness
            loss, st = ppo_clip_loss(logp, mb.behaviour_logprobs, adv, mask, **clip)
        total = loss
        bonus, ent = entropy_bonus(entropy, mask, coef=a.entropy_coef, agg_mode=a.agg_mode, norm_len=norm_len)
        if a.entropy_coef:
            total = total + bonus
        if "ref" in mb.token_extras:
            kl = kl_estimate(logp, mb.token_extras["ref"], live, kind=a.kl_estimator)
            kl_agg = aggregate(kl, mask, mode=a.agg_mode, norm_len=norm_len)
            if a.kl_mode == "loss":
                total = total + a.kl_coef * kl_agg
            m.add("loss/kl", kl_agg.detach(), count)
        self.engine.backward(total * share)
        m.add("loss/policy", st.loss, count)
        m.add("loss/total", total.detach(), count)
        m.add("loss/entropy", ent.entropy, count)
        for key in ("clip_frac", "dual_clip_frac", "approx_kl", "ratio_mean"):
            m.add(f"loss/{key}", getattr(st, key), w)
        m.add_max("loss/ratio_max", st.ratio_max)
        if a.policy_loss == "decoupled":
            m.add("staleness/is_truncated_frac", st.is_truncated_frac, w)
            m.add("staleness/is_masked_frac", st.is_masked_frac, w)
        if self.critic is not None:
            values = response_values(self.critic.forward, mb)
            vloss, vst = value_loss(values, mb.token_extras["old_values"], mb.token_extras["returns"], mask,
                                    clip_eps=a.value_clip, agg_mode=a.agg_mode, norm_len=norm_len)
            self.critic.backward(vloss * share)
            m.add("loss/value", vst.loss, count)
            m.add("loss/value_clip_frac", vst.clip_frac, w)
            m.add("loss/value_mean", vst.value_mean, w)
            m.add("loss/explained_variance", vst.explained_variance, count)

    def _dpo_update(self, batch: TrainBatch, rewards: torch.Tensor, version: int, m: MetricSums) -> tuple[int, float]:
        """Online DPO: best vs worst response of each group against the reference policy, among
        the responses with a token in the loss mask (``algo.overlong=mask``: those that finished).
        Returns the optimizer steps and the tokens trained: the pairs' rows', once per epoch."""
        a, lc = self.algo, self.lcfg
        t0 = time.perf_counter()
        chosen, rejected = batch_adv.dpo_pairs(rewards, batch.group_sizes, eligible=self.loss_mask(batch).any(-1))
        n_pairs = int(chosen.shape[0])
        m.set("loss/dpo_pairs", n_pairs)
        if n_pairs == 0:  # every group tied: nothing to prefer, no step (the version still advances)
            m.set("learner/time_prepare_s", time.perf_counter() - t0)
            return 0, 0.0
        pair_rows, fillers = self._shard(n_pairs)
        rows = [int(x) for p in pair_rows for x in (chosen[p], rejected[p])]
        local = batch.select(rows, drop=[f for f in fillers for _ in (0, 1)])
        # A token that top-k/top-p filters out under the reference (or, below, the policy) has
        # log-prob -inf: it leaves both sums of its response, so each log-ratio spans the same tokens
        ref = self._reference_logprobs(local)
        local = local.with_extras(dpo_ref=ref, dpo_mask=local.policy_mask & torch.isfinite(ref))
        m.set("learner/time_prepare_s", time.perf_counter() - t0)

        t1 = time.perf_counter()
        n_local = len(pair_rows)
        valid_pair = torch.tensor([not f for f in fillers], dtype=torch.bool)
        pairs_per_micro = max(1, lc.micro_batch_size // 2)
        lengths = local.lengths.view(-1, 2).sum(-1).cpu()
        steps = 0
        self.engine.train(True)
        for epoch in range(lc.ppo_epochs):
            parts = self._minibatches(n_local, version, epoch)
            denoms = torch.tensor([float(valid_pair[p].sum()) for p in parts], dtype=torch.float64)
            all_reduce_sum(denoms)
            plan = []  # (micro-batch, its valid pairs) of each part, cut before the first forward (as in _ppo_update)
            for part in parts:
                part = part[torch.argsort(lengths[part], descending=True, stable=True)]
                pairs = [part[i : i + pairs_per_micro] for i in range(0, len(part), pairs_per_micro)]
                plan.append([(local.select([r for p in pp.tolist() for r in (2 * p, 2 * p + 1)]), valid_pair[pp].to(self.device))
                             for pp in pairs])
            for micro, denom in zip(plan, denoms.tolist()):
                for mb, v in micro:
                    logp, _ = self._logp_entropy(self.engine.forward, mb, False)
                    ok = mb.token_extras["dpo_mask"] & torch.isfinite(logp.detach())
                    sums = masked_sum(logp, ok, dim=-1)
                    rs = masked_sum(mb.token_extras["dpo_ref"], ok, dim=-1)
                    loss, st = dpo_loss(sums[0::2], sums[1::2], rs[0::2], rs[1::2], beta=a.dpo_beta,
                                        label_smoothing=a.dpo_label_smoothing, valid=v)
                    count = v.sum()
                    share = count * (self.engine.world_size / denom) if denom > 0 else 0.0
                    self.engine.backward(loss * share)
                    m.add("loss/dpo", st.loss, count)
                    m.add("loss/dpo_accuracy", st.reward_accuracy, count)
                    m.add("loss/dpo_margin", st.reward_margin, count)
                norm = self.engine.step()
                m.add("learner/grad_norm", norm)
                m.add_max("learner/grad_norm_max", norm)
                steps += 1
        m.set("learner/time_train_s", time.perf_counter() - t1)
        return steps, float(batch.attention_mask[torch.cat([chosen, rejected])].sum()) * lc.ppo_epochs

    # ------------------------------------------------------------------ metrics
    def _batch_metrics(self, batch: TrainBatch, samples: Sequence[Sample], version: int, m: MetricSums) -> None:
        """Statistics of the whole batch; every rank computes them identically."""
        r = batch.rewards.double()
        m.set(M.REWARD_MEAN, r.mean())
        m.set("reward/std", r.std(unbiased=False))
        m.set("reward/min", r.min())
        m.set("reward/max", r.max())
        comps: dict[str, list[float]] = {}
        for s in sorted(samples, key=lambda s: (s.group_id, s.group_index)):  # the batch's order: sums repeat
            for k, v in s.reward_components.items():
                comps.setdefault(k, []).append(v)
        for k, vals in sorted(comps.items()):
            m.set(f"reward/{k}", sum(vals) / len(vals))
        m.set(M.PROMPT_LEN_MEAN, batch.response_start.double().mean())
        m.set("reward/response_len_mean", batch.response_lengths.double().mean())
        m.set("reward/truncated_frac", batch.truncated.double().mean())
        if any(s.loss_mask is not None for s in samples):  # multi-turn episodes
            m.set("reward/policy_len_mean", batch.policy_lengths.double().mean())
            m.set("learner/policy_token_frac", batch.policy_mask.sum().double() / batch.response_mask.sum().clamp(min=1))
            m.set("reward/turns_mean", sum(float(s.metadata.get("turns", 0)) for s in samples) / len(samples))
        stale = torch.tensor([version - s.oldest_version for s in samples], dtype=torch.float64)
        m.set("staleness/min", stale.min())
        m.set(M.STALENESS_MEAN, stale.mean())
        m.set(M.STALENESS_MAX, stale.max())
        tok = (version - batch.token_versions).double()
        m.set("staleness/token_mean", masked_mean(tok, batch.policy_mask))
        m.set(M.NUM_SAMPLES, batch.num_rows)
        m.set(M.NUM_TOKENS, batch.policy_mask.sum())
        m.set("learner/num_groups", batch.num_groups)
        m.set("learner/partial_groups", (batch.group_sizes < self.algo.group_size).sum())

    def _staleness_metrics(self, local: TrainBatch, prox: torch.Tensor, mask: torch.Tensor, m: MetricSums) -> None:
        """Behaviour vs proximal policy: the IS weight pi_prox / mu and KL(mu || pi_prox) (k3)."""
        log_w = torch.where(mask, prox - local.behaviour_logprobs, torch.zeros_like(prox))
        w = torch.exp(log_w)
        n = mask.sum()
        m.add("staleness/is_weight_mean", masked_mean(w, mask), n)
        m.add_max("staleness/is_weight_max", masked_max(w, mask))
        m.add("staleness/behav_prox_kl", masked_mean(w - 1.0 - log_w, mask), n)
