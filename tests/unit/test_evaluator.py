"""The evaluator's arithmetic: unbiased pass@k (Chen et al. 2021) and the per-evaluation
metrics, written out by hand; and the settings it refuses."""

from __future__ import annotations

import math

import pytest

from rlhf_core.config import ConfigError, EvalConfig
from rollout_workers.evaluator import eval_metrics, pass_at_k


def test_pass_at_k_by_hand():
    # n=4 samples, c=1 passes, k=1: 1 - C(3,1)/C(4,1) = 1 - 3/4 = 0.25 (the pass rate itself)
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    # k=2: 1 - C(3,2)/C(4,2) = 1 - 3/6 = 0.5
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    # c=2, k=2: 1 - C(2,2)/C(4,2) = 1 - 1/6
    assert pass_at_k(4, 2, 2) == pytest.approx(5 / 6)
    # n - c < k: every draw of k holds a pass
    assert pass_at_k(4, 3, 2) == 1.0 and pass_at_k(4, 4, 4) == 1.0
    # no pass at all: 0 whatever k
    assert pass_at_k(4, 0, 4) == 0.0
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(4, 1, 5)


def test_eval_metrics_average_over_prompts():
    # prompt a: rewards [1, 0, 0, 0] -> 1 pass of 4; prompt b: [1, 1, 0.5, 0] -> 2 passes (threshold 1)
    m = eval_metrics([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.5, 0.0]], ks=[1, 2], threshold=1.0)
    # mean reward: (1 + 0 + 0 + 0 + 1 + 1 + 0.5 + 0) / 8 = 3.5 / 8
    assert m["eval/reward_mean"] == pytest.approx(3.5 / 8)
    # pass@1: (1/4 + 2/4) / 2 = 0.375; pass@2: ((1 - 3/6) + (1 - 1/6)) / 2 = (0.5 + 5/6) / 2
    assert m["eval/pass@1"] == pytest.approx(0.375)
    assert m["eval/pass@2"] == pytest.approx((0.5 + 5 / 6) / 2)
    # a prompt with fewer scored samples than k (a reward failed) is left out of that pass@k only
    m = eval_metrics([[1.0], [0.0, 1.0]], ks=[1, 2], threshold=1.0)
    assert m["eval/pass@1"] == pytest.approx((1.0 + 0.5) / 2) and m["eval/pass@2"] == pytest.approx(1.0)
    assert math.isnan(eval_metrics([], ks=[1], threshold=1.0)["eval/reward_mean"])


@pytest.mark.parametrize("changes, message", [
    ({"every": -1}, "eval.every must be >= 0"),
    ({"every": 10, "n": 2, "k": [1, 4]}, r"eval.k=\[1, 4\] needs each k between 1 and eval.n=2"),
    ({"every": 10, "k": []}, "needs each k between 1 and eval.n"),
    ({"every": 10, "num_prompts": 0}, "eval.num_prompts must be >= 1"),
    ({"every": 10, "temperature": 0.0}, "eval.temperature must be > 0"),
])
def test_settings_it_refuses(changes, message):
    with pytest.raises(ConfigError, match=message):
        EvalConfig(**changes).check()
    EvalConfig(every=0, n=1, k=[4]).check()  # off: nothing else is checked


def test_a_held_out_file_needs_its_path():
    ev = EvalConfig(every=5)
    ev.data.source = "jsonl"
    with pytest.raises(ConfigError, match="eval.data.source=jsonl needs eval.data.path"):
        ev.check()
