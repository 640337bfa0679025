"""Group assembly's records: each response's sample built once with its reward (or NaN and the
reason, for the dead-letter stream), and the rate-limited logging of dead-letter reasons."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import torch

from buffer import Lease
from rlhf_core.config import ENV_COMPONENT
from rlhf_core.episode import Transcript
from rlhf_core.records import Prompt, Sample
from rollout_workers.engine import SamplingParams, make_result
from rollout_workers.episodes import Episode
from rollout_workers.groups import Group, Member, ReasonLog
from rollout_workers.rewards import RewardError
from rollout_workers.samples import SampleScorer


class FixedScores:
    """A Scorer whose answers are given: one per item, in order."""

    functions, models = ["fixed"], []

    def __init__(self, answers: list) -> None:
        self.answers, self.items = answers, []

    def score_batch(self, items, watch=None):
        self.items.extend(items)
        return self.answers[: len(items)]


def whole_group(texts: list[str]) -> Group:
    lease = Lease(Prompt("p-1", "7:", epoch=2, index=5), "1-0", "w", 1)
    group = Group(lease, "7:", [55, 58], len(texts))
    for i, text in enumerate(texts):
        ids = [56 + j for j in range(len(text))]
        group.results[i] = make_result(f"1-0/{i}", [55, 58], ids, [-0.5] * len(ids), [3] * len(ids), "stop", text)
    return group


def test_each_response_is_one_sample_built_with_its_reward_or_nan_and_the_reason():
    group = whole_group(["890", "8", ""])
    scores = FixedScores([(0.75, {"fixed": 0.75}), RewardError("reward function 'fixed' raised ValueError"), (0.0, {})])
    outcomes = SampleScorer(scores, None, None, SamplingParams(), "w", None).score(group.members(), watch=None)
    scored, failed, empty = outcomes
    assert scored.dead_letter is None and isinstance(scored.sample, Sample)
    s = scored.sample
    assert (s.sample_id, s.group_id, s.group_index, s.group_size) == ("p-1:e2:1-0/0", "p-1:e2:1-0", 0, 3)
    assert (s.reward, s.reward_components, s.versions, s.metadata) == (
        0.75, {"fixed": 0.75}, [[3, 3]], {"prompt_epoch": 2, "prompt_index": 5})
    assert s.prompt_ids.tolist() == [55, 58] and s.response_ids.tolist() == [56, 57, 58] and s.finished_at > 0
    assert failed.dead_letter == "reward function 'fixed' raised ValueError" and math.isnan(failed.sample.reward)
    # a response without tokens is dead-lettered whatever its score
    assert empty.dead_letter == "response has no tokens" and math.isnan(empty.sample.reward)
    assert [it.response_text for it in scores.items] == ["890", "8", ""]


def test_a_timed_out_response_is_its_sample_with_nan_and_the_reason():
    group = whole_group(["890"])
    out = SampleScorer(FixedScores([]), None, None, SamplingParams(), "w", None).timed_out(Member(group, 0), "too slow")
    assert out.dead_letter == "too slow" and math.isnan(out.sample.reward) and out.sample.reward_components == {}
    assert np.array_equal(out.sample.response_ids, group.results[0].token_ids)


def test_group_splits_its_outcomes_in_response_order():
    group = whole_group(["890", "8", "9"])
    outcomes = SampleScorer(FixedScores([(1.0, {}), RewardError("bad"), (0.5, {})]), None, None, SamplingParams(),
                            "w", None).score(group.members(), watch=None)
    for i in (2, 0, 1):  # collected in any order
        group.outcomes[i] = outcomes[i]
    assert [s.group_index for s in group.samples()] == [0, 2]
    assert [(o.sample.group_index, o.reason) for o in group.dead_letters()] == [(1, "bad")]


class UniformReference(torch.nn.Module):
    """Logits all 0 over 64 tokens: every reference log-prob is -log 64."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids):
        return SimpleNamespace(logits=torch.zeros(*input_ids.shape, 64))


def test_an_episode_is_one_sample_with_its_environment_reward_added_and_reference_logprobs():
    lease = Lease(Prompt("p-1", "7:"), "1-0", "w", 1)
    group = Group(lease, "7:", [], 2)
    t = Transcript([55, 58])
    t.add_policy([56, 57], [-0.5, -0.25], [3, 3])
    t.add_observation([9])
    t.add_policy([59], [-1.0], [4])
    group.results[0] = Episode("1-0/0", lease.prompt, transcript=t, env_reward=0.5, finish_reason="stop")
    group.results[1] = Episode("1-0/1", lease.prompt, error="the environment raised")
    scores = FixedScores([(0.25, {"fixed": 0.25})])
    tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens: "".join(map(str, ids)))
    ok, failed = SampleScorer(scores, tokenizer, UniformReference(), SamplingParams(), "w", "my.Env").score(
        group.members(), watch=None)
    s = ok.sample
    # 0.25 from the function + 0.5 from the environment
    assert ok.dead_letter is None and (s.reward, s.reward_components) == (0.75, {"fixed": 0.25, ENV_COMPONENT: 0.5})
    assert s.loss_mask.tolist() == [1, 1, 0, 1] and s.versions == [[3, 3], [4, 1]]
    assert np.allclose(s.ref_logprobs, [-math.log(64)] * 4) and s.metadata["turns"] == 0
    assert [it.response_text for it in scores.items] == ["5657959"]  # the failed episode is not scored
    assert failed.dead_letter == "the environment raised" and math.isnan(failed.sample.reward)
    assert failed.sample.num_response_tokens == 0 and failed.sample.ref_logprobs is None


def test_the_counts_behind_rate_limited_dead_letter_logging_stay_bounded(caplog):
    # Dead letters are logged the first time and every 100th time for each reason, counted in a
    # dict by reason; the prompt's reasons name the prompt (and the engine's its request), so
    # the dict grew by one entry per dead-lettered prompt for the whole run, and every one was
    # logged. They are counted by kind now: the reason without its quoted names and numbers.
    reasons = ReasonLog("w-reasons")
    n = 5000
    with caplog.at_level("WARNING", logger="rollout_workers.groups"):
        for i in range(n):
            reasons.warn("a sample of prompt", f"p-{i}", f"prompt 'p-{i}' has {20 + i % 7} tokens, more than "
                                                         "rollout.max_prompt_tokens=8")
    assert len(reasons.seen) == 1
    lines = [r.getMessage() for r in caplog.records if "dead-lettered" in r.getMessage()]
    assert len(lines) == 51  # the 1st, then every 100th of the kind: 100, 200, ..., 5000
    assert "prompt p-0 dead-lettered (1 time(s) for this reason): prompt 'p-0' has 20 tokens" in lines[0]
