"""Scoring a batch: TRL-style batched functions beside per-sample ones, the return values a
library gives, empty responses, and reward models scored a batch per forward pass with their own
chat template. Every failure names the reward and what it returned."""

from __future__ import annotations

import decimal
import fractions
import shutil
from dataclasses import replace

import numpy as np
import pytest
import torch

import reward_fns
from rlhf_core.config import Config, ConfigError, RewardConfig, RolloutConfig
from rlhf_core.config.rules import no_reward_hides_the_environment
from rlhf_core.models import build_tiny_model
from rollout_workers.rewards import CallWatch, RewardError, ScoreItem, Scorer, as_number, is_batched


def scorer(model_cfg, functions=None, models=None, **settings) -> Scorer:
    return Scorer(RewardConfig(functions=functions or {}, models=models or {}, **settings), model_cfg)


def fn(target: str, **kwargs) -> dict:
    return {"_target_": target, **kwargs}


def items(*texts: str, **columns) -> list[ScoreItem]:
    """One item per text; ``columns`` are lists, one value per item (the prompt's data)."""
    return [ScoreItem("3:", t, list(range(len(t) + 1)), {k: v[i] for k, v in columns.items()}) for i, t in enumerate(texts)]


def errors(results) -> list[str | None]:
    return [str(r) if isinstance(r, RewardError) else None for r in results]


# ---------------------------------------------------------------------------- the batched signature


def test_signature_tells_batched_from_per_sample_and_config_overrides_it():
    assert is_batched("f", reward_fns.trl_length) and is_batched("f", reward_fns.trl_short)
    assert is_batched("f", reward_fns.trl_ids_only)  # completion_ids alone: TRL's too
    assert not is_batched("f", reward_fns.constant) and not is_batched("f", reward_fns.CallCounter())
    assert not is_batched("f", reward_fns.trl_length, declared=False) and is_batched("f", reward_fns.constant, declared=True)
    with pytest.raises(ConfigError, match=r"reward.functions.f.batched must be true or false .* got 'yes'"):
        is_batched("f", reward_fns.constant, declared="yes")


def test_a_batched_function_gets_lists_and_data_columns_as_keywords(tiny_model_cfg):
    reward_fns.batched_calls.clear()
    s = scorer(tiny_model_cfg, {"len": fn("reward_fns.trl_length", weight=2.0)})
    out = s.score_batch(items("ab", "abcd", "x", start=[1, 2, 3], tag=["a", "b", "c"]))
    # 0.1 * len + start: 0.2 + 1, 0.4 + 2, 0.1 + 3; weighted x2
    assert [parts for _, parts in out] == [{"len": pytest.approx(v)} for v in (1.2, 2.4, 3.1)]
    assert [total for total, _ in out] == [pytest.approx(2 * v) for v in (1.2, 2.4, 3.1)]
    (call,) = reward_fns.batched_calls  # one call for the batch, columns as lists of one value per completion
    assert call == {"n": 3, "columns": ["tag"], "start": [1, 2, 3], "ids_match": [True] * 3}


def test_a_column_missing_from_some_prompts_is_none_there(tiny_model_cfg):
    s = scorer(tiny_model_cfg, {"ref": fn("reward_fns.trl_reference")})
    batch = [ScoreItem("p", "abc", [1], {"reference": "abd"}), ScoreItem("p", "zz", [1], {"other": 1})]
    # "ab" of "abd" match: 2/3; the second prompt has no reference: None reaches the function (-1)
    assert s.score_batch(batch) == [(pytest.approx(2 / 3), {"ref": pytest.approx(2 / 3)}), (-1.0, {"ref": -1.0})]


