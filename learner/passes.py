"""What an algorithm asks of the models during an update (``PolicyUpdater.passes``): this rank's
rows of the batch, the tokens that enter the losses, and per-token outputs: log-probs under the
policy (with gradients, for the loss), the reference or the teacher, and the no-grad passes before
training (pi_prox, reference and teacher log-probs, critic values), micro-batched (:mod:`learner.lm_head`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from learner.batch import TrainBatch, micro_batches
from learner.engines import TrainEngine
from learner.lm_head import response_logprobs, response_values
from rlhf_core.config import Config
from rlhf_core.errors import UserError


class MissingReferenceError(UserError):
    """KL or DPO needs reference log-probs that neither the samples nor the learner provide."""


class ModelPasses:
    """The passes of one rank through the policy (``engine``), the frozen reference model
    (``ref_model``, or None), the critic (``critic``, or None) and the frozen teacher of
    ``distill.teacher.path`` (``teacher``, or None)."""

    def __init__(self, cfg: Config, engine: TrainEngine, ref_model: torch.nn.Module | None,
                 critic: TrainEngine | None, teacher: torch.nn.Module | None = None) -> None:
        self.algo, self.lcfg, self.rollout = cfg.algo, cfg.learner, cfg.rollout
        self.engine, self.ref_model, self.critic, self.teacher = engine, ref_model, critic, teacher
        self.device = next(engine.module.parameters()).device

    def loss_mask(self, batch: TrainBatch) -> torch.Tensor:
        """``[B, T]`` tokens that enter the losses: the policy's (``policy_mask``), minus every token
        of a truncated response under ``algo.overlong=mask`` (DAPO's over-long filtering)."""
        mask = batch.policy_mask
        if self.algo.overlong == "mask":
            mask = mask & ~batch.truncated[:, None]
        return mask

    def shard(self, n: int) -> tuple[list[int], list[bool]]:
        """This rank's row indices out of ``n`` (strided), padded with blank fillers to ``ceil(n / W)``."""
        rank, world = self.engine.rank, self.engine.world_size
        rows = list(range(rank, n, world))
        per_rank = -(-n // world)
        fill = per_rank - len(rows)
        return rows + [0] * fill, [False] * len(rows) + [True] * fill

    def logprobs(self, mb: TrainBatch, entropy: bool,
                 frozen: torch.nn.Module | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[b, T]`` log-probs of ``mb``'s responses (and entropies) under the policy (or ``frozen``, a
        plain module: the reference model or the teacher) with the rollout's sampling settings, so
        they compare with the workers' behaviour log-probs (:func:`learner.lm_head.response_logprobs`)."""
        model: torch.nn.Module = self.engine.module
        forward: Callable[..., Any] = self.engine.forward
        if frozen is not None:
            forward = model = frozen
        return response_logprobs(forward, model, mb, self.rollout, chunk_tokens=self.lcfg.logits_chunk_tokens,
                                 entropy=entropy, entropy_grad=bool(self.algo.entropy_coef),
                                 compiled=self.engine.compiled, keep_logits=self.lcfg.keep_head_logits)

    @torch.no_grad()
    def _recompute(self, batch: TrainBatch, per_token: Any) -> torch.Tensor:
        """``[B, T]`` ``per_token(micro-batch)`` (``[b, t]``) without gradients, micro-batched."""
        out = torch.zeros(batch.response_ids.shape, dtype=torch.float32, device=self.device)
        # cut (and the row indices copied to the device) before the first forward, as in training
        plan = [(rows.to(self.device), mb) for rows, mb in micro_batches(batch, self.lcfg.micro_batch_size)]
        for rows, mb in plan:
            x = per_token(mb)
            out[rows, : x.shape[1]] = x.float()
        return torch.where(batch.response_mask, out, torch.zeros_like(out))

    def proximal_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """``[B, T]`` pi_prox: the current weights' log-probs of the sampled tokens, in eval mode."""
        self.engine.train(False)
        return self._recompute(batch, lambda mb: self.logprobs(mb, False)[0])

    def critic_values(self, batch: TrainBatch) -> torch.Tensor:
        """``[B, T]`` the critic's values before the update, in eval mode."""
        critic = self._critic()
        critic.train(False)
        return self._recompute(batch, lambda mb: response_values(critic.forward, mb))

    def values(self, mb: TrainBatch) -> torch.Tensor:
        """``[b, T]`` the critic's values of ``mb``, with gradients (its loss)."""
        return response_values(self._critic().forward, mb)

    def _critic(self) -> TrainEngine:
        assert self.critic is not None  # asked only by an algorithm with a critic (PolicyUpdater checks it has one)
        return self.critic

    def reference_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        if batch.ref_logprobs is not None:
            return batch.ref_logprobs
        if self.ref_model is None:
            raise MissingReferenceError(
                f"algo.kl_coef={self.algo.kl_coef} / algo.estimator={self.algo.estimator} needs reference log-probs, but "
                "the samples carry none and the learner has no reference model: set rollout.ref_logprobs_on=worker "
                "or give the learner a reference model (rlhf_core.models.load_reference)"
            )
        return self._recompute(batch, lambda mb: self.logprobs(mb, False, self.ref_model)[0])

    def teacher_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """``[B, T]`` the teacher's log-probs of the sampled tokens: the rows, loss mask and sampling
        settings of every other pass (:mod:`learner.algorithms.distill`)."""
        assert self.teacher is not None  # asked only when distill.teacher.path loaded one (PolicyGradient.prepare)
        return self._recompute(batch, lambda mb: self.logprobs(mb, False, self.teacher)[0])
