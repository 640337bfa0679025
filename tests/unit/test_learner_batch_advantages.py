"""learner.batch_advantages (partial groups, KL as reward, global whitening) and learner.stats."""

from __future__ import annotations

import math

import pytest
import torch
from hydra import compose, initialize_config_module

from learner import advantages as A
from learner import batch_advantages as BA
from learner.masked import masked_whiten
from learner.stats import MetricSums, RunningMoments
from rlhf_core.config import AlgoConfig, register_configs, to_object

# Three groups: a full one of 4, a partial one of 3 (one sample dead-lettered), a lone sample.
REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 5.0])
SIZES = torch.tensor([4, 3, 1])
S3 = 1 / math.sqrt(3)  # unbiased std of both [1,0,0,1] and [1,0,1]


def test_grpo_with_partial_groups():
    # group 1: mean 0.5, std sqrt(1/3) -> +-0.5 / 0.57735 = +-0.86603
    # group 2: mean 2/3, std sqrt(1/3) -> [1/3, -2/3, 1/3] / 0.57735 = [0.57735, -1.1547, 0.57735]
    # group 3 (one sample): no baseline -> 0
    adv = BA.group_relative_advantages("grpo", REWARDS, SIZES)
    expect = [0.5 / S3, -0.5 / S3, -0.5 / S3, 0.5 / S3, (1 / 3) / S3, (-2 / 3) / S3, (1 / 3) / S3, 0.0]
    torch.testing.assert_close(adv, torch.tensor(expect), atol=1e-5, rtol=1e-5)


def test_dr_grpo_and_rloo_with_partial_groups():
    # Dr.GRPO: r - group mean
    torch.testing.assert_close(BA.group_relative_advantages("dr_grpo", REWARDS, SIZES),
                               torch.tensor([0.5, -0.5, -0.5, 0.5, 1 / 3, -2 / 3, 1 / 3, 0.0]))
    # RLOO: r_i - mean of the others: group 1: 1 - 1/3 = 2/3, 0 - 2/3 = -2/3;
    # group 2 [1, 0, 1]: 1 - 0.5 = 0.5, 0 - 1 = -1; lone sample: 0
    torch.testing.assert_close(BA.group_relative_advantages("rloo", REWARDS, SIZES),
                               torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0.5, -1.0, 0.5, 0.0]))


def test_equal_groups_match_the_pure_estimators():
    r = torch.tensor([0.3, 0.9, 0.1, 0.4, 0.8, 0.8, 0.2, 0.0])
    sizes = torch.tensor([4, 4])
    torch.testing.assert_close(BA.group_relative_advantages("grpo", r, sizes), A.group_advantages(r, 4))
    torch.testing.assert_close(BA.group_relative_advantages("rloo", r, sizes), A.rloo_advantages(r, 4))


def test_dpo_pairs_skip_lone_samples_and_ties():
    # group 1 [1,0,0,1]: best = first max (row 0), worst = first min (row 1)
    # group 2 [1,0,1]: rows 4 and 5; lone sample: no pair; a tied group: no pair
    r = torch.cat([REWARDS, torch.tensor([2.0, 2.0])])
    chosen, rejected = BA.dpo_pairs(r, torch.tensor([4, 3, 1, 2]))
    assert chosen.tolist() == [0, 4] and rejected.tolist() == [1, 5]


def test_group_sizes_must_cover_the_rewards():
    with pytest.raises(ValueError, match="sum to 7 but there are 8"):
        BA.group_relative_advantages("grpo", REWARDS, torch.tensor([4, 3]))


def test_reverse_cumsum_over_real_tokens():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, float("nan"), 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    # row 0: [1+2+3, 2+3, 3]; row 1: padding (even NaN) is ignored
    assert BA.reverse_cumsum(x, mask).tolist() == [[6.0, 5.0, 3.0], [4.0, 0.0, 0.0]]


def test_global_whiten_alone_is_masked_whiten():
    torch.manual_seed(0)
    x, mask = torch.randn(4, 6), torch.rand(4, 6) > 0.3
    torch.testing.assert_close(BA.global_whiten(x, mask), masked_whiten(x, mask), rtol=0, atol=0)