def test_a_column_the_function_names_is_none_where_a_prompt_lacks_it_whatever_its_batch(tiny_model_cfg):
    # once the keyword was left out of a batch where no prompt had the column: TypeError, the
    # whole batch dead-lettered, while the same prompt beside one with a solution scored 0
    s = scorer(tiny_model_cfg, {"acc": fn("reward_fns.trl_solution")})
    mixed = s.score_batch([ScoreItem("p", "4", [1], {"solution": "4"}), ScoreItem("q", "x", [1], {})])
    assert mixed == [(1.0, {"acc": 1.0}), (0.0, {"acc": 0.0})]  # "4" is the solution; none for q: 0
    assert s.score_batch([ScoreItem("q", "x", [1], {})]) == [(0.0, {"acc": 0.0})]


def test_per_sample_and_batched_functions_sum_in_one_batch(tiny_model_cfg):
    s = scorer(tiny_model_cfg, {"const": fn("reward_fns.constant", value=0.5), "len": fn("reward_fns.trl_length")})
    out = s.score_batch(items("abc", "a", start=[0, 0]))
    assert out == [(pytest.approx(0.8), {"const": 0.5, "len": pytest.approx(0.3)}),
                   (pytest.approx(0.6), {"const": 0.5, "len": pytest.approx(0.1)})]


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
RENDERED = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"


def test_a_batched_function_gets_what_trl_passes_the_raw_prompt_or_its_turns(tiny_model_cfg):
    # TRL: a text prompt as it is (no chat template), a chat prompt as its turns with each completion
    # as [{"role": "assistant", "content": ...}]; the policy's rendering went to both once
    reward_fns.trl_seen.clear()
    s = scorer(tiny_model_cfg, {"echo": fn("reward_fns.trl_echo")})
    s.score_batch([ScoreItem(RENDERED, "4", [1], {}, CHAT, raw_prompt=""),
                   ScoreItem("<|im_start|>user\n3:<|im_end|>\n<|im_start|>assistant\n", "45", [1, 2], {}, raw_prompt="3:")])
    (seen,) = reward_fns.trl_seen
    assert seen == {"prompts": [CHAT, "3:"], "completions": [[{"role": "assistant", "content": "4"}], "45"]}


def test_trl_s_own_reward_scores_a_chat_prompt_s_completions(tiny_model_cfg):
    pytest.importorskip("trl")
    # think_format_reward reads completion[0]["content"]: a plain string failed every sample
    s = scorer(tiny_model_cfg, {"fmt": fn("trl.rewards.think_format_reward")})
    out = s.score_batch([ScoreItem(RENDERED, "<think>\n2+2 is 4\n</think>\n4", [1, 2], {}, CHAT),
                         ScoreItem(RENDERED, "4", [1], {}, CHAT)])
    assert out == [(1.0, {"fmt": 1.0}), (0.0, {"fmt": 0.0})]


def test_none_means_the_function_does_not_apply_to_that_completion(tiny_model_cfg):
    # TRL's multi-task rewards: None for a sample leaves the function out of its sum (nansum);
    # here both samples were dead-lettered
    s = scorer(tiny_model_cfg, {"math": fn("reward_fns.trl_math_only"), "code": fn("reward_fns.trl_code_only", weight=2.0)})
    out = s.score_batch(items("abc", "de", "f", task=["math", "code", "prose"]))
    # "abc" is math: len 3 (code leaves it); "de" is code: 2 x 0.5; "f" is neither: no reward applies
    assert out[:2] == [(3.0, {"math": 3.0}), (1.0, {"code": 0.5})]
    assert errors(out)[2] == ("no reward applies to this sample: every reward function returned None for it (TRL's "
                              "'does not apply') and no reward model is configured")


@pytest.mark.timeout(30)
def test_an_async_reward_is_awaited(tiny_model_cfg):
    s = scorer(tiny_model_cfg, {"len": fn("reward_fns.trl_async_length"), "c": fn("reward_fns.async_constant", value=0.5)})
    # len("abc") = 3, plus the per-sample coroutine's 0.5
    assert s.score_batch(items("abc")) == [(3.5, {"len": 3.0, "c": 0.5})]
    # a coroutine's SystemExit fails its sample; it ended the event loop's thread, and the call waited forever
    assert errors(scorer(tiny_model_cfg, {"x": fn("reward_fns.async_exit")}).score_batch(items("a"))) == [
        "reward function 'x' raised SystemExit: 3"]
    assert s.score_batch(items("ab")) == [(2.5, {"len": 2.0, "c": 0.5})]  # the loop still runs


