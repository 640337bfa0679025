"""reward=math: where an answer is read, what the reference is, worked equivalences (plain
numbers compared exactly, the rest by math-verify in its own process), answers that score 0
with a counted reason, and a verifier that hangs (the child killed, the next answer scored)."""

from __future__ import annotations

import time
from fractions import Fraction

import psutil
import pytest

from rlhf_core.choices import AnswerExtract
from rlhf_core.config import ConfigError, RewardConfig
from rollout_workers.math_reward import MathReward, extract_answer, field_value, plain_number, reference_answer
from rollout_workers.rewards import RewardError, Scorer

pytest.importorskip("math_verify", reason="reward=math needs math-verify: pip install 'rlhf-service[math]'")


@pytest.fixture(scope="module")
def reward():
    r = MathReward()
    yield r
    r.close()


# ---------------------------------------------------------------------------- reading answers


@pytest.mark.parametrize(("text", "answer"), [
    ("so the total is \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
    ("\\boxed{1} then \\boxed{\\{a, b\\}}", "\\{a, b\\}"),  # the LAST box, its braces matched
    ("First 12, then 30.\nThe answer is 42.", "42"),  # answer_is beats the last number... and drops the full stop
    ("Work: 3 + 4 = 7\n#### 7", "7"),  # GSM8K's marker counts as "the answer is"
    ("Final answer: $\\boxed{9}$ apples", "9"),  # a box after "answer:" is read inside
    ("I had 5 apples and ate 2, leaving 3", "3"),  # no box, no phrase: the last number
    ("costs -1,234.50 in all", "-1,234.50"),
    ("nothing here", None),
])
def test_extract_answer_default_order(text, answer):
    assert extract_answer(text) == answer


def test_extract_order_is_configurable():
    text = "The answer is 5. \\boxed{6}"
    assert extract_answer(text) == "6"  # boxed first
    assert extract_answer(text, [AnswerExtract.answer_is]) == "6"  # the phrase's line holds a box: read inside it
    assert extract_answer("12 and 13", [AnswerExtract.boxed]) is None  # strict: no box, no answer


@pytest.mark.parametrize(("value", "gold"), [
    ("Natalia sold 48/2 = 24 clips in May.\nNatalia sold 48+24 = 72 clips.\n#### 72", "72"),  # GSM8K
    ("... so the probability is $\\boxed{\\frac{1}{4}}$.", "\\frac{1}{4}"),  # MATH
    ("1,000", "1,000"),  # ground_truth as it is
    (72, "72"),  # a number column
    (None, None),
    ("#### ", None),  # a marker with nothing after it is no reference
])
def test_reference_answer(value, gold):
    assert reference_answer(value) == gold


def test_nested_reference_field():
    # verl's rows: reward_model: {ground_truth: ...}, which reaches the reward as a JSON string
    columns = {"reward_model": ['{"ground_truth": "7", "style": "rule"}', None]}
    assert field_value(columns, "reward_model.ground_truth", 0) == "7"
    assert field_value(columns, "reward_model.ground_truth", 1) is None
    assert field_value(columns, "absent", 0) is None


@pytest.mark.parametrize(("text", "number"), [
    ("1,000", Fraction(1000)), ("1000", Fraction(1000)), ("$72", Fraction(72)), ("\\$72.", Fraction(72)),
    ("0.5", Fraction(1, 2)), (".50", Fraction(1, 2)), ("-3/4", Fraction(-3, 4)), ("1 000", Fraction(1000)),
    ("\\frac{1}{2}", None), ("x=3", None), ("1,00", None), ("3/0", None), ("", None),
])
def test_plain_number(text, number):
    assert plain_number(text) == number


# ---------------------------------------------------------------------------- worked cases


@pytest.mark.parametrize(("response", "gold", "score"), [
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),  # math-verify: 1/2 == 0.5
    ("The answer is 0.5", "\\frac{1}{2}", 1.0),  # the other way round
    ("The answer is 1,000.", "1000", 1.0),  # plain numbers: commas dropped, compared exactly
    ("The answer is 1000", "1,000", 1.0),
    ("\\boxed{72\\text{ apples}}", "72", 1.0),  # right answer, wrong formatting (units in the box)
    ("So she pays \\$72.00 in all.", "72", 1.0),  # right answer, wrong formatting (currency, decimals, no box)
    ("\\boxed{x = 3}", "3", 1.0),  # an equation whose value is the answer
    ("\\boxed{\\frac{1}{3}}", "0.3", 0.0),  # close is not equal
    ("The answer is 71.", "72", 0.0),
])
def test_worked_cases(reward, response, gold, score):
    assert reward([response], ground_truth=[gold]) == [score]


