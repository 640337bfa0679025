"""learner.algorithms.reinforce_pp: discounted returns whitened over the batch, and the preset's
k1 KL in every token's reward."""

from __future__ import annotations

import math

import torch
from hydra import compose, initialize_config_module

from learner.algorithms.core import global_whiten, kl_estimate, token_rewards
from learner.algorithms.policy_gradient import AdvantageInputs
from learner.algorithms.reinforce_pp import advantages, discounted_returns
from learner_helpers import T, close, random_episode_batch  # noqa: E402
from rlhf_core.config import AlgoConfig, register_configs, to_object

NAN = float("nan")


class TestReinforcePP:
    def test_discounted_returns(self):
        # gamma 0.5, reward 1 on the last token: G = 0.25, 0.5, 1
        ret = discounted_returns(T([[0.0, 0.0, 1.0]]), T([[1, 1, 1]]), gamma=0.5)
        close(ret, [[0.25, 0.5, 1.0]])
        # a masked hole is skipped, not discounted: still 0.25, (0), 0.5, 1
        ret = discounted_returns(T([[0.0, NAN, 0.0, 1.0]]), T([[1, 0, 1, 1]]), gamma=0.5)
        close(ret, [[0.25, 0.0, 0.5, 1.0]])

    def test_global_whitening(self):
        # returns over real tokens 1, 1, 1, 0, 0: mean 0.6, biased var 0.24
        # -> (1 - 0.6) / sqrt(0.24) = 0.8165, (0 - 0.6) / sqrt(0.24) = -1.2247
        ret = discounted_returns(T([1.0, 0.0]), T([[1, 1, 1], [1, 1, 0]]), gamma=1.0)
        close(ret, [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
        adv = global_whiten(ret, T([[1, 1, 1], [1, 1, 0]]))
        hi, lo = 0.4 / math.sqrt(0.24), -0.6 / math.sqrt(0.24)
        close(adv, [[hi, hi, hi], [lo, lo, 0.0]])

    def test_seq_and_token_reward_forms_agree(self):
        rewards, _, _, _, mask = random_episode_batch(3)
        seq = torch.randn(mask.shape[0], dtype=torch.float64)
        r1 = discounted_returns(seq, mask, gamma=0.9)
        r2 = discounted_returns(token_rewards(seq, mask), mask, gamma=0.9)
        assert torch.equal(r1, r2)
        assert torch.isfinite(global_whiten(r1, mask)).all()


def test_reinforce_pp_preset_puts_the_k1_kl_into_the_token_rewards():
    # REINFORCE++ (Hu 2025, eq. 9): r_t = -beta * log(pi_old / pi_SFT) on every token, plus the
    # sequence reward at the last one. The learner's pi_old is pi_prox; the preset's beta is 0.01.
    register_configs()
    with initialize_config_module(config_module="conf", version_base="1.3"):
        algo = to_object(compose(config_name="config", overrides=["experiment=reinforce_pp"])).algo
    assert (algo.estimator, algo.kl_mode, algo.kl_estimator, algo.kl_coef) == ("reinforce_pp", "reward", "k1", 0.01)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]]).bool()
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, 0.0]])
    ref = torch.tensor([[-1.5, -1.0, -0.5], [-0.8, -1.2, 0.0]])
    # k1 = log pi_old - log pi_ref: row 0 [0.5, -1.0, 0.0], row 1 [0.5, 0.0, (pad)]
    # (k3 would give e^-0.5 + 0.5 - 1 = 0.1065 and e^1 - 1 - 1 = 0.7183 for the first two)
    kl = kl_estimate(old, ref, mask, kind=algo.kl_estimator)
    torch.testing.assert_close(kl, torch.tensor([[0.5, -1.0, 0.0], [0.5, 0.0, 0.0]]))
    seq_rewards = torch.tensor([1.0, -1.0])
    # row 0: -0.01 * 0.5 = -0.005, -0.01 * -1.0 = +0.01, last: 1.0 - 0.01 * 0.0 = 1.0
    # row 1: -0.005, last: -1.0 - 0.01 * 0.0 = -1.0, padding 0
    expected = torch.tensor([[-0.005, 0.01, 1.0], [-0.005, -1.0, 0.0]])
    torch.testing.assert_close(token_rewards(seq_rewards, mask, kl, algo.kl_coef), expected)
    # gamma 1: returns are the reverse sums, row 0 [1.005, 1.01, 1.0], row 1 [-1.005, -1.0],
    # whitened over the 5 real tokens of the batch
    adv, _ = advantages(algo, AdvantageInputs(seq_rewards, torch.tensor([1, 1]), torch.arange(2), mask, kl=kl))
    returns = torch.tensor([[1.005, 1.01, 1.0], [-1.005, -1.0, 0.0]])
    torch.testing.assert_close(adv, global_whiten(returns, mask))


def test_the_batch_path_matches_the_pure_function():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    r = torch.tensor([1.0, -0.5])
    algo = AlgoConfig(estimator="reinforce_pp", gamma=1.0)
    adv, _ = advantages(algo, AdvantageInputs(r, torch.tensor([1, 1]), torch.arange(2), mask))
    torch.testing.assert_close(adv, global_whiten(discounted_returns(r, mask), mask))