def test_a_function_of_completion_ids_alone_is_batched(tiny_model_cfg):
    s = scorer(tiny_model_cfg, {"len": fn("reward_fns.trl_ids_only")})
    # items() gives "abc" the ids [0, 1, 2, 3]: -0.01 x 4
    assert s.score_batch(items("abc")) == [(pytest.approx(-0.04), {"len": pytest.approx(-0.04)})]


@pytest.mark.parametrize("target, message", [
    ("reward_fns.trl_short", "reward function 'f' returned 2 value(s) for 3 completion(s); a batched reward returns "
                             "exactly one number per completion"),
    ("reward_fns.trl_scalar", "reward function 'f' (batched: prompts, completions, ...) returned 0.5 (float); it must "
                              "return a list with one number per completion (3 here)"),
    ("reward_fns.trl_boom", "reward function 'f' raised RuntimeError: batched boom"),
])
def test_a_batched_function_that_fails_fails_its_whole_batch_naming_itself(tiny_model_cfg, target, message):
    s = scorer(tiny_model_cfg, {"f": fn(target)})
    assert errors(s.score_batch(items("a", "b", "c"))) == [message] * 3


@pytest.mark.parametrize("target, message", [
    ("reward_fns.cancelled", "reward function 'f' raised CancelledError: the client's request task was cancelled"),
    ("reward_fns.trl_cancelled", "reward function 'f' raised CancelledError"),
    ("reward_fns.system_exit", "reward function 'f' raised SystemExit: 2"),
])
def test_a_reward_raising_a_base_exception_fails_its_samples_not_the_worker(tiny_model_cfg, target, message):
    # CancelledError and SystemExit are not Exceptions: they escaped score_batch, the scoring pool
    # raised them on the worker's main thread, and the restarted worker took the same prompt again
    s = scorer(tiny_model_cfg, {"f": fn(target)})
    assert errors(s.score_batch(items("a", "b"))) == [message] * 2


def test_an_exception_in_place_of_a_number_fails_that_completion_only(tiny_model_cfg):
    s = scorer(tiny_model_cfg, {"j": fn("reward_fns.trl_fails_one")})
    out = s.score_batch(items("a", "b", "c"))
    assert errors(out) == ["reward function 'j' failed for this completion: ValueError: no verdict for this one", None, None]
    assert out[1:] == [(1.0, {"j": 1.0})] * 2


def test_return_values_of_every_kind_in_a_batch(tiny_model_cfg):
    s = scorer(tiny_model_cfg, {"t": fn("reward_fns.trl_types")})
    out = s.score_batch(items(*"abcdef"))
    assert [r if isinstance(r, RewardError) else r[0] for r in out][:4] == [0.25, 0.5, 0.75, 1.5]
    assert errors(out)[4:] == [
        "reward 't' returned True (bool), not a number: booleans are not rewards (return 1.0 / 0.0 if that is what you mean)",
        "reward 't' returned '2' (str), not a number",
    ]


# ---------------------------------------------------------------------------- return values


@pytest.mark.parametrize("value, expected", [
    (1, 1.0), (0.5, 0.5), (fractions.Fraction(1, 4), 0.25), (decimal.Decimal("0.125"), 0.125),
    (np.float32(0.5), 0.5), (np.float64(-2.0), -2.0), (np.int64(3), 3.0), (np.array(0.5), 0.5),
    (np.array([0.5], dtype=np.float32), 0.5), (np.array([[7]]), 7.0), (torch.tensor(0.5), 0.5),
    (torch.tensor([0.25]), 0.25), (torch.tensor([[2.0]], dtype=torch.bfloat16), 2.0),
    (torch.tensor(1.0, requires_grad=True), 1.0),
])
def test_any_real_number_a_library_gives_is_accepted(value, expected):
    assert as_number("f", value) == expected and type(as_number("f", value)) is float