def test_unparseable_and_missing_answers_score_zero_with_a_counted_reason():
    r = MathReward()
    try:
        out = r(["no number anywhere", "\\boxed{\\frac{}{}}", "\\boxed{" + "x" * 2000 + "}", "\\boxed{3}"],
                ground_truth=["3", "3", "3", "3"])
        assert out == [0.0, 0.0, 0.0, 1.0]
        assert r.counters() == {"no_answer": 1, "unparsed": 2, "correct": 1}
    finally:
        r.close()


def test_a_row_without_a_reference_fails_that_completion_only(reward):
    out = reward(["\\boxed{3}", "\\boxed{3}"], answer=["#### 3", None])
    assert out[0] == 1.0
    assert isinstance(out[1], Exception) and "no reference answer in ground_truth, answer, solution" in str(out[1])


def test_chat_completions_are_read_from_their_last_turn(reward):
    assert reward([[{"role": "assistant", "content": "\\boxed{4}"}]], ground_truth=["4"]) == [1.0]


def test_through_the_scorer_batched_with_the_rows_columns(tiny_model_cfg):
    # conf/reward/math.yaml's node, as a worker builds it; GSM8K's answer column reaches it
    scorer = Scorer(RewardConfig(functions={"math": {"_target_": "rollout_workers.math_reward.MathReward"}}), tiny_model_cfg)
    from rollout_workers.rewards import ScoreItem

    items = [ScoreItem("q", "It is \\boxed{72}", [1], {"answer": "48 + 24 = 72\n#### 72"}),
             ScoreItem("q", "It is 70", [1], {"answer": "#### 72"}),
             ScoreItem("q", "It is 70", [1], {})]
    results = scorer.score_batch(items)
    assert results[0] == (1.0, {"math": 1.0}) and results[1] == (0.0, {"math": 0.0})
    assert isinstance(results[2], RewardError) and "no reference answer" in str(results[2])
    assert scorer.describe() == "math (batched)"
    assert scorer.counters() == {"math/correct": 1, "math/wrong": 1, "math/no_reference": 1}
    scorer.functions[0].fn.close()


# ---------------------------------------------------------------------------- time limits


def test_a_verifier_that_hangs_in_c_is_killed_and_the_next_answer_is_scored():
    # reward_fns.verify_hangs waits with SIGALRM blocked, as C code that never returns to the
    # interpreter does: the child's own timer cannot stop it, so the worker kills the process
    r = MathReward(verifier="reward_fns.verify_hangs", timeout_s=2.0)
    try:
        child = r.pool._all[0].proc
        t0 = time.monotonic()
        out = r(["\\boxed{hang}", "\\boxed{\\frac{2}{4}}"], ground_truth=["\\frac{1}{2}", "\\frac{1}{2}"])
        took = time.monotonic() - t0
        assert out == [0.0, 1.0]  # the hanging answer scores 0, the next one is still verified
        assert r.counters() == {"timeout": 1, "correct": 1}
        assert took < 2.0 + 2.0 + 60  # its limit and the grace, plus starting a fresh child on a loaded machine
        assert not psutil.pid_exists(child.pid) or psutil.Process(child.pid).status() == psutil.STATUS_ZOMBIE
    finally:
        r.close()


def test_a_verifier_that_loops_in_python_times_out_in_its_own_process():
    r = MathReward(verifier="reward_fns.verify_loops", timeout_s=0.5)
    try:
        child = r.pool._all[0].proc
        assert r(["\\boxed{1}", "\\boxed{2}"], ground_truth=["\\frac{1}{1}", "\\frac{1}{1}"]) == [0.0, 0.0]
        assert r.counters() == {"timeout": 2}
        assert r.pool._all[0].proc is child and child.poll() is None  # the timer stopped it: no restart needed
    finally:
        r.close()


def test_configuration_errors_say_what_to_set():
    with pytest.raises(ConfigError, match="may hold only boxed, answer_is, last_number"):
        MathReward(extract=["boxed", "first_number"])
    with pytest.raises(ConfigError, match="timeout_s > 0"):
        MathReward(timeout_s=0)
    with pytest.raises(ConfigError, match="reward.functions.math.verifier='reward_fns.no_such_verifier'"):
        MathReward(verifier="reward_fns.no_such_verifier")
