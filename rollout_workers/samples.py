"""On the scoring threads: each finished response scored, then its :class:`~rlhf_core.records.Sample`
built once, with its reward (and reference log-probs when ``rollout.ref_logprobs_on=worker``). A
response that cannot be scored becomes a sample with reward NaN and the reason, for the dead-letter
stream. An episode is one sample: its environment's reward (component ``env``) plus the run's rewards.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from rlhf_core.config import ENV_COMPONENT
from rlhf_core.records import Sample, rle_encode
from rlhf_core.sampling import response_logprobs
from rollout_workers.engine import GenResult, SamplingParams
from rollout_workers.episodes import Episode
from rollout_workers.groups import Member, Outcome
from rollout_workers.rewards import CallWatch, RewardError, ScoreItem, Scorer

Score = tuple[float, dict[str, float]] | RewardError


class SampleScorer:
    """``score`` is the scoring threads' job; ``timed_out`` the outcome of a response whose reward
    call was abandoned. ``env_path``: the environment's, when episodes are scored."""

    def __init__(self, scorer: Scorer, tokenizer: Any, reference: torch.nn.Module | None, sampling: SamplingParams,
                 worker_id: str, env_path: str | None) -> None:
        self.scorer, self.tokenizer, self.reference, self.sampling = scorer, tokenizer, reference, sampling
        self.worker_id, self.env_path = worker_id, env_path

    def score(self, members: list[Member], watch: CallWatch) -> list[Outcome]:
        """One batch of finished responses (whole groups, in order): an outcome for each."""
        scores = self._episode_scores(members, watch) if self.env_path else self._response_scores(members, watch)
        return [self._outcome(m, s) for m, s in zip(members, scores)]

    def timed_out(self, member: Member, reason: str) -> Outcome:
        """Runs on the main thread."""
        return self._outcome(member, RewardError(reason))

    def _response_scores(self, members: list[Member], watch: CallWatch) -> list[Score]:
        results: list[GenResult] = []
        for m in members:
            assert isinstance(m.result, GenResult)  # no environment: each response is one generation
            results.append(m.result)
        items = [ScoreItem.of(m.group.lease.prompt, m.group.prompt_text, r.text, r.token_ids.tolist())
                 for m, r in zip(members, results)]
        scores = self.scorer.score_batch(items, watch)
        return [RewardError("response has no tokens") if r.num_tokens == 0 else s for r, s in zip(results, scores)]

    def _episode_scores(self, members: list[Member], watch: CallWatch) -> list[Score]:
        episodes: list[Episode] = []
        for m in members:
            assert isinstance(m.result, Episode)  # an environment: each response is an episode
            episodes.append(m.result)
        rewarded = bool(self.scorer.functions or self.scorer.models)
        live = [i for i, ep in enumerate(episodes) if ep.error is None]
        scores: dict[int, Score] = {i: (0.0, {}) for i in live}
        if rewarded:
            items = []
            for i in live:
                ep, prompt = episodes[i], members[i].group.lease.prompt
                assert ep.transcript is not None
                text = self.tokenizer.decode(ep.transcript.response_ids, skip_special_tokens=True)
                meta = {**prompt.metadata, "turns": [t.text for t in ep.turns], "env_reward": ep.env_reward}
                items.append(ScoreItem(ep.prompt_text, text, list(ep.transcript.response_ids), meta,
                                       ep.prompt_messages, ep.messages, raw_prompt=prompt.text))
            scores.update(zip(live, self.scorer.score_batch(items, watch)))
        out: list[Score] = []
        for i, ep in enumerate(episodes):
            score: Score
            if ep.error is not None:
                score = RewardError(ep.error)
            elif ep.env_reward is None and not rewarded:
                score = RewardError(f"the episode ended ({ep.finish_reason}) without a reward: environment "
                                    f"{self.env_path} returned none from step() and no reward function is "
                                    "configured; return one when done, or set reward.functions")
            elif ep.transcript is None or ep.transcript.num_policy_tokens == 0:
                score = RewardError("the episode has no token the policy sampled")
            else:
                score = scores[i]  # a live episode: scored above, or (0.0, {}) when only its environment rewards
                if ep.env_reward is not None and not isinstance(score, RewardError):
                    total, parts = score
                    score = total + ep.env_reward, {**parts, ENV_COMPONENT: ep.env_reward}
            out.append(score)
        return out

    def _outcome(self, member: Member, score: Score) -> Outcome:
        if isinstance(score, RewardError):
            return Outcome(self._sample(member, float("nan"), {}, scored=False), str(score))
        reward, parts = score
        return Outcome(self._sample(member, reward, parts, scored=True))

    def _sample(self, member: Member, reward: float, parts: dict[str, float], scored: bool) -> Sample:
        """The response's sample; with reference log-probs when ``scored`` and a reference is loaded."""
        group, result, prompt = member.group, member.result, member.group.lease.prompt
        reference = self.reference if scored else None
        common: dict[str, Any] = dict(
            sample_id=f"{group.group_id}/{member.index}", prompt_id=prompt.prompt_id, group_id=group.group_id,
            reward=reward, reward_components=parts, worker_id=self.worker_id, group_size=group.size,
            group_index=member.index, created_at=group.created_at, finished_at=time.time(),
            metadata={"prompt_epoch": prompt.epoch, "prompt_index": prompt.index})
        if not isinstance(result, Episode):
            return Sample(prompt_ids=np.asarray(group.prompt_ids, dtype=np.int32), response_ids=result.token_ids,
                          behaviour_logprobs=result.logprobs, versions=rle_encode(result.versions.tolist()),
                          finish_reason=result.finish_reason,
                          ref_logprobs=self._ref_logprobs(reference, group.prompt_ids, result.token_ids)
                          if reference is not None else None,
                          **common)
        # an episode: its transcript, policy tokens as sampled (loss mask 0 elsewhere)
        common.update(finish_reason=result.finish_reason or "abort",
                      metadata={**common["metadata"], "turns": len(result.turns),
                                "retokenisation_drift": result.drift_turns})
        t = result.transcript
        if t is None:  # failed before its first turn: an empty record for the dead letter
            return Sample(prompt_ids=np.zeros(0, dtype=np.int32), response_ids=np.zeros(0, dtype=np.int32),
                          behaviour_logprobs=np.zeros(0, dtype=np.float32), versions=[], **common)
        return t.to_sample(ref_logprobs=self._ref_logprobs(reference, t.prompt_ids, t.response_ids)
                           if reference is not None else None, **common)

    @torch.no_grad()
    def _ref_logprobs(self, reference: torch.nn.Module, prompt_ids: Sequence[int] | np.ndarray,
                      response_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """``[R]`` reference log-probs under the same processed distribution the learner uses for KL."""
        device = next(reference.parameters()).device
        ids = torch.tensor([[int(t) for t in prompt_ids] + [int(t) for t in response_ids]], device=device)
        logits = reference(input_ids=ids).logits[:, len(prompt_ids) - 1 : -1]
        sp = self.sampling
        lp = response_logprobs(logits, ids[:, len(prompt_ids):], sp.temperature, sp.top_k, sp.top_p)
        return lp[0].float().cpu().numpy()