@pytest.mark.parametrize("value, message", [
    (True, "reward 'f' returned True (bool), not a number: booleans are not rewards"),
    (np.bool_(False), "reward 'f' returned np.False_ (numpy.bool), not a number: booleans are not rewards"),
    (torch.tensor(True), "reward 'f' returned tensor(True) (torch.Tensor of torch.bool), not a number: booleans are not"),
    (np.array([True]), "reward 'f' returned array([ True]) (numpy.ndarray of bool), not a number: booleans are not"),
    ("0.5", "reward 'f' returned '0.5' (str), not a number"),
    (None, "reward 'f' returned None (NoneType), not a number"),
    (1 + 2j, "reward 'f' returned (1+2j) (complex), not a number"),
    ([0.5], "reward 'f' returned [0.5] (list), not a number"),
    (np.array([0.5, 0.5]), "reward 'f' returned a numpy.ndarray of float64 of shape (2,), not one number"),
    (torch.zeros(0), "reward 'f' returned a torch.Tensor of torch.float32 of shape (0,), not one number"),
    (np.str_("1"), "reward 'f' returned '1' (str), not a number"),
    (decimal.Decimal("NaN"), "reward 'f' is not finite (nan)"),
    (decimal.Decimal("sNaN"), "reward 'f' is not finite (nan)"),
    (np.float32("inf"), "reward 'f' is not finite (inf)"),
])
def test_booleans_and_everything_else_are_refused_with_the_type_named(value, message):
    with pytest.raises(RewardError) as info:
        as_number("f", value)
    assert str(info.value).startswith(message), str(info.value)


class Unshowable:
    """A value whose repr raises (a half-built object of a user's library)."""

    def __repr__(self) -> str:
        raise RuntimeError("no repr")


class BadReal(float):
    """A Real whose float() raises."""

    def __float__(self) -> float:
        raise ArithmeticError("no float")


class BadItem(np.ndarray):
    """A one-element array whose item() raises."""

    def item(self, *args):
        raise ValueError("no item")


@pytest.mark.parametrize("value, message", [
    (Unshowable(), "reward 'f' returned <a Unshowable whose repr raised RuntimeError> (Unshowable), not a number"),
    (BadReal(1.0), "reading the value of reward 'f' (BadReal) raised ArithmeticError: no float"),
    (np.zeros(1).view(BadItem), "reading the value of reward 'f' (BadItem) raised ValueError: no item"),
])
def test_a_value_that_cannot_be_read_is_a_reward_error(value, message):
    # once the repr's, float()'s or item()'s own exception escaped as_number and failed the whole batch
    with pytest.raises(RewardError) as info:
        as_number("f", value)
    assert str(info.value) == message


def test_a_per_sample_function_returning_numpy_or_torch_values(tiny_model_cfg):
    s = scorer(tiny_model_cfg, {"a": fn("reward_fns.value_of", value=np.float32(0.5)),
                                "b": fn("reward_fns.value_of", value=torch.tensor([0.25]))})
    assert s.score("p", "r", [1], {}) == (0.75, {"a": 0.5, "b": 0.25})


# ---------------------------------------------------------------------------- empty responses


