"""Scorer: reward functions by dotted path, tiny reward models from local dirs, weights,
components, and the failures that become one sample's dead letter (RewardError) or a
configuration error at start-up (ConfigError)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from rlhf_core.config import ConfigError, RewardConfig
from rlhf_core.models import build_tiny_model, build_tiny_tokenizer
from rollout_workers.rewards import RewardError, Scorer


def scorer(tiny_model_cfg, functions=None, models=None) -> Scorer:
    return Scorer(RewardConfig(functions=functions or {}, models=models or {}), tiny_model_cfg)


def fn(target: str, **kwargs) -> dict:
    return {"_target_": target, **kwargs}


# ---------------------------------------------------------------------------- functions


def test_function_by_dotted_path_with_kwargs(tiny_model_cfg):
    s = scorer(tiny_model_cfg, {"count_up": fn("rlhf_core.tasks.count_up_reward", weight=2.0, target_len=4)})
    # "7:" -> "8901xy": the first 4 positions should hold 8, 9, 0, 1 and do
    # -> count_up 4/4 = 1.0; total 2.0 * 1.0 = 2.0
    total, parts = s.score("7:", "8901xy", [1, 2, 3, 4, 5, 6], {"start": 7})
    assert parts == {"count_up": 1.0}
    assert total == pytest.approx(2.0, abs=1e-12)
    # target_len=4 really reached the function: with the default 6 the score would be 2/6
    total, parts = s.score("7:", "89x", [1, 2, 3], {"start": 7})
    assert parts == {"count_up": 0.5}  # "8" and "9" right, "x" wrong, 4th missing: 2/4
    assert total == pytest.approx(2.0 * 0.5, abs=1e-12)


def test_dict_components_are_named_and_weighted(tiny_model_cfg):
    s = scorer(tiny_model_cfg, {"count_up": None, "p": fn("reward_fns.parts", weight=0.5)})
    # parts returns {"a": 1.0, "b": -2.0} -> components p/a, p/b; total 0.5 * (1.0 - 2.0) = -0.5
    total, parts = s.score("7:", "8", [1], {})
    assert parts == {"p/a": 1.0, "p/b": -2.0}
    assert total == pytest.approx(-0.5, abs=1e-12)


def test_weighted_sum_over_several_functions_keeps_raw_components(tiny_model_cfg):
    s = scorer(tiny_model_cfg, {
        "len": fn("reward_fns.per_token", weight=0.5, scale=3.0),  # 3.0 * 4 tokens = 12.0
        "parts": fn("reward_fns.parts", weight=-1.0),  # a = 1.0, b = -2.0
        "const": fn("reward_fns.constant", value=0.25),  # weight 1 by default
    })
    total, parts = s.score("p", "abcd", [5, 6, 7, 8], {})
    assert parts == {"len": 12.0, "parts/a": 1.0, "parts/b": -2.0, "const": 0.25}
    # 0.5 * 12 + (-1) * (1 - 2) + 1 * 0.25 = 6 + 1 + 0.25
    assert total == 7.25
    assert s.names == ["len", "parts", "const"]


def test_function_receives_the_prompt_metadata(tiny_model_cfg):
    s = scorer(tiny_model_cfg, {"echo": fn("reward_fns.echo_metadata", key="answer")})
    assert s.score("q", "a", (9, 8), {"answer": 42}) == (42.0, {"echo": 42.0})
    assert s.score("q", "a", (9, 8), {"answer": -3}) == (-3.0, {"echo": -3.0})


def test_class_target_is_instantiated_once_with_kwargs(tiny_model_cfg):
    s = scorer(tiny_model_cfg, {"calls": fn("reward_fns.CallCounter", start=10)})
    assert [s.score("p", "r", [1], {})[0] for _ in range(3)] == [11.0, 12.0, 13.0]


def test_null_entry_switches_a_function_off(tiny_model_cfg):
    s = scorer(tiny_model_cfg, {"count_up": None, "const": fn("reward_fns.constant", value=2.0)})
    assert s.score("p", "r", [1], {}) == (2.0, {"const": 2.0})


@pytest.mark.parametrize("target, message", [
    ("reward_fns.boom", "reward function 'f' raised ValueError: boom"),
    ("reward_fns.nan", "reward 'f' is not finite (nan)"),
    ("reward_fns.inf_part", "reward 'f/bad' is not finite (inf)"),
    ("reward_fns.word", "reward 'f' returned '0.5' (str), not a number"),
    ("reward_fns.empty", "reward function 'f' returned an empty dict"),
])
def test_failing_function_raises_reward_error_naming_it(tiny_model_cfg, target, message):
    s = scorer(tiny_model_cfg, {"ok": fn("reward_fns.constant"), "f": fn(target)})
    with pytest.raises(RewardError) as info:
        s.score("p", "r", [1], {})
    assert str(info.value) == message


def test_weighted_overflow_is_not_finite(tiny_model_cfg):
    s = scorer(tiny_model_cfg, {"big": fn("reward_fns.constant", value=1e308, weight=10.0)})
    with pytest.raises(RewardError, match="weighted reward is not finite"):
        s.score("p", "r", [1], {})


# ---------------------------------------------------------------------------- reward models


@pytest.fixture(scope="module")
def rm_dirs(tiny_model_cfg, tmp_path_factory):
    root = tmp_path_factory.mktemp("rms")
    a = build_tiny_model(tiny_model_cfg.tiny, root / "rm-a", head="sequence")
    b = build_tiny_model(replace(tiny_model_cfg.tiny, seed=1), root / "rm-b", head="sequence")
    return a, b


def final_token_score(path, text: str) -> float:
    """The reward read by hand: the trunk's hidden state at the LAST token through the score head."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    ids = torch.tensor([build_tiny_tokenizer()(text, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state  # [1, T, H]
        return float(model.score(hidden[:, -1])[0, 0])


