"""learner.reporting.MismatchWarning: when the lag-0 train/rollout mismatch warns, how often, and
what it names. A clock of the test's own stands in for time (the window is minutes)."""

from __future__ import annotations

import logging

import pytest

from learner.reporting import MISMATCH_WARN_EVERY_S, MismatchWarning
from rlhf_core import metric_names as M
from rlhf_core.config import Config

KL, TOKENS = M.mismatch_key(M.MISMATCH_LAG0, "kl_k3"), M.mismatch_key(M.MISMATCH_LAG0, "tokens")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def row(kl: float, tokens: float = 40.0) -> dict[str, float]:
    return {KL: kl, TOKENS: tokens, M.mismatch_key(M.MISMATCH_LAG0, "abs_mean"): 0.01,
            M.mismatch_key(M.MISMATCH_LAG0, "abs_max"): 0.2}


def test_the_first_excess_warns_then_one_a_window_with_the_count_between(caplog):
    clock = Clock()
    w = MismatchWarning(Config(), clock=clock)  # algo.mismatch_warn 1e-8
    with caplog.at_level(logging.WARNING, logger="learner.reporting"):
        assert not w.check(row(1e-9))  # under the limit
        assert w.check(row(3e-4))  # the first over it: at once
        assert "is 0.0003 per token (k3; |dlogp| mean 0.01, max 0.2) over algo.mismatch_warn=1e-08 in 1 update(s)" \
            in caplog.records[-1].getMessage()
        clock.now += MISMATCH_WARN_EVERY_S - 1
        assert not w.check(row(2e-4)) and not w.check(row(1e-9)) and not w.check(row(5e-4))  # two over, within the window
        clock.now += 1
        assert w.check(row(4e-4))  # the window is over: the third since the last warning
        assert len(caplog.records) == 2 and "in 3 update(s) since the last warning" in caplog.records[-1].getMessage()


@pytest.mark.parametrize("metrics", [{}, row(1.0, tokens=0.0), row(float("nan"))],
                         ids=["not reported (dpo)", "no lag-0 token", "nan"])
def test_no_warning_without_lag_0_tokens_or_a_number(metrics):
    assert not MismatchWarning(Config()).check(metrics)


def test_the_warning_names_both_sides_engines_and_dtypes(caplog):
    cfg = Config()
    cfg.rollout.engine, cfg.model.dtype = "vllm", "bfloat16"
    cfg.learner.publish_dtype, cfg.learner.bf16 = "bfloat16", True
    cfg.algo.mismatch_warn = 1e-3
    with caplog.at_level(logging.WARNING, logger="learner.reporting"):
        assert MismatchWarning(cfg).check(row(2e-3))
    text = caplog.records[-1].getMessage()
    assert "(the workers' rollout.engine=vllm in model.dtype=bfloat16, weights sent as bfloat16; the learner in " \
           "model.dtype=bfloat16 with learner.bf16)" in text
    assert "over algo.mismatch_warn=0.001" in text and "\n" not in text