@pytest.mark.parametrize("mode, expected", [
    # prefers_silence scores exactly '' 0.9 and anything else 0.1: "score" calls it for both empty ones
    ("score", [(0.9, {"s": 0.9}), (0.1, {"s": 0.1}), (0.1, {"s": 0.1})]),
    ("zero", [(0.0, {}), (0.0, {}), (0.1, {"s": 0.1})]),
    ("dead_letter", ["empty response (only end-of-sequence or whitespace): dead-lettered by "
                     "reward.empty_response=dead_letter (zero scores it 0, score calls the rewards)"] * 2 + [(0.1, {"s": 0.1})]),
])
def test_empty_responses_follow_reward_empty_response(tiny_model_cfg, mode, expected):
    s = scorer(tiny_model_cfg, {"s": fn("reward_fns.prefers_silence")}, empty_response=mode)
    out = s.score_batch(items("", "  \n", "text"))
    assert [str(r) if isinstance(r, RewardError) else r for r in out] == expected


def test_the_default_for_empty_responses_is_zero_and_bad_modes_are_refused():
    assert RewardConfig().empty_response == "zero"
    with pytest.raises(Exception, match="reward.empty_response=skip") as err:  # refused at composition
        composed_reward(["reward.empty_response=skip"])
    assert "expected one of [zero, dead_letter, score]" in str(err.value.__cause__)


@pytest.mark.parametrize("settings, message", [
    ({"batch_size": 0}, r"reward.batch_size and reward.num_threads must be >= 1 .* got 0, 1"),
    ({"num_threads": 0}, r"reward.batch_size and reward.num_threads must be >= 1 .* got 32, 0"),
    ({"max_wait_ms": -1.0}, r"reward.max_wait_ms must be a number of milliseconds >= 0 .* got -1.0"),
    ({"timeout_s": 0.0}, r"reward.timeout_s must be a number of seconds > 0, or null for no limit, got 0.0"),
    ({"timeout_s": float("inf")}, r"reward.timeout_s must be .* got inf"),
])
def test_scoring_settings_are_checked_at_start_up(settings, message):
    with pytest.raises(ConfigError, match=message):
        RewardConfig(**settings).check()
    RewardConfig(timeout_s=None).check()  # null: no limit


def test_the_time_limit_counts_per_call_a_per_sample_function_s_per_sample(tiny_model_cfg):
    # reward.timeout_s holds each call the scoring thread notes in its watch: a per-sample function
    # starts the clock again at every sample, a batched function once per batch
    class Watch(CallWatch):
        def __init__(self) -> None:
            super().__init__()
            self.begun: list[str] = []

        def begin(self, what: str) -> None:
            super().begin(what)
            self.begun.append(what)

    watch = Watch()
    s = scorer(tiny_model_cfg, {"c": fn("reward_fns.constant"), "len": fn("reward_fns.trl_length")})
    s.score_batch(items("a", "b", "c", start=[0, 0, 0]), watch)
    assert watch.begun == ["reward function 'c'"] * 3 + ["reward function 'len'"] and watch.current is None


def test_rewards_of_one_name_are_refused_at_start_up():
    # both were summed into the reward, but reward_components kept one: the parts no longer added up
    clash = RewardConfig(functions={"quality": fn("reward_fns.constant"), "count_up": fn("x", default=True)},
                         models={"quality": {"path": "/models/rm"}, "count_up": {"path": "/models/rm2"}})
    with pytest.raises(ConfigError, match=r"reward.functions and reward.models both name 'quality': .* rename one"):
        clash.check()
    # a default that steps aside for the models (count_up here) clashes with nothing
    RewardConfig(functions={"count_up": fn("x", default=True)}, models={"count_up": {"path": "/m"}}).check()
    # nor may a reward take the name an episode's environment rewards are kept under
    env = RewardConfig(functions={"env": fn("reward_fns.constant")})
    env.check()
    no_reward_hides_the_environment(Config(reward=env))  # no environment: no clash
    with pytest.raises(ConfigError, match=r"a reward is named 'env', the component an episode's environment rewards"):
        no_reward_hides_the_environment(Config(reward=env, rollout=RolloutConfig(env={"_target_": "my_envs.Guess"})))
    # nor one of the learner's own reward/<stat> metrics: a reward 'max' was written over reward/max
    with pytest.raises(ConfigError, match=r"a reward is named 'max', which the learner's own reward/<stat> metrics use"):
        RewardConfig(functions={"max": fn("reward_fns.constant")}).check()