def test_reward_models_with_weights_and_a_function(tiny_model_cfg, rm_dirs):
    a, b = rm_dirs
    s = scorer(
        tiny_model_cfg,
        functions={"const": fn("reward_fns.constant", value=1.0, weight=0.5)},
        models={"rm_a": {"path": str(a), "weight": 2.0}, "rm_b": {"path": str(b), "weight": -1.0}},
    )
    total, parts = s.score("7:", "8901", [1, 2, 3, 4], {})
    ra, rb = final_token_score(a, "7:8901"), final_token_score(b, "7:8901")
    assert ra != rb  # two different models, so the weights below are really tested
    assert parts == pytest.approx({"const": 1.0, "rm_a": ra, "rm_b": rb}, abs=1e-5)
    assert total == pytest.approx(0.5 * 1.0 + 2.0 * ra - 1.0 * rb, abs=1e-5)


def test_reward_model_keeps_the_end_of_an_overlong_text(tiny_model_cfg, rm_dirs):
    a, _ = rm_dirs
    s = scorer(tiny_model_cfg, models={"rm": {"path": str(a)}})
    limit = tiny_model_cfg.tiny.max_position_embeddings
    long_text = "x" * (limit + 50) + "the end"
    _, parts = s.score("", long_text, [1], {})
    # truncated from the left to the model's context: the score is the one of the last `limit` characters
    assert parts["rm"] == pytest.approx(final_token_score(a, long_text[-limit:]), abs=1e-5)


def test_reward_model_nan_is_a_reward_error(tiny_model_cfg, rm_dirs):
    a, _ = rm_dirs
    s = scorer(tiny_model_cfg, models={"rm": {"path": str(a)}})
    with torch.no_grad():
        s.models[0].model.score.weight.fill_(float("nan"))
    with pytest.raises(RewardError, match=r"reward model 'rm' gave a non-finite score \(nan\)"):
        s.score("p", "r", [1], {})


# ---------------------------------------------------------------------------- config errors


