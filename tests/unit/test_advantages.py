"""Unit tests for learner/advantages.py: worked numbers plus loop references."""

from __future__ import annotations

import math

import pytest
import torch

from learner.advantages import (
    gae,
    group_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
    select_dpo_pairs,
    token_rewards,
    vtrace,
)

from learner_helpers import T, close  # noqa: E402

NAN = float("nan")




def _random_episode_batch(seed: int, b: int = 5, t: int = 8):
    """Random rewards/values/log-probs; masks with holes, right padding and an empty row."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda: torch.randn(b, t, generator=g, dtype=torch.float64)  # noqa: E731
    rewards, values = rnd(), rnd()
    behav = -torch.rand(b, t, generator=g, dtype=torch.float64) * 2
    target = behav + 0.5 * rnd()
    mask = torch.rand(b, t, generator=g) > 0.25
    mask[0] = True  # a full row
    mask[1, 5:] = False  # right padding
    mask[2] = False  # no real token at all
    for x in (rewards, values, behav, target):
        x[~mask] = NAN
    return rewards, values, behav, target, mask


# --------------------------------------------------------------------------- #
# GAE
# --------------------------------------------------------------------------- #
def _gae_loop(rewards, values, mask, gamma, lam):
    """Plain double loop over the real tokens of each row (textbook GAE)."""
    adv = torch.zeros_like(rewards)
    for b in range(rewards.shape[0]):
        idx = [t for t in range(rewards.shape[1]) if mask[b, t]]
        last = 0.0
        for k in reversed(range(len(idx))):
            t = idx[k]
            next_v = values[b, idx[k + 1]].item() if k + 1 < len(idx) else 0.0
            delta = rewards[b, t].item() + gamma * next_v - values[b, t].item()
            last = delta + gamma * lam * last
            adv[b, t] = last
    returns = torch.where(mask, adv + torch.nan_to_num(values), torch.zeros_like(adv))
    return adv, returns


class TestGAE:
    def test_worked_example(self):
        # gamma 0.9, lam 0.5, V = [0.5, 0.6, 0.7], reward 1 on the last token
        # t2: delta = 1 - 0.7 = 0.3                  A2 = 0.3
        # t1: delta = 0.9*0.7 - 0.6 = 0.03           A1 = 0.03 + 0.45*0.3   = 0.165
        # t0: delta = 0.9*0.6 - 0.5 = 0.04           A0 = 0.04 + 0.45*0.165 = 0.11425
        # returns = A + V = 0.61425, 0.765, 1.0
        adv, ret = gae(T([[0.0, 0.0, 1.0]]), T([[0.5, 0.6, 0.7]]), T([[1, 1, 1]]), gamma=0.9, lam=0.5)
        close(adv, [[0.11425, 0.165, 0.3]])
        close(ret, [[0.61425, 0.765, 1.0]])

    def test_masked_hole_and_padding_are_transparent(self):
        # same episode with a masked hole at t=1 and padding at t=4 holding garbage
        r = T([[0.0, NAN, 0.0, 1.0, 1e9]])
        v = T([[0.5, 1e9, 0.6, 0.7, NAN]])
        adv, ret = gae(r, v, T([[1, 0, 1, 1, 0]]), gamma=0.9, lam=0.5)
        close(adv, [[0.11425, 0.0, 0.165, 0.3, 0.0]])
        close(ret, [[0.61425, 0.0, 0.765, 1.0, 0.0]])

    @pytest.mark.parametrize("gamma, lam", [(1.0, 0.95), (0.9, 0.7), (0.99, 1.0)])
    def test_matches_python_loop(self, gamma, lam):
        rewards, values, _, _, mask = _random_episode_batch(0)
        adv, ret = gae(rewards, values, mask, gamma, lam)
        ref_adv, ref_ret = _gae_loop(rewards, values, mask, gamma, lam)
        close(adv, ref_adv, atol=1e-12)
        close(ret, ref_ret, atol=1e-12)

    def test_bad_gamma(self):
        with pytest.raises(ValueError, match="gamma.*1.5"):
            gae(T([[0.0]]), T([[0.0]]), T([[1]]), gamma=1.5)


# --------------------------------------------------------------------------- #
# Group baselines
# --------------------------------------------------------------------------- #
class TestGroupAdvantages:
    REWARDS = [1.0, 2.0, 3.0, 0.0, 0.0, 4.0]

    def test_grpo(self):
        # group 0: mean 2, unbiased std 1 -> -1, 0, 1
        # group 1: mean 4/3, unbiased std sqrt(16/3) = 2.3094 -> -0.57735, -0.57735, 1.1547
        adv = group_advantages(T(self.REWARDS), group_size=3)
        s = math.sqrt(16 / 3)
        close(adv, [-1.0, 0.0, 1.0, -4 / 3 / s, -4 / 3 / s, 8 / 3 / s], atol=1e-5)

    def test_dr_grpo_no_std(self):
        adv = group_advantages(T(self.REWARDS), group_size=3, scale_std=False)
        close(adv, [-1.0, 0.0, 1.0, -4 / 3, -4 / 3, 8 / 3])

    def test_constant_group_is_zero(self):
        close(group_advantages(T([5.0, 5.0, 1.0, 3.0]), group_size=2), [0.0, 0.0, -1 / math.sqrt(2), 1 / math.sqrt(2)], atol=1e-5)

    @pytest.mark.parametrize("k", [3, 7, 16])
    @pytest.mark.parametrize("value", [0.3, 3.3, 77.7, 1000.1])
    def test_a_group_of_equal_rewards_has_advantage_exactly_zero(self, k, value):
        # float32 mean of three 1000.1s is 1000.1 - 6.1e-5 (one ulp off), so each deviation is
        # 6.1e-5, the unbiased std ~7.5e-5, and 6.1e-5 / (7.5e-5 + 1e-6) = 0.80 for every sample:
        # the whole group pushed one way. Equal rewards carry no signal: exactly 0, in float32 out.
        adv = group_advantages(torch.full((2 * k,), value), group_size=k)
        assert adv.dtype == torch.float32 and torch.equal(adv, torch.zeros(2 * k))

    def test_not_divisible(self):
        with pytest.raises(ValueError, match="N=5.*group_size=2"):
            group_advantages(torch.zeros(5), group_size=2)


class TestRLOO:
    def test_worked_example(self):
        # sum 12; baseline_i = (12 - r_i) / 3 = 11/3, 10/3, 3, 2
        adv = rloo_advantages(T([1.0, 2.0, 3.0, 6.0]), group_size=4)
        close(adv, [1 - 11 / 3, 2 - 10 / 3, 0.0, 4.0])
        # two groups of 2: baseline is the other sample
        close(rloo_advantages(T([1.0, 3.0, 5.0, 5.0]), group_size=2), [-2.0, 2.0, 0.0, 0.0])

    def test_errors(self):
        with pytest.raises(ValueError, match="group_size.*2.*1"):
            rloo_advantages(torch.zeros(4), group_size=1)
        with pytest.raises(ValueError, match="N=6.*group_size=4"):
            rloo_advantages(torch.zeros(6), group_size=4)


class TestSelectDPOPairs:
    def test_best_vs_worst(self):
        rewards = T([1.0, 3.0, 2.0, 5.0, 5.0, 5.0, 0.0, -1.0, 4.0])
        chosen, rejected, valid = select_dpo_pairs(rewards, group_size=3)
        assert chosen.tolist() == [1, 3, 8]
        assert rejected.tolist() == [0, 3, 7]
        assert valid.tolist() == [True, False, True]  # group 1 is a three-way tie

    def test_only_eligible_samples_are_paired(self):
        # group 0 [1, 3, 2] without row 1: best row 2 (2), worst row 0 (1);
        # group 1 [0, -1, 4] with row 8 alone eligible: best = worst = row 8, no pair;
        # group 2 [7, 6, 5], none eligible: no pair
        rewards = T([1.0, 3.0, 2.0, 0.0, -1.0, 4.0, 7.0, 6.0, 5.0])
        eligible = torch.tensor([1, 0, 1, 0, 0, 1, 0, 0, 0], dtype=torch.bool)
        chosen, rejected, valid = select_dpo_pairs(rewards, group_size=3, eligible=eligible)
        assert valid.tolist() == [True, False, False]
        assert (chosen[0].item(), rejected[0].item()) == (2, 0)

    def test_errors(self):
        with pytest.raises(ValueError, match="N=8.*group_size=3"):
            select_dpo_pairs(torch.zeros(8), 3)
        with pytest.raises(ValueError, match="group_size must be >= 2, got 1"):
            select_dpo_pairs(torch.zeros(4), 1)


# --------------------------------------------------------------------------- #
# Token rewards / REINFORCE++
# --------------------------------------------------------------------------- #
class TestTokenRewards:
    MASK = [[1, 1, 1, 0], [1, 0, 1, 0], [0, 0, 0, 0]]

    def test_reward_on_last_real_token(self):
        out = token_rewards(T([1.0, 2.0, 3.0]), T(self.MASK))
        # row 2 has no real token: its reward is dropped
        close(out, [[0, 0, 1, 0], [0, 0, 2, 0], [0, 0, 0, 0]])

    def test_kl_penalty(self):
        kl = T([[0.1, 0.2, 0.3, NAN], [0.5, NAN, -0.1, 9.0], [1.0, 1.0, 1.0, 1.0]])
        out = token_rewards(T([1.0, 2.0, 3.0]), T(self.MASK), kl=kl, kl_coef=0.5)
        # row 0: -0.05, -0.1, -0.15 + 1; row 1: -0.25, -, 0.05 + 2
        close(out, [[-0.05, -0.1, 0.85, 0], [-0.25, 0, 2.05, 0], [0, 0, 0, 0]])

    def test_errors(self):
        with pytest.raises(ValueError, match="kl_coef.*-1"):
            token_rewards(T([1.0]), T([[1]]), kl_coef=-1.0)
        with pytest.raises(ValueError, match=r"\[B\]=\(1,\).*\(2,\)"):
            token_rewards(T([1.0, 2.0]), T([[1]]))


class TestReinforcePP:
    def test_discounted_returns(self):
        # gamma 0.5, reward 1 on the last token: G = 0.25, 0.5, 1
        _, ret = reinforce_pp_advantages(T([[0.0, 0.0, 1.0]]), T([[1, 1, 1]]), gamma=0.5)
        close(ret, [[0.25, 0.5, 1.0]])
        # a masked hole is skipped, not discounted: still 0.25, (0), 0.5, 1
        _, ret = reinforce_pp_advantages(T([[0.0, NAN, 0.0, 1.0]]), T([[1, 0, 1, 1]]), gamma=0.5)
        close(ret, [[0.25, 0.0, 0.5, 1.0]])

    def test_global_whitening(self):
        # returns over real tokens 1, 1, 1, 0, 0: mean 0.6, biased var 0.24
        # -> (1 - 0.6) / sqrt(0.24) = 0.8165, (0 - 0.6) / sqrt(0.24) = -1.2247
        adv, ret = reinforce_pp_advantages(T([1.0, 0.0]), T([[1, 1, 1], [1, 1, 0]]), gamma=1.0)
        close(ret, [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
        hi, lo = 0.4 / math.sqrt(0.24), -0.6 / math.sqrt(0.24)
        close(adv, [[hi, hi, hi], [lo, lo, 0.0]])

    def test_seq_and_token_reward_forms_agree(self):
        rewards, _, _, _, mask = _random_episode_batch(3)
        seq = torch.randn(mask.shape[0], dtype=torch.float64)
        a1, r1 = reinforce_pp_advantages(seq, mask, gamma=0.9)
        a2, r2 = reinforce_pp_advantages(token_rewards(seq, mask), mask, gamma=0.9)
        assert torch.equal(a1, a2) and torch.equal(r1, r2)
        assert torch.isfinite(a1).all()


# --------------------------------------------------------------------------- #
# V-trace
# --------------------------------------------------------------------------- #
def _vtrace_loop(behav, target, rewards, values, bootstrap, mask, gamma, rho_bar, c_bar):
    """Direct evaluation of IMPALA eq. (1) over the real tokens of each row:
    v_s = V_s + sum_{t=s}^{n-1} gamma^{t-s} (prod_{i=s}^{t-1} c_i) delta_t."""
    vs_out = torch.zeros_like(rewards)
    adv_out = torch.zeros_like(rewards)
    for b in range(rewards.shape[0]):
        idx = [t for t in range(rewards.shape[1]) if mask[b, t]]
        n = len(idx)
        boot = bootstrap[b].item()
        V = [values[b, t].item() for t in idx] + [boot]
        r = [rewards[b, t].item() for t in idx]
        ratio = [math.exp(target[b, t].item() - behav[b, t].item()) for t in idx]
        rho = [min(rho_bar, x) for x in ratio]
        c = [min(c_bar, x) for x in ratio]
        delta = [rho[t] * (r[t] + gamma * V[t + 1] - V[t]) for t in range(n)]
        vs = []
        for s in range(n):
            total = 0.0
            for t in range(s, n):
                total += gamma ** (t - s) * math.prod(c[s:t]) * delta[t]
            vs.append(V[s] + total)
        vs.append(boot)
        for k, t in enumerate(idx):
            vs_out[b, t] = vs[k]
            adv_out[b, t] = rho[k] * (r[k] + gamma * vs[k + 1] - V[k])
    return vs_out, adv_out


class TestVTrace:
    @pytest.mark.parametrize("gamma, rho_bar, c_bar", [(1.0, 1.0, 1.0), (0.9, 2.0, 0.8), (0.95, 0.5, 0.5)])
    def test_matches_paper_formula(self, gamma, rho_bar, c_bar):
        rewards, values, behav, target, mask = _random_episode_batch(1)
        bootstrap = torch.randn(mask.shape[0], dtype=torch.float64, generator=torch.Generator().manual_seed(9))
        vs, adv = vtrace(behav, target, rewards, values, bootstrap, mask, gamma, rho_bar, c_bar)
        ref_vs, ref_adv = _vtrace_loop(behav, target, rewards, values, bootstrap, mask, gamma, rho_bar, c_bar)
        close(vs, ref_vs, atol=1e-10)
        close(adv, ref_adv, atol=1e-10)

    def test_on_policy_reduces_to_discounted_return(self):
        # pi == mu, rho_bar = c_bar = 1: v_s is the Monte-Carlo return = GAE(lam=1) return
        rewards, values, behav, _, mask = _random_episode_batch(2)
        vs, adv = vtrace(behav, behav, rewards, values, None, mask, gamma=0.9)
        _, ret = gae(rewards, values, mask, gamma=0.9, lam=1.0)
        close(vs, ret, atol=1e-12)

    def test_worked_truncation(self):
        # r = [0, 1], V = [0.5, 0.5], bootstrap 0, gamma 1, pi/mu = [2, 0.5]
        # rho = c = [1, 0.5] (rho_bar = c_bar = 1)
        # t1: delta = 0.5 * (1 - 0.5) = 0.25 -> vs1 = 0.75; adv1 = 0.5 * (1 + 0 - 0.5) = 0.25
        # t0: delta = 1 * (0 + 0.5 - 0.5) = 0 -> vs0 = 0.5 + 0 + 1 * 1 * 0.25 = 0.75
        #     adv0 = 1 * (0 + 0.75 - 0.5) = 0.25
        behav = T([[-1.0, -1.0]])
        target = behav + torch.log(T([[2.0, 0.5]]))
        args = (behav, target, T([[0.0, 1.0]]), T([[0.5, 0.5]]), None, T([[1, 1]]))
        vs, adv = vtrace(*args, gamma=1.0)
        close(vs, [[0.75, 0.75]])
        close(adv, [[0.25, 0.25]])
        # c_bar 0.5 cuts the trace at t0: vs0 = 0.5 + 0 + 0.5 * 0.25 = 0.625
        vs, adv = vtrace(*args, gamma=1.0, rho_bar=1.0, c_bar=0.5)
        close(vs, [[0.625, 0.75]])
        close(adv, [[0.25, 0.25]])

    def test_errors(self):
        x = T([[0.0]])
        with pytest.raises(ValueError, match="rho_bar=0.0"):
            vtrace(x, x, x, x, None, T([[1]]), rho_bar=0.0)
        with pytest.raises(ValueError, match="bootstrap_value.*\\(2,\\)"):
            vtrace(x, x, x, x, T([0.0, 0.0]), T([[1]]))
