"""The body every policy-gradient family shares (grpo, dr_grpo, rloo, reinforce_pp, gae): its
own advantages (with a teacher, ``distill.teacher.path``, beside the teacher's per-token ones:
:mod:`learner.algorithms.distill`), then the configured policy loss (``algo.policy_loss``) with
the entropy bonus, the KL to the reference and, with a critic, the value loss.

The loss mask of every loss, KL, entropy, advantage and statistic is ``TrainBatch.policy_mask``
(the tokens the policy sampled: a multi-turn episode's observations are out), AND finite
log-probs, AND (``algo.overlong=mask``) not a truncated response. It is fixed before training;
a token that the weights of a later optimizer step filter out (top-k/top-p: log-prob -inf) adds
no KL and no ``approx_kl`` (``loss/filtered_out_frac`` counts them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from learner.algorithms import Work, distill
from learner.algorithms.core import (
    AllReduce,
    aggregate,
    entropy_bonus,
    global_whiten,
    kl_estimate,
    masked_max,
    masked_mean,
)
from learner.algorithms.mismatch import mismatch_metrics
from learner.batch import TrainBatch
from learner.engines import all_reduce_sum
from rlhf_core.config import AlgoConfig, response_budget

if TYPE_CHECKING:
    from learner.algorithms import Updater
    from learner.stats import MetricSums


@dataclass
class AdvantageInputs:
    """What a family's advantages are computed from, for this rank's rows."""

    rewards: torch.Tensor  # [B] the whole batch's (shaped, normalised) sequence rewards, groups contiguous
    group_sizes: torch.Tensor  # [G]
    rows: torch.Tensor  # [b] this rank's rows of the batch (data-parallel fillers repeat row 0)
    mask: torch.Tensor  # [b, T] the loss mask
    kl: torch.Tensor | None = None  # [b, T] KL(pi_prox || ref) as a reward penalty (algo.kl_mode=reward)
    values: torch.Tensor | None = None  # [b, T] critic values before the update
    behav: torch.Tensor | None = None  # [b, T] behaviour log-probs
    prox: torch.Tensor | None = None  # [b, T] proximal log-probs
    all_reduce: AllReduce = all_reduce_sum  # statistics over every rank (whitening)


#: a family's advantages: ``[b, T]`` advantages and ``[b, T]`` critic targets (None without a critic)
AdvantageFn = Callable[[AlgoConfig, AdvantageInputs], tuple[torch.Tensor, "torch.Tensor | None"]]
ValueLossFn = Callable[..., tuple[torch.Tensor, Any]]


class PolicyGradient:
    """A family trained by the policy loss on per-token advantages from ``advantages``; with
    ``value_loss`` a critic trains beside the policy on the returns the advantages come with."""

    needs_reference = False
    proximal = True

    def __init__(self, advantages: AdvantageFn, *, value_loss: ValueLossFn | None = None, whitens: bool = False) -> None:
        self.advantages, self.value_loss = advantages, value_loss
        self.whitens = whitens  # its advantages come whitened: algo.normalize_advantages does not apply
        self.needs_critic = value_loss is not None

    def normalized_advantages(self, algo: AlgoConfig, x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The family's advantages, whitened over the real tokens of every rank with
        ``algo.normalize_advantages``, and its critic targets."""
        adv, returns = self.advantages(algo, x)
        if algo.normalize_advantages and not self.whitens:
            adv = global_whiten(adv, x.mask, x.all_reduce)
        return adv, returns

    def prepare(self, up: Updater, batch: TrainBatch, rewards: torch.Tensor, m: MetricSums) -> Work:
        """pi_prox (or none: read off the training pass), reference log-probs, critic values, the
        loss mask, then the advantages, for this rank's rows."""
        a = up.algo
        rows, fillers = up.passes.shard(batch.num_rows)
        local = batch.select(rows, drop=fillers)
        # None: read off the training pass (see learner.update.prox_is_training_pass)
        prox = None if up.prox_from_training_pass else up.passes.proximal_logprobs(local)
        m.set("learner/prox_pass", float(prox is not None))
        need_ref = a.kl_coef > 0
        ref = up.passes.reference_logprobs(local) if need_ref else None
        teacher = distill.teacher_logprobs(up, local, m)  # None without distill.teacher.path
        # A token that top-k/top-p now filters out has log-prob -inf under pi_prox (or the
        # reference, or the teacher): no ratio exists for it, so it leaves the loss (counted in a metric).
        finite = torch.isfinite(local.behaviour_logprobs)
        if prox is not None:
            finite &= torch.isfinite(prox)
        if teacher is not None:
            finite &= torch.isfinite(teacher)
        if ref is not None:
            finite &= torch.isfinite(ref)
            ref = torch.where(finite, ref, torch.zeros_like(ref))
        mask = up.passes.loss_mask(local) & finite
        if prox is not None:
            prox = torch.where(mask, prox, torch.zeros_like(prox))
        old_values = up.passes.critic_values(local) if self.needs_critic else None
        kl = None
        if need_ref and a.kl_mode == "reward":
            assert prox is not None and ref is not None  # KL in the reward: pi_prox is never the training pass
            kl = kl_estimate(prox, ref, mask, kind=a.kl_estimator)
        adv, returns = self.normalized_advantages(a, AdvantageInputs(
            rewards, batch.group_sizes, torch.tensor(rows, device=up.device), mask, kl=kl, values=old_values,
            behav=local.behaviour_logprobs, prox=prox))
        if teacher is not None:  # on-policy distillation: the teacher's per-token advantage beside (or instead of) the rewards'
            adv = distill.add_teacher_advantages(up, adv, teacher, local, mask, m)
        if prox is not None:
            staleness_metrics(local, prox, mask, m)
            mismatch_metrics(local, prox, mask, up.version, m)
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
            assert returns is not None  # an estimator with values returns their targets
            extras.update(old_values=old_values, returns=returns)
        # a minibatch's denominator: its tokens (token-mean) or its sequences with a token (seq-* modes)
        weights = mask.sum(-1).double() if a.agg_mode == "token-mean" else (mask.sum(-1) > 0).double()
        return Work(local.with_extras(**extras), weights, float(batch.attention_mask.sum()))

    def loss(self, up: Updater, mb: TrainBatch, denom: float, m: MetricSums) -> None:
        a = up.algo
        mask = mb.token_extras["loss_mask"] > 0
        # counts stay on the device (no host sync inside the micro-batch loop)
        w = mask.sum()
        count = w if a.agg_mode == "token-mean" else (mask.sum(-1) > 0).sum()
        # DeepSpeed averages gradients over ranks; the share is of the global minibatch, so x W.
        share = count * (up.engine.world_size / denom) if denom > 0 else 0.0
        norm_len = response_budget(up.rollout)
        logp, entropy = up.passes.logprobs(mb, entropy=True)
        assert entropy is not None  # asked for
        # The mask was fixed before training: from the update's second optimizer step on, a token
        # can leave these weights' top-k/nucleus (log-prob -inf). It has no KL (k3 would be
        # inf - inf = nan); it stays in the denominators, as every masked-out token's 0 does.
        live = mask & torch.isfinite(logp.detach())
        m.add("loss/filtered_out_frac", masked_mean((~live).float(), mask), w)
        adv = mb.token_extras["adv"]
        prox = mb.token_extras.get("prox")
        if prox is None:  # the weights before the update are these: pi_prox is this pass, detached
            prox = torch.where(mask, logp.detach(), torch.zeros_like(logp))
            staleness_metrics(mb, prox, mask, m)
            mismatch_metrics(mb, prox, mask, up.version, m)
        loss, st = up.policy_loss.fn(logp, prox, mb.behaviour_logprobs, adv, mask, clip_eps_low=a.clip_eps_low,
                                     clip_eps_high=a.clip_eps_high, dual_clip_c=a.dual_clip_c, agg_mode=a.agg_mode,
                                     norm_len=norm_len, is_config=up.is_config)
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
        up.engine.backward(total * share)
        m.add("loss/policy", st.loss, count)
        m.add("loss/total", total.detach(), count)
        m.add("loss/entropy", ent.entropy, count)
        for key in ("clip_frac", "dual_clip_frac", "approx_kl", "ratio_mean"):
            m.add(f"loss/{key}", getattr(st, key), w)
        m.add_max("loss/ratio_max", st.ratio_max)
        if up.policy_loss.importance_sampling:
            m.add("staleness/is_truncated_frac", st.is_truncated_frac, w)
            m.add("staleness/is_masked_frac", st.is_masked_frac, w)
        if self.value_loss is not None:
            values = up.passes.values(mb)
            vloss, vst = self.value_loss(values, mb.token_extras["old_values"], mb.token_extras["returns"], mask,
                                         clip_eps=a.value_clip, agg_mode=a.agg_mode, norm_len=norm_len)
            assert up.critic is not None  # a value loss comes with a critic (PolicyUpdater checks it)
            up.critic.backward(vloss * share)
            m.add("loss/value", vst.loss, count)
            m.add("loss/value_clip_frac", vst.clip_frac, w)
            m.add("loss/value_mean", vst.value_mean, w)
            m.add("loss/explained_variance", vst.explained_variance, count)


def staleness_metrics(local: TrainBatch, prox: torch.Tensor, mask: torch.Tensor, m: MetricSums) -> None:
    """Behaviour vs proximal policy: the IS weight pi_prox / mu and KL(mu || pi_prox) (k3)."""
    log_w = torch.where(mask, prox - local.behaviour_logprobs, torch.zeros_like(prox))
    w = torch.exp(log_w)
    n = mask.sum()
    m.add("staleness/is_weight_mean", masked_mean(w, mask), n)
    m.add_max("staleness/is_weight_max", masked_max(w, mask))
    m.add("staleness/behav_prox_kl", masked_mean(w - 1.0 - log_w, mask), n)
