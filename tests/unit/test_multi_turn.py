"""Multi-turn episodes and DAPO's rules, with small tensors and the arithmetic in the comments:
the transcript's loss mask, the sample's wire format (old records still decode), the learner's
masked reductions, the over-long penalty, the group filter and its stall warning, tool-call
parsing and the environment checks at start-up."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import msgpack
import numpy as np
import pytest
import torch

from factories import sample
from learner.algorithms.core import token_rewards
from learner.algorithms.gae import gae
from learner.algorithms.ppo_policy_loss import ppo_clip_loss
from learner.batch import collate
from learner.engine_factory import make_engine
from learner.passes import ModelPasses
from learner.update import PolicyUpdater
from learner_helpers import close, digit_reward, generate_samples, tiny_config, train
from rlhf_core.config import ConfigError, RolloutConfig
from rlhf_core.dapo import FilterStall, filter_reason, group_filter, overlong_penalty
from rlhf_core.episode import Transcript
from rlhf_core.models import load_policy
from rlhf_core.records import Sample
from rlhf_core.tool_calls import ToolCallParser
from rlhf_core.wire import WireError
from rollout_workers.envs.calculator import CalcError, evaluate
from rollout_workers.user_code import import_env_target


def transcript() -> Transcript:
    t = Transcript([5, 6])
    t.add_observation([7])  # before the first policy token: part of the prompt
    t.add_policy([10, 11], [-0.5, -0.25], [3, 3])
    t.add_observation([20, 21, 22])  # an observation: mask 0, log-prob 0, the version before it
    t.add_policy([12], [-1.0], [4])
    return t


def test_a_transcript_keeps_the_policy_turns_as_sampled_and_masks_the_rest():
    t = transcript()
    assert t.prompt_ids == [5, 6, 7]
    assert t.response_ids == [10, 11, 20, 21, 22, 12]
    assert t.mask == [1, 1, 0, 0, 0, 1]
    assert t.logprobs == [-0.5, -0.25, 0.0, 0.0, 0.0, -1.0]
    assert t.versions == [3, 3, 3, 3, 3, 4]
    assert t.policy_segments() == [[10, 11], [12]] and t.num_policy_tokens == 3
    s = t.to_sample(sample_id="g/0", prompt_id="p", group_id="g", reward=1.0)
    assert s.versions == [[3, 5], [4, 1]] and s.num_policy_tokens == 3 and s.oldest_version == 3
    back = Sample.decode(s.encode())
    assert back.loss_mask.tolist() == [1, 1, 0, 0, 0, 1] and back.response_ids.tolist() == t.response_ids
    with pytest.raises(ValueError, match="one log-prob and one version per token"):
        t.add_policy([1, 2], [-1.0], [0, 0])


def test_staleness_counts_policy_tokens_only():
    # tokens 0-1 were written at version 1 but are not the policy's (mask 0): the oldest policy token is version 5
    s = sample(response_ids=[1, 2, 3], token_versions=[1, 1, 5], loss_mask=np.array([0, 0, 1], dtype=np.uint8))
    assert s.oldest_version == 5
    assert sample(response_ids=[1, 2, 3], token_versions=[1, 1, 5]).oldest_version == 1  # no mask: every token


def _with_schema(raw: bytes, version: int, drop_mask: bool = False) -> bytes:
    obj = msgpack.unpackb(raw, raw=False)
    obj["schema_version"] = version
    if drop_mask:
        obj.pop("loss_mask", None)
    return msgpack.packb(obj, use_bin_type=True)


def test_a_version_1_record_still_decodes_and_trains_on_every_token():
    old = _with_schema(sample(response_ids=[1, 2, 3]).encode(), 1)
    s = Sample.decode(old)
    assert s.loss_mask is None and s.policy_mask().tolist() == [True, True, True]
    masked = sample(response_ids=[1, 2, 3], loss_mask=np.array([1, 0, 1], dtype=np.uint8)).encode()
    with pytest.raises(WireError, match="loss_mask' needs schema_version >= 2"):
        Sample.decode(_with_schema(masked, 1))
    with pytest.raises(WireError, match="not supported"):
        Sample.decode(_with_schema(masked, 3))


def test_collate_and_the_loss_reduce_over_the_policy_tokens_only():
    single = sample("p0", index=0, response_ids=[1, 2], behaviour_logprobs=[-1.0, -1.0])
    episode = sample("p0", index=1, response_ids=[3, 4, 5, 6], behaviour_logprobs=[-1.0, 0.0, 0.0, -1.0],
                     loss_mask=np.array([1, 0, 0, 1], dtype=np.uint8))
    batch = collate([single, episode], pad_id=0)
    assert batch.response_mask.tolist() == [[True, True, False, False], [True, True, True, True]]
    assert batch.policy_mask.tolist() == [[True, True, False, False], [True, False, False, True]]
    assert batch.policy_lengths.tolist() == [2, 2]
    # ratio 1 everywhere (logp = behaviour), so the clipped loss is -A per token; token-mean over the
    # 4 policy tokens: -(1 + 1 + 3 + 3) / 4 = -2. The observation tokens' advantage 100 is not counted
    # (over the response mask it would be -(1 + 1 + 3 + 100 + 100 + 3) / 6 = -34.67).
    adv = torch.tensor([[1.0, 1.0, 0.0, 0.0], [3.0, 100.0, 100.0, 3.0]])
    loss, _ = ppo_clip_loss(batch.behaviour_logprobs, None, batch.behaviour_logprobs, adv, batch.policy_mask)
    close(loss, -2.0)
    # seq-mean-token-mean: per row -(1 + 1) / 2 = -1 and -(3 + 3) / 2 = -3, mean -2 as well
    loss, _ = ppo_clip_loss(batch.behaviour_logprobs, None, batch.behaviour_logprobs, adv, batch.policy_mask,
                            agg_mode="seq-mean-token-mean")
    close(loss, -2.0)
    # algo.overlong=mask: a truncated response (finish reason length) leaves the loss entirely
    batch.truncated[1] = True
    masked = ModelPasses.loss_mask(SimpleNamespace(algo=SimpleNamespace(overlong="mask")), batch)
    assert masked.tolist() == [[True, True, False, False], [False, False, False, False]]
    assert ModelPasses.loss_mask(SimpleNamespace(algo=SimpleNamespace(overlong="none")), batch).equal(batch.policy_mask)


def test_an_update_ignores_what_the_policy_did_not_sample(tiny_model_cfg):
    """Two copies of a batch differ only at the tokens under loss mask 0 (their behaviour log-probs
    and versions): the update (loss, KL against the reference, entropy bonus, advantages) is the
    same. Unmasked, log-prob -30 at those tokens would change every importance weight."""
    base = load_policy(tiny_model_cfg)
    samples = generate_samples(base, [[20, 30], [21, 30, 4]], group_size=4, max_new_tokens=6, seed=1,
                               reward_fn=digit_reward, eos_id=-1)  # no early stop: 6 tokens each

    def episodes(logprob: float, version: int):
        out = []
        for s in samples:
            s = copy.deepcopy(s)
            s.loss_mask = np.array([1, 0, 0, 1, 1, 1], dtype=np.uint8)  # tokens 1-2: an observation
            s.behaviour_logprobs[1:3] = logprob
            s.versions = [[0, 1], [version, 2], [0, 3]]
            out.append(s)
        return out

    results = []
    for logprob, version in ((0.0, 0), (-30.0, 5)):
        cfg = tiny_config(tiny_model_cfg, **{"algo.kl_coef": 0.1, "algo.entropy_coef": 0.01})
        up = PolicyUpdater(cfg, make_engine(cfg, copy.deepcopy(base)), copy.deepcopy(base).eval())
        metrics = train(up, episodes(logprob, version), 1)
        results.append((metrics, {n: p.detach().clone() for n, p in up.engine.module.named_parameters()}))
    (m0, w0), (m1, w1) = results
    for key in ("loss/policy", "loss/kl", "loss/entropy", "loss/advantage_abs_mean", "staleness/max", "learner/num_tokens"):
        assert m0[key] == pytest.approx(m1[key], abs=1e-6), key
    assert m0["learner/num_tokens"] == 8 * 4 and m0["staleness/max"] == 1.0
    assert all(torch.allclose(w0[n], w1[n], atol=1e-6) for n in w0)


def test_rewards_and_gae_skip_the_tokens_the_policy_did_not_sample():
    mask = torch.tensor([[1, 0, 0, 1, 0]], dtype=torch.bool)  # policy, obs, obs, policy, padding
    # the sequence reward lands on the last policy token (index 3), not on an observation
    assert token_rewards(torch.tensor([2.0]), mask).tolist() == [[0.0, 0.0, 0.0, 2.0, 0.0]]
    # GAE over the masked row equals GAE over the policy tokens alone: rewards [0, 2], values [0.5, 1],
    # gamma = lam = 1: A_1 = 2 - 1 = 1, A_0 = 0 + 1 - 0.5 + 1 = 1.5 (the observations are skipped)
    r = torch.tensor([[0.0, 9.0, 9.0, 2.0, 0.0]])
    v = torch.tensor([[0.5, 9.0, 9.0, 1.0, 0.0]])
    adv, _ = gae(r, v, mask, gamma=1.0, lam=1.0)
    close(adv, [[1.5, 0.0, 0.0, 1.0, 0.0]])
    short, _ = gae(torch.tensor([[0.0, 2.0]]), torch.tensor([[0.5, 1.0]]), torch.ones(1, 2, dtype=torch.bool), 1.0, 1.0)
    close(adv[mask], short[0])


def test_overlong_penalty_ramps_over_the_buffer():
    # max_len 12, buffer 4: expected length 8; 8 -> 0, 10 -> (8 - 10) / 4 = -0.5, 12 -> -1, 13 -> -1 (clamped)
    got = overlong_penalty(torch.tensor([3, 8, 9, 10, 12, 13]), max_len=12, buffer=4)
    close(got, [0.0, 0.0, -0.25, -0.5, -1.0, -1.0])
    with pytest.raises(ValueError, match="over-long buffer"):
        overlong_penalty(torch.tensor([1]), max_len=4, buffer=4)


def test_filter_reasons():
    assert filter_reason([1.0, 1.0, 1.0], [False] * 3) == "zero_variance"
    assert filter_reason([0.5], [False]) == "zero_variance"  # a lone sample has no baseline
    assert filter_reason([0.0, 1.0], [False, False]) is None
    assert filter_reason([0.0, 1.0], [True, True], overlong="mask") == "all_truncated"
    assert filter_reason([0.0, 1.0], [True, True]) is None  # truncation costs nothing without overlong=mask
    assert filter_reason([], []) is None


def test_group_filter_reads_a_groups_samples_under_the_algo_settings():
    NS = SimpleNamespace
    cut = [NS(reward=0.0, finish_reason="length"), NS(reward=1.0, finish_reason="length")]
    same = [NS(reward=1.0, finish_reason="stop"), NS(reward=1.0, finish_reason="length")]
    assert group_filter(NS(filter_groups=False, overlong="mask"), same) is None  # the filter off
    assert group_filter(NS(filter_groups=True, overlong="none"), same) == "zero_variance"
    assert group_filter(NS(filter_groups=True, overlong="none"), cut) is None
    assert group_filter(NS(filter_groups=True, overlong="mask"), cut) == "all_truncated"  # finish_reason "length"


def test_the_stall_warning_comes_once_per_stretch_of_only_filtered_groups():
    watch = FilterStall(stretch_s=60)
    c = {"groups_appended": 5, "groups_filtered": 2, "groups_filtered_zero_variance": 2}
    assert watch.observe(0.0, c) is None
    c.update(groups_filtered=9, groups_filtered_zero_variance=9)
    assert watch.observe(30.0, c) is None  # not long enough yet
    msg = watch.observe(61.0, c)
    assert msg and "7 groups: zero_variance 7" in msg and "algo.filter_groups=false" in msg
    assert watch.observe(90.0, c) is None  # said once
    c["groups_appended"] = 6  # a group reached the buffer: a new stretch begins
    assert watch.observe(100.0, c) is None and watch.observe(200.0, c) is None  # nothing filtered since: no stall
    c.update(groups_filtered=10, groups_filtered_zero_variance=10)
    assert watch.observe(200.0, c) is not None


class _Tokenizer:
    def __init__(self, chat_template=None):
        self.chat_template = chat_template


@pytest.mark.parametrize("text, calls, errors", [
    ('<tool_call>{"name": "calculate", "arguments": {"expression": "1+2"}}</tool_call>',
     [("calculate", {"expression": "1+2"})], []),
    ('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call><tool_call>{"name": "g"}</tool_call>',
     [("f", {"x": 1}), ("g", {})], []),
    ("<tool_call>{not json</tool_call>", [], ["tool call 0 is not valid JSON"]),
    ('<tool_call>{"arguments": {}}</tool_call>', [], ['tool call 0 needs {"name"']),
    ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', [], ["arguments must be an object"]),
    ('<tool_call>{"name": "f"', [], ["has no closing </tool_call>"]),
    ("the answer is 3", [], []),
])
def test_tool_calls_in_the_templates_format_and_the_ones_it_cannot_read(text, calls, errors):
    parser = ToolCallParser(_Tokenizer("{{ '<tool_call>' }}"))
    assert parser.format == "hermes"
    got, errs = parser.parse(text)
    assert [(c.name, c.arguments) for c in got] == calls
    assert len(errs) == len(errors) and all(e in m for e, m in zip(errors, errs))


def test_the_environments_pattern_without_a_template_format():
    parser = ToolCallParser(_Tokenizer(None), pattern=r"CALL\((.*?)\)END")
    assert parser.format == "pattern"
    got, errs = parser.parse('x CALL({"name": "calculate", "arguments": {"expression": "2*3"}})END y CALL(oops)END')
    assert [(c.name, c.arguments) for c in got] == [("calculate", {"expression": "2*3"})] and len(errs) == 1
    assert ToolCallParser(_Tokenizer(None)).parse("CALL(x)END") == ([], [])  # no format: the environment reads the text


def test_the_calculator_evaluates_arithmetic_and_refuses_the_rest():
    assert evaluate("(12 + 3) * 7") == 105 and evaluate("7 / 2") == 3.5 and evaluate("-2 ** 3") == -8
    for bad, why in [("__import__('os')", "only numbers"), ("1/0", "division by zero"), ("9 ** 999", "too large"),
                     ("1 +", "cannot parse"), ("1" * 300, "longer than")]:
        with pytest.raises(CalcError, match=why):
            evaluate(bad)


class NoStep:
    def reset(self, prompt):
        return None


@pytest.mark.parametrize("target, message", [
    ("no_such_pkg.envs.Env", "cannot be imported"),
    ("test_multi_turn.NoStep", "has no step method"),
    ("test_multi_turn.transcript", "not a class"),
])
def test_an_environment_that_cannot_be_used_is_named_at_start_up(target, message):
    with pytest.raises(ConfigError, match=message) as err:
        import_env_target(RolloutConfig(env={"_target_": target}))
    assert target in str(err.value)