def test_global_whiten_uses_the_statistics_of_every_rank():
    # two "ranks" holding halves of the batch, summed by a fake all-reduce that adds the
    # other rank's contribution: the result equals whitening the whole batch at once
    torch.manual_seed(1)
    x, mask = torch.randn(4, 5), torch.rand(4, 5) > 0.2
    whole = masked_whiten(x, mask)
    halves = [(x[:2], mask[:2]), (x[2:], mask[2:])]

    def run(me: int):
        other_x, other_m = halves[1 - me]
        calls = iter([
            lambda t: t.add_(torch.stack([(other_x * other_m).sum(), other_m.sum().float()])),
            None,  # the squared deviations, filled below once the mean is known
        ])
        mean = (x * mask).sum() / mask.sum()
        sq_other = (((other_x - mean) ** 2) * other_m).sum()

        def fake(t):
            f = next(calls)
            return f(t) if f else t.add_(sq_other)

        return BA.global_whiten(halves[me][0], halves[me][1], fake)

    torch.testing.assert_close(torch.cat([run(0), run(1)]), whole, atol=1e-6, rtol=1e-5)


def test_group_advantage_with_kl_penalty_as_reward():
    # A_t = A_seq - kl_coef * sum_{t'>=t} kl_t': A_seq = 1, kl = [0.1, 0.2, 0.3], coef 0.5
    # -> [1 - 0.5*0.6, 1 - 0.5*0.5, 1 - 0.5*0.3] = [0.7, 0.75, 0.85]
    algo = AlgoConfig(estimator="grpo", kl_coef=0.5, kl_mode="reward")
    mask = torch.tensor([[1, 1, 1]])
    adv, ret = BA.compute_advantages(algo, torch.tensor([0.0]), mask, group_adv=torch.tensor([1.0]),
                                    kl=torch.tensor([[0.1, 0.2, 0.3]]))
    torch.testing.assert_close(adv, torch.tensor([[0.7, 0.75, 0.85]]))
    assert ret is None


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
    kl = BA.kl_per_token(algo, old, ref, mask)
    torch.testing.assert_close(kl, torch.tensor([[0.5, -1.0, 0.0], [0.5, 0.0, 0.0]]))
    seq_rewards = torch.tensor([1.0, -1.0])
    # row 0: -0.01 * 0.5 = -0.005, -0.01 * -1.0 = +0.01, last: 1.0 - 0.01 * 0.0 = 1.0
    # row 1: -0.005, last: -1.0 - 0.01 * 0.0 = -1.0, padding 0
    expected = torch.tensor([[-0.005, 0.01, 1.0], [-0.005, -1.0, 0.0]])
    torch.testing.assert_close(BA.token_rewards(algo, seq_rewards, mask, kl), expected)
    # gamma 1: returns are the reverse sums, row 0 [1.005, 1.01, 1.0], row 1 [-1.005, -1.0],
    # whitened over the 5 real tokens of the batch
    adv, _ = BA.compute_advantages(algo, seq_rewards, mask, kl=kl)
    returns = torch.tensor([[1.005, 1.01, 1.0], [-1.005, -1.0, 0.0]])
    torch.testing.assert_close(adv, masked_whiten(returns, mask))


def test_gae_and_reinforce_pp_paths_match_the_pure_functions():
    torch.manual_seed(2)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    r, values = torch.tensor([1.0, -0.5]), torch.randn(2, 4)
    algo = AlgoConfig(estimator="gae", gamma=0.9, lam=0.8)
    adv, ret = BA.compute_advantages(algo, r, mask, values=values)
    ref_adv, ref_ret = A.gae(A.token_rewards(r, mask), values, mask, 0.9, 0.8)
    torch.testing.assert_close(adv, ref_adv)
    torch.testing.assert_close(ret, ref_ret)
    algo = AlgoConfig(estimator="reinforce_pp", gamma=1.0)
    adv, _ = BA.compute_advantages(algo, r, mask)
    torch.testing.assert_close(adv, A.reinforce_pp_advantages(r, mask)[0])


def test_vtrace_replaces_the_critic_targets_only():
    mask = torch.tensor([[1, 1, 1]])
    r, values = torch.tensor([1.0]), torch.tensor([[0.2, 0.4, 0.6]])
    behav, prox = torch.log(torch.tensor([[0.5, 0.5, 0.5]])), torch.log(torch.tensor([[0.25, 0.5, 1.0]]))
    algo = AlgoConfig(estimator="gae", gamma=1.0, lam=1.0, vtrace=True, vtrace_rho_bar=1.0, vtrace_c_bar=1.0)
    adv, ret = BA.compute_advantages(algo, r, mask, values=values, behav_logp=behav, prox_logp=prox)
    # advantages stay GAE: lam = gamma = 1 -> A_t = R - V_t = [0.8, 0.6, 0.4]
    torch.testing.assert_close(adv, torch.tensor([[0.8, 0.6, 0.4]]))
    vs, _ = A.vtrace(behav, prox, A.token_rewards(r, mask), values, None, mask, 1.0, 1.0, 1.0)
    torch.testing.assert_close(ret, vs)
    assert not torch.allclose(ret, adv + values)  # the targets differ from GAE's returns