@pytest.mark.parametrize("functions, models, message", [
    ({"f": {"weight": 1.0}}, {}, r"reward.functions.f needs a _target_"),
    ({"f": fn("no_such_module_xyz.fn")}, {}, r"reward.functions.f._target_='no_such_module_xyz.fn' cannot be imported"),
    ({"f": fn("reward_fns.no_such_function")}, {}, r"reward.functions.f._target_='reward_fns.no_such_function' cannot be imported"),
    ({"f": fn("reward_fns.constant", weight="heavy")}, {}, r"reward.functions.f.weight must be a finite number, got 'heavy'"),
    ({"f": "reward_fns.constant"}, {}, r"reward.functions.f must be a mapping"),
    ({}, {}, r"no reward configured: set reward.functions or reward.models"),
    ({"count_up": None}, {}, r"no reward configured"),
    ({}, {"rm": {"weight": 1.0}}, r"reward.models.rm needs path"),
])
def test_config_errors(tiny_model_cfg, functions, models, message):
    with pytest.raises(ConfigError, match=message):
        scorer(tiny_model_cfg, functions, models)


def test_reward_model_dir_without_config_is_a_config_error(tiny_model_cfg, tmp_path):
    with pytest.raises(ConfigError, match="has no config.json"):
        scorer(tiny_model_cfg, models={"rm": {"path": str(tmp_path)}})


def test_class_target_that_fails_to_build_is_a_config_error(tiny_model_cfg):
    with pytest.raises(ConfigError, match=r"reward.functions.c: reward_fns.CallCounter\(\*\*\{'begin': 1\}\) failed: TypeError"):
        scorer(tiny_model_cfg, {"c": fn("reward_fns.CallCounter", begin=1)})


def composed_reward(overrides: list[str]):
    from hydra import compose, initialize_config_module

    from rlhf_core.config import register_configs, to_object

    register_configs()
    with initialize_config_module(config_module="conf", version_base="1.3"):
        return to_object(compose("config", overrides=overrides)).reward


def test_default_reward_config_composes_into_a_scorer(tiny_model_cfg):
    # the default task's reward alone: count_up (target_len 6): "3:" -> "45" holds the first two digits -> 2/6
    assert Scorer(composed_reward([]), tiny_model_cfg).score("3:", "45", [1, 2], {"start": 3}) == (2 / 6, {"count_up": 2 / 6})


def test_a_reward_of_your_own_replaces_the_default_unless_you_keep_both(tiny_model_cfg):
    # once: `+reward.functions.mine...` silently kept count_up in the sum
    mine = ["+reward.functions.extra._target_=reward_fns.constant", "+reward.functions.extra.value=0.5"]
    assert Scorer(composed_reward(mine), tiny_model_cfg).score("3:", "45", [1, 2], {"start": 3}) == (0.5, {"extra": 0.5})
    both = Scorer(composed_reward(mine + ["reward.functions.count_up.default=false"]), tiny_model_cfg)
    total, parts = both.score("3:", "45", [1, 2], {"start": 3})
    assert parts == {"count_up": 2 / 6, "extra": 0.5}  # count_up 2/6 + extra 0.5
    assert total == pytest.approx(2 / 6 + 0.5, abs=1e-12)
    # a reward model is a reward of your own too
    from rlhf_core.config import active_reward_functions

    assert active_reward_functions(RewardConfig(functions={"count_up": {"_target_": "x", "default": True}},
                                                models={"rm": {"path": "/m"}})) == {}
    # a typo in a default that steps aside is not imported (nor reported)
    assert list(active_reward_functions(composed_reward(mine))) == ["extra"]


def test_count_up_is_anchored_to_the_prompt():
    from rlhf_core.tasks import count_up_reward

    # "7:" expects 8 9 0 1 2 ...: "8x01" has 3 of the first 4 right -> 3/4
    assert count_up_reward("7:", "8x01", [], {"start": 7}, target_len=4) == 0.75
    # a pattern that ignores the prompt: "8989" is right only at position 0 and 1 for start 7,
    # and nowhere for start 2 (expects 3 4 5 6)
    assert count_up_reward("7:", "8989", [], {"start": 7}, target_len=4) == 0.5
    assert count_up_reward("2:", "8989", [], {"start": 2}, target_len=4) == 0.0
    # wraps after 9, and reads the start from the prompt when metadata lacks it
    assert count_up_reward("9:", "0123", [], {}, target_len=4) == 1.0