# ---------------------------------------------------------------------------- reward models


@pytest.fixture(scope="module")
def rm_dir(tiny_model_cfg, tmp_path_factory):
    return build_tiny_model(replace(tiny_model_cfg.tiny, seed=3), tmp_path_factory.mktemp("rm") / "rm", head="sequence")


def final_token_score(path, text: str, add_special_tokens: bool = True) -> float:
    """The reward read by hand from ONE unpadded sequence: the score head at its last token."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    ids = AutoTokenizer.from_pretrained(path)(text, add_special_tokens=add_special_tokens, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        return float(model(input_ids=ids).logits[0, 0])


def test_a_padded_batch_scores_each_text_as_alone(tiny_model_cfg, rm_dir):
    s = scorer(tiny_model_cfg, models={"rm": {"path": str(rm_dir)}})
    texts = ["8", "8901234567", "89x"]
    watch = CallWatch()
    out = s.score_batch(items(*texts), watch)
    assert watch.calls == 1  # one forward pass for the batch
    expected = [final_token_score(rm_dir, "3:" + t) for t in texts]
    assert len(set(round(e, 4) for e in expected)) == 3  # different texts, different scores: padding is really tested
    assert [parts["rm"] for _, parts in out] == pytest.approx(expected, abs=1e-4)


def test_a_config_pad_id_other_than_the_tokenizer_s_does_not_make_scores_batch_dependent(tiny_model_cfg, rm_dir, tmp_path):
    # the batch is padded with the tokenizer's pad token, HF's head looks for config.pad_token_id:
    # a short row was read at a padding position, -0.152 alone and -0.144 beside a longer one
    import json

    from transformers import AutoTokenizer

    other = tmp_path / "rm-pad"
    shutil.copytree(rm_dir, other)
    tok = AutoTokenizer.from_pretrained(other)
    config = json.loads((other / "config.json").read_text())
    config["pad_token_id"] = tok.unk_token_id if tok.unk_token_id != tok.pad_token_id else tok.eos_token_id
    (other / "config.json").write_text(json.dumps(config))  # a base model's pad id kept beside a tokenizer with its own
    s = scorer(tiny_model_cfg, models={"rm": {"path": str(other)}})
    (alone,), together = s.score_batch(items("4")), s.score_batch(items("4", "4567890123"))
    assert together[0][1]["rm"] == pytest.approx(alone[1]["rm"], abs=1e-5)
    assert alone[1]["rm"] == pytest.approx(final_token_score(other, "3:4"), abs=1e-5)  # read at its last token


def test_two_scoring_threads_share_one_reward_model(tiny_model_cfg, rm_dir):
    # reward.num_threads=2: forward passes side by side, the tokenizer taking turns
    import threading

    s = scorer(tiny_model_cfg, models={"rm": {"path": str(rm_dir)}})
    batches = [items(*(f"{k}" * (1 + (k + j) % 9) for j in range(8))) for k in range(10)]
    expected = [s.score_batch(b) for b in batches]
    got: dict[int, list] = {}

    def score(ks):
        for k in ks:
            got[k] = s.score_batch(batches[k])

    threads = [threading.Thread(target=score, args=(range(i, 10, 2),)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [got[k] for k in range(10)] == [[(pytest.approx(t), pytest.approx(p)) for t, p in e] for e in expected]


def test_a_reward_model_applies_its_own_chat_template(tiny_model_cfg, rm_dir, tmp_path):
    from transformers import AutoTokenizer

    templated = tmp_path / "rm-chat"
    shutil.copytree(rm_dir, templated)
    tok = AutoTokenizer.from_pretrained(templated)
    tok.chat_template = "{% for m in messages %}[{{ m['role'][0] }}]{{ m['content'] }}{% endfor %}"
    tok.save_pretrained(templated)
    s = scorer(tiny_model_cfg, models={"rm": {"path": str(templated)}})
    batch = [ScoreItem("<policy's own rendering of q>", "yes", [1], {}, [{"role": "user", "content": "q?"}]),
             ScoreItem("2:", "345", [1], {})]  # no turns: the rendered prompt as the user's turn
    out = s.score_batch(batch)
    expected = [final_token_score(templated, "[u]q?[a]yes", add_special_tokens=False),
                final_token_score(templated, "[u]2:[a]345", add_special_tokens=False)]
    assert [parts["rm"] for _, parts in out] == pytest.approx(expected, abs=1e-4)
    assert expected[0] != pytest.approx(final_token_score(templated, "<policy's own rendering of q>yes"), abs=1e-3)


def test_a_reward_model_device_that_does_not_exist_is_a_config_error(tiny_model_cfg, rm_dir):
    with pytest.raises(ConfigError, match=r"reward.models.rm.device='gpu:7' cannot hold the model"):
        scorer(tiny_model_cfg, models={"rm": {"path": str(rm_dir), "device": "gpu:7"}})
    assert scorer(tiny_model_cfg, models={"rm": {"path": str(rm_dir), "device": "cpu"}}).describe() == "rm (reward model on cpu)"


def test_a_failing_reward_model_fails_its_batch_naming_itself(tiny_model_cfg, rm_dir):
    s = scorer(tiny_model_cfg, models={"rm": {"path": str(rm_dir)}})
    s.models[0].model.forward = lambda **kw: (_ for _ in ()).throw(RuntimeError("out of memory"))
    assert errors(s.score_batch(items("a", "b"))) == ["reward model 'rm' failed: RuntimeError: out of memory"] * 2


def test_class_errors_never_show_secrets(tiny_model_cfg):
    with pytest.raises(ConfigError) as info:
        scorer(tiny_model_cfg, {"j": fn("rollout_workers.rewards_remote.ChatJudge", url="ftp://x", model="m",
                                        api_key="sk-very-secret")})
    assert "sk-very-secret" not in str(info.value) and "'api_key': '***'" in str(info.value)
    assert "url must be http(s)://host[:port]/v1" in str(info.value)


def composed_reward(overrides: list[str]):
    from hydra import compose, initialize_config_module

    from rlhf_core.config import register_configs, to_object

    register_configs()
    with initialize_config_module(config_module="conf", version_base="1.3"):
        return to_object(compose("config", overrides=overrides)).reward


def test_the_judge_config_group_builds_a_batched_judge_and_needs_its_url(tiny_model_cfg):
    from rollout_workers.rewards_remote import ChatJudge

    reward = composed_reward(["reward=judge", "reward.functions.judge.url=http://127.0.0.1:9/v1",
                              "reward.functions.judge.model=m"])
    reward.check()
    s = Scorer(reward, tiny_model_cfg)
    (judge,) = s.functions
    assert isinstance(judge.fn, ChatJudge) and judge.fn.endpoint == "http://127.0.0.1:9/v1/chat/completions"
    assert s.describe() == "judge (batched)"
    # the group's own numbers fit in its reward.timeout_s: a batch of reward.batch_size in rounds of
    # `concurrency` requests, each up to max_retries + 1 attempts of timeout_s and a wait of at most
    # max_backoff_s between them (a Retry-After); 32 / 8 x (3 x 30 + 2 x 8) = 424 s was over 300 s
    j = judge.fn
    rounds = -(-reward.batch_size // j.concurrency)
    worst = rounds * ((j.max_retries + 1) * j.timeout_s + j.max_retries * j.max_backoff_s)
    assert (rounds, worst) == (4, 424.0) and reward.timeout_s >= worst
    with pytest.raises(ConfigError, match="required setting reward.functions.judge.url has no value"):
        composed_reward(["reward=judge"])