def test_normalize_advantages_whitens():
    algo = AlgoConfig(estimator="dr_grpo", normalize_advantages=True)
    mask = torch.tensor([[1, 1], [1, 0]])
    adv, _ = BA.compute_advantages(algo, torch.zeros(2), mask, group_adv=torch.tensor([1.0, -2.0]))
    # tokens [1, 1, -2]: mean 0, var 2 -> [1, 1, -2] / sqrt(2)
    torch.testing.assert_close(adv, torch.tensor([[1.0, 1.0], [-2.0, 0.0]]) / math.sqrt(2.0 + 1e-8))


def test_running_moments_merge_batches_exactly():
    data = torch.tensor([1.0, 2.0, 4.0, 8.0, 16.0, 3.0])
    rm = RunningMoments()
    rm.update(data[:2])
    rm.update(data[2:5])
    rm.update(data[5:])
    assert rm.count == 6
    assert rm.mean == pytest.approx(float(data.double().mean()), abs=1e-12)
    assert rm.var == pytest.approx(float(data.double().var()), abs=1e-12)  # unbiased
    clone = RunningMoments()
    clone.load_state_dict(rm.state_dict())
    assert clone.state_dict() == rm.state_dict()
    # normalise with the statistics: (x - mean) / (std + eps)
    # mean 34/6, one std above it normalises to 1
    x = torch.tensor([34 / 6, 34 / 6 + float(data.double().std())], dtype=torch.float64)
    torch.testing.assert_close(rm.normalize(x, 0.0), torch.tensor([0.0, 1.0], dtype=torch.float64))


def test_metric_sums_weighted_means_max_and_reduce():
    m = MetricSums()
    m.add("a", 1.0, 1.0)
    m.add("a", 4.0, 3.0)  # (1 + 12) / 4 = 3.25
    m.add_max("b", 2.0)
    m.add_max("b", 1.0)
    m.set("c", 7.0)
    assert m.result() == {"a": 3.25, "b": 2.0, "c": 7.0}
    # a second "rank" with a = 5 (weight 4) and b = 9: reduce sums and maxes
    m.reduce(lambda t: t.add_(torch.tensor([20.0, 4.0], dtype=torch.float64)),
             lambda t: t.copy_(torch.maximum(t, torch.tensor([9.0], dtype=torch.float64))))
    assert m.result() == {"a": (13.0 + 20.0) / 8.0, "b": 9.0, "c": 7.0}


@pytest.mark.parametrize("as_if_on_gpu", [False, True])
def test_metric_sums_take_tensors_and_read_device_ones_at_the_end(monkeypatch, as_if_on_gpu):
    # Values and weights may be 0-d tensors. On a GPU they wait (with everything recorded after
    # them, in order) until the result is asked for; here every tensor is treated as such a one
    # when as_if_on_gpu, so the waiting path runs on this CPU.
    import learner.stats

    if as_if_on_gpu:
        monkeypatch.setattr(learner.stats, "_on_device", lambda x: isinstance(x, torch.Tensor))
    m = MetricSums()
    m.set("c", 1.0)
    m.add("a", torch.tensor(2.0), torch.tensor(3))  # 2 * 3
    m.add("a", 4.0, torch.tensor(1, dtype=torch.int64))  # + 4 * 1 = 10, weight 4: 2.5
    m.add_max("b", torch.tensor(-1.0))
    m.add_max("b", torch.tensor(-3.0))  # max -1
    m.set("c", torch.tensor(5.0))
    m.set("c", 7.0)  # recorded last: wins over the tensor before it, waiting or not
    assert len(m._pending) == (6 if as_if_on_gpu else 0)
    assert m.result() == {"a": 2.5, "b": -1.0, "c": 7.0}
    m.add("a", torch.tensor(6.5), 4.0)  # recorded after a read: (10 + 26) / 8 = 4.5
    assert m.result()["a"] == 4.5
