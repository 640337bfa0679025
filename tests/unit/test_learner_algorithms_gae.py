"""learner.algorithms.gae: GAE, V-trace and the clipped value loss (tiny tensors, arithmetic in
the comments, and direct evaluations of the papers' formulas), and the family's advantages."""

from __future__ import annotations

import math

import pytest
import torch

from learner.algorithms.core import token_rewards
from learner.algorithms.gae import advantages, gae, value_loss, vtrace
from learner.algorithms.policy_gradient import AdvantageInputs
from learner_helpers import T, close, random_episode_batch  # noqa: E402
from rlhf_core.config import AlgoConfig

NAN = float("nan")


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
        rewards, values, _, _, mask = random_episode_batch(0)
        adv, ret = gae(rewards, values, mask, gamma, lam)
        ref_adv, ref_ret = _gae_loop(rewards, values, mask, gamma, lam)
        close(adv, ref_adv, atol=1e-12)
        close(ret, ref_ret, atol=1e-12)

    def test_bad_gamma(self):
        with pytest.raises(ValueError, match="gamma.*1.5"):
            gae(T([[0.0]]), T([[0.0]]), T([[1]]), gamma=1.5)


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
        rewards, values, behav, target, mask = random_episode_batch(1)
        bootstrap = torch.randn(mask.shape[0], dtype=torch.float64, generator=torch.Generator().manual_seed(9))
        vs, adv = vtrace(behav, target, rewards, values, bootstrap, mask, gamma, rho_bar, c_bar)
        ref_vs, ref_adv = _vtrace_loop(behav, target, rewards, values, bootstrap, mask, gamma, rho_bar, c_bar)
        close(vs, ref_vs, atol=1e-10)
        close(adv, ref_adv, atol=1e-10)

    def test_on_policy_reduces_to_discounted_return(self):
        # pi == mu, rho_bar = c_bar = 1: v_s is the Monte-Carlo return = GAE(lam=1) return
        rewards, values, behav, _, mask = random_episode_batch(2)
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


# --------------------------------------------------------------------------- #
# Critic
# --------------------------------------------------------------------------- #
class TestValueLoss:
    # token: value, old, return (clip 0.2)
    #   0: 1.0, 1.0, 1.5 -> clipped value 1.0; (0.5)^2 = 0.25 both         -> 0.25
    #   1: 2.0, 1.0, 1.0 -> clipped 1.2; max(1.0, 0.04) = 1.0 (unclipped)   -> 1.0
    #   2: 0.5, 1.0, 0.0 -> clipped 0.8; max(0.25, 0.64) = 0.64 (clipped)   -> 0.64
    #   3: masked garbage
    V, OLD, RET = [[1.0, 2.0, 0.5, NAN]], [[1.0, 1.0, 1.0, 1e9]], [[1.5, 1.0, 0.0, NAN]]
    MASK = [[1, 1, 1, 0]]

    def test_clipped(self):
        values = T(self.V).requires_grad_()
        loss, stats = value_loss(values, T(self.OLD), T(self.RET), T(self.MASK), clip_eps=0.2)
        close(loss, 0.5 * (0.25 + 1.0 + 0.64) / 3)  # 0.315
        close(stats.clip_frac, 1 / 3)
        close(stats.value_mean, 3.5 / 3)
        loss.backward()
        # 0.5 * 2 * (v - R) / 3 where unclipped; 0 on the clipped token 2 and the masked one
        close(values.grad, [[-0.5 / 3, 1.0 / 3, 0.0, 0.0]])

    def test_unclipped(self):
        loss, stats = value_loss(T(self.V), T(self.OLD), T(self.RET), T(self.MASK), clip_eps=None)
        close(loss, 0.5 * (0.25 + 1.0 + 0.25) / 3)  # 0.25
        close(stats.clip_frac, 0.0)

    def test_explained_variance(self):
        # perfect prediction -> 1; here Var[R - V] happens to equal Var[R] (7/18) -> 0
        _, stats = value_loss(T(self.RET), T(self.RET), T(self.RET), T(self.MASK))
        close(stats.explained_variance, 1.0)
        _, stats = value_loss(T(self.V), T(self.OLD), T(self.RET), T(self.MASK))
        close(stats.explained_variance, 0.0)

    def test_bad_clip(self):
        with pytest.raises(ValueError, match="value_clip.*-0.2"):
            value_loss(T(self.V), T(self.OLD), T(self.RET), T(self.MASK), clip_eps=-0.2)


def test_vtrace_replaces_the_critic_targets_only():
    mask = torch.tensor([[1, 1, 1]])
    r, values = torch.tensor([1.0]), torch.tensor([[0.2, 0.4, 0.6]])
    behav, prox = torch.log(torch.tensor([[0.5, 0.5, 0.5]])), torch.log(torch.tensor([[0.25, 0.5, 1.0]]))
    algo = AlgoConfig(estimator="gae", gamma=1.0, lam=1.0, vtrace=True, vtrace_rho_bar=1.0, vtrace_c_bar=1.0)
    adv, ret = advantages(algo, AdvantageInputs(r, torch.tensor([1]), torch.arange(1), mask, values=values, behav=behav,
                                                prox=prox))
    # advantages stay GAE: lam = gamma = 1 -> A_t = R - V_t = [0.8, 0.6, 0.4]
    torch.testing.assert_close(adv, torch.tensor([[0.8, 0.6, 0.4]]))
    vs, _ = vtrace(behav, prox, token_rewards(r, mask), values, None, mask, 1.0, 1.0, 1.0)
    torch.testing.assert_close(ret, vs)
    assert not torch.allclose(ret, adv + values)  # the targets differ from GAE's returns


def test_the_batch_path_matches_the_pure_functions():
    torch.manual_seed(2)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    r, values = torch.tensor([1.0, -0.5]), torch.randn(2, 4)
    algo = AlgoConfig(estimator="gae", gamma=0.9, lam=0.8)
    adv, ret = advantages(algo, AdvantageInputs(r, torch.tensor([1, 1]), torch.arange(2), mask, values=values))
    ref_adv, ref_ret = gae(token_rewards(r, mask), values, mask, 0.9, 0.8)
    torch.testing.assert_close(adv, ref_adv)
    torch.testing.assert_close(ret, ref_ret)
