"""learner.update.PolicyUpdater on the tiny model: recomputation, every estimator, partial
groups, micro-batch invariance, metrics with worked numbers, and the errors a user can cause.
Batches are collated as the Learner collates them (learner_helpers.batch_of)."""

from __future__ import annotations

import copy
import math
import sys
from pathlib import Path

import pytest
import torch

import learner
from factories import sample
from learner.algorithms.decoupled_policy_loss import decoupled_ppo_loss
from learner.algorithms.group_relative import group_advantages, per_group
from learner.batch import BatchError
from learner.engine_factory import make_engine
from learner.passes import MissingReferenceError
from learner.update import PolicyUpdater
from learner_helpers import batch_of, digit_reward, generate_samples, tiny_config, train
from rlhf_core import metric_names as M
from rlhf_core.config import AlgoConfig, ConfigError, validate
from rlhf_core.models import load_critic, load_policy

PROMPTS = [[20, 30], [21, 30, 4, 5, 6], [22]]  # different lengths: padding is exercised


@pytest.fixture(scope="module")
def base(tiny_model_cfg):
    return load_policy(tiny_model_cfg)


@pytest.fixture(scope="module")
def samples(base):
    return generate_samples(base, PROMPTS[:2], group_size=4, max_new_tokens=6, seed=1, reward_fn=digit_reward)


def make(base, cfg, ref=False, critic=None):
    engine = make_engine(cfg, copy.deepcopy(base))
    crit = make_engine(cfg, critic) if critic is not None else None
    return PolicyUpdater(cfg, engine, copy.deepcopy(base).eval() if ref else None, crit)


def params(module):
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def max_diff(a, b):
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_prox_logprobs_equal_behaviour_logprobs_of_the_same_weights(base, tiny_model_cfg):
    settings = {"rollout.temperature": 0.7, "rollout.top_k": 12, "rollout.top_p": 0.9}
    smp = generate_samples(base, PROMPTS, 2, 6, seed=3, temperature=0.7, top_k=12, top_p=0.9)
    up = make(base, tiny_config(tiny_model_cfg, **settings))
    batch = batch_of(up, smp)
    prox = up.passes.proximal_logprobs(batch)
    m = batch.response_mask
    assert int(m.sum()) == 36 and bool(torch.isfinite(prox[m]).all())
    torch.testing.assert_close(prox[m], batch.behaviour_logprobs[m], atol=2e-5, rtol=0)
    # recomputed with other sampling settings, they would not match: the settings matter
    other = make(base, tiny_config(tiny_model_cfg)).passes.proximal_logprobs(batch)
    assert float((other[m] - batch.behaviour_logprobs[m]).abs().max()) > 0.05


def test_updates_change_the_weights_and_lower_the_loss_on_a_fixed_batch(base, samples, tiny_model_cfg):
    up = make(base, tiny_config(tiny_model_cfg, **{"learner.lr": 3e-3}))
    batch = batch_of(up, samples)
    adv = per_group(group_advantages, batch.rewards, batch.group_sizes, 2)[:, None]
    m = batch.response_mask

    def pg_loss():  # the REINFORCE loss -sum A * log pi / tokens of the fixed batch
        return float(-(adv * up.passes.proximal_logprobs(batch))[m].sum() / m.sum())

    before_w, before = params(up.engine.module), pg_loss()
    metrics = [train(up, samples, v) for v in range(4)]
    after = pg_loss()
    assert max_diff(before_w, params(up.engine.module)) > 1e-4
    assert after < before - 0.05, (before, after)
    assert [mm["learner/optimizer_steps"] for mm in metrics] == [1.0] * 4
    # samples were generated at version 0: staleness grows with the learner version
    assert [mm["staleness/max"] for mm in metrics] == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "reinforce_pp", "gae", "dpo"])
def test_every_estimator_runs_one_exact_on_policy_step(estimator, base, samples, tiny_model_cfg):
    over = {"algo.estimator": estimator, "algo.kl_coef": 0.05}
    if estimator == "dr_grpo":
        over["algo.agg_mode"] = "seq-mean-token-sum-norm"
    if estimator == "gae":
        over["algo.kl_coef"] = 0.0
    cfg = tiny_config(tiny_model_cfg, **over)
    up = make(base, cfg, ref=True, critic=load_critic(tiny_model_cfg) if estimator == "gae" else None)
    w0 = params(up.engine.module)
    c0 = params(up.critic.module) if up.critic else None
    m = train(up, samples, 0)
    assert max_diff(w0, params(up.engine.module)) > 1e-5
    assert all(math.isfinite(v) for v in m.values()), m
    assert m["learner/optimizer_steps"] == 1.0 and m["learner/num_samples"] == 8.0
    if estimator == "dpo":
        # policy == reference before the only step: h = 0, loss = -log sigmoid(0) = ln 2
        assert m["loss/dpo"] == pytest.approx(math.log(2), abs=1e-6)
        assert m["loss/dpo_pairs"] == 2.0
        return
    # one step on samples of these very weights: ratio 1, nothing clipped, pi == pi_prox == mu
    assert m["loss/ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert m["loss/clip_frac"] == 0.0
    assert m["staleness/is_weight_mean"] == pytest.approx(1.0, abs=1e-5)
    assert m["staleness/behav_prox_kl"] == pytest.approx(0.0, abs=1e-8)
    if estimator == "gae":
        assert max_diff(c0, params(up.critic.module)) > 1e-5 and m["loss/value"] > 0
    else:
        assert m["loss/kl"] == pytest.approx(0.0, abs=1e-7)  # policy == reference at the step


@pytest.mark.parametrize("estimator", ["grpo", "gae", "dpo"])
def test_an_update_never_calls_back_into_a_learner_module_it_came_from(estimator, base, samples, tiny_model_cfg):
    """The update's path runs one way: update -> algorithm -> policy loss / passes -> lm_head ->
    engines. No learner module calls into one still on the stack below it (an algorithm asking
    the updater for log-probs, a family asking the body that called it to whiten)."""
    cfg = tiny_config(tiny_model_cfg, **{"algo.estimator": estimator, "algo.normalize_advantages": True})
    up = make(base, cfg, ref=estimator == "dpo", critic=load_critic(tiny_model_cfg) if estimator == "gae" else None)
    batch = batch_of(up, samples)
    root = Path(learner.__file__).parent
    stack, back = [], []

    def module(frame):
        path = Path(frame.f_code.co_filename)
        return str(path.relative_to(root)) if path.is_relative_to(root) else None

    def profile(frame, event, arg):
        if event == "call":
            m, here = module(frame), next((x for x in reversed(stack) if x), None)
            if m and m != here and m in stack:
                back.append(f"{here} -> {m}:{frame.f_code.co_name}")
            stack.append(m)
        elif event == "return" and stack:
            stack.pop()

    sys.setprofile(profile)
    try:
        up.update(batch, 0)
    finally:
        sys.setprofile(None)
    assert back == []


def test_partial_groups_train_and_a_lone_sample_has_no_gradient(base, samples, tiny_model_cfg):
    cfg = tiny_config(tiny_model_cfg)
    up = make(base, cfg)
    partial = samples[:4] + samples[4:7]  # groups of 4 and 3
    m = train(up, partial, 0)
    assert (m["learner/num_groups"], m["learner/partial_groups"], m["learner/num_samples"]) == (2.0, 1.0, 7.0)
    # a group of one has no baseline: advantage 0, zero gradient, weights unchanged
    up = make(base, cfg)
    w0 = params(up.engine.module)
    m = train(up, [samples[0]], 0)
    assert m["learner/grad_norm"] == 0.0 and m["loss/advantage_abs_mean"] == 0.0
    assert max_diff(w0, params(up.engine.module)) == 0.0


@pytest.mark.parametrize("estimator", ["grpo", "gae"])
def test_the_order_samples_arrive_in_does_not_change_the_update(estimator, base, tiny_model_cfg):
    # Which sample of a batch a worker finished first depends on timing; the rows' order decides
    # the micro-batches (ties in length), the minibatches and the order of every float sum. The
    # batch is put in an order of its own (groups by id, samples by index): the same update,
    # bit for bit, so a synchronous run with fixed seeds repeats itself. Responses of different
    # lengths (an end-of-sequence token), micro-batches of 3, two minibatches.
    smp = generate_samples(base, PROMPTS, group_size=4, max_new_tokens=6, seed=5, reward_fn=digit_reward, eos_id=14)
    assert len({len(s.response_ids) for s in smp}) > 1
    settings = {"algo.estimator": estimator, "learner.batch_size": 12, "learner.micro_batch_size": 3,
                "learner.num_minibatches": 2, "learner.ppo_epochs": 2}
    if estimator == "gae":
        settings["algo.group_size"] = 1
    cfg = tiny_config(tiny_model_cfg, **settings)
    results = []
    for order in (list(range(12)), [7, 2, 11, 0, 5, 9, 1, 10, 3, 6, 8, 4]):
        torch.manual_seed(0)  # the critic's fresh value head
        up = make(base, cfg, critic=load_critic(tiny_model_cfg) if estimator == "gae" else None)
        m = train(up, [smp[i] for i in order], 0)
        results.append((params(up.engine.module), {k: v for k, v in m.items() if "time" not in k and "_per_s" not in k
                                                   and "tflops" not in k}))
    (w0, m0), (w1, m1) = results
    assert max_diff(w0, w1) == 0.0 and m0 == m1


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_micro_batch_size_does_not_change_the_update(agg, base, samples, tiny_model_cfg):
    # every micro-batch loss is scaled by its share of the minibatch: accumulation == one pass
    results, norms = [], []
    for mbs in (1, 3, 8):
        up = make(base, tiny_config(tiny_model_cfg, **{"learner.micro_batch_size": mbs, "algo.agg_mode": agg}))
        norms.append(train(up, samples, 0)["learner/grad_norm"])
        results.append(params(up.engine.module))
    # the gradient's scale (Adam would hide a wrong one) and its direction (the update)
    assert norms[1] == pytest.approx(norms[0], rel=1e-5) and norms[2] == pytest.approx(norms[0], rel=1e-5)
    # Adam (lr 1e-3) turns rounding noise in a near-zero gradient into up to ~lr of movement, and
    # the rounding depends on the CPU's kernels: within 3% of lr, against updates of > 5e-4
    assert max_diff(results[0], results[1]) < 3e-5 and max_diff(results[0], results[2]) < 3e-5
    assert max_diff(results[0], params(base)) > 5e-4


def test_decoupled_equals_ppo_on_policy_and_differs_on_stale_samples(base, samples, tiny_model_cfg):
    def trained(smp, loss):
        up = make(base, tiny_config(tiny_model_cfg, **{"algo.policy_loss": loss, "learner.ppo_epochs": 2}))
        train(up, smp, 0)
        return params(up.engine.module)

    assert max_diff(trained(samples, "decoupled"), trained(samples, "ppo")) < 1e-6
    # samples from other weights (a "stale" behaviour policy): the IS weight now matters
    other = copy.deepcopy(base)
    g = torch.Generator().manual_seed(1)  # not the global RNG: what ran before must not pick the samples
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    stale = generate_samples(other, PROMPTS[:2], 4, 6, seed=2, reward_fn=digit_reward)
    # a group whose rewards differ (else no advantage, no update, and nothing to tell apart)
    assert any(len({s.reward for s in stale if s.group_id == gid}) > 1 for gid in {s.group_id for s in stale})
    assert max_diff(trained(stale, "decoupled"), trained(stale, "ppo")) > 1e-5


def test_batch_metrics_worked_numbers(base, tiny_model_cfg):
    up = make(base, tiny_config(tiny_model_cfg))
    s = [sample(prompt_ids=[20], response_ids=[21, 22, 23], token_versions=[2, 2, 3], reward=1.0, group_id="a", group_size=2,
                index=0, reward_components={"count": 0.75, "digits": 0.1}),
         sample(prompt_ids=[20, 25, 26], response_ids=[24], token_versions=[5], reward=0.0, group_id="a", group_size=2, index=1,
                reward_components={"count": 0.25}, finish_reason="length")]
    m = train(up, s, 6)
    # staleness = 6 - oldest token version: [4, 1]; per token [4, 4, 3, 1] -> mean 3
    assert (m["staleness/min"], m["staleness/mean"], m["staleness/max"]) == (1.0, 2.5, 4.0)
    assert m["staleness/token_mean"] == 3.0
    assert (m["reward/mean"], m["reward/count"], m["reward/digits"]) == (0.5, 0.5, pytest.approx(0.1))
    assert (m["reward/truncated_frac"], m["reward/response_len_mean"], m["learner/num_tokens"]) == (0.5, 2.0, 4.0)
    assert m["reward/prompt_len_mean"] == 2.0  # prompts of 1 and 3 tokens
    assert m["learner/version"] == 6.0 and m["learner/lr"] == pytest.approx(1e-3)


def test_the_learners_reward_stats_are_the_names_a_reward_may_not_take(base, tiny_model_cfg):
    # A reward component is the metric reward/<its name>; one named like a stat (mean, max, ...) was
    # written over it. metric_names.REWARD_STATS, which config validation and the gateway refuse as
    # component names, must be exactly the reward/* stats the learner writes (every option on here).
    from rlhf_core import metric_names as M

    cfg = tiny_config(tiny_model_cfg, **{"algo.normalize_rewards": True, "algo.overlong": "shaping",
                                         "algo.overlong_buffer": 2})
    turn = sample(prompt_ids=[20], response_ids=[21, 22, 23], reward=1.0, group_id="a", group_size=2, index=0,
                  reward_components={"count": 1.0}, loss_mask=[1, 0, 1], metadata={"turns": 2})
    other = sample(prompt_ids=[20], response_ids=[24], reward=0.0, group_id="a", group_size=2, index=1,
                   reward_components={"count": 0.0})
    m = train(make(base, cfg), [turn, other], 0)
    stats = {k.removeprefix("reward/") for k in m if k.startswith("reward/")} - {"count"}
    assert stats == M.REWARD_STATS


def test_reward_normalisation_keeps_running_statistics(base, samples, tiny_model_cfg):
    cfg = tiny_config(tiny_model_cfg, **{"algo.normalize_rewards": True})
    up = make(base, cfg)
    train(up, samples, 0)
    m = train(up, samples[:4], 1)
    seen = torch.tensor([s.reward for s in samples + samples[:4]]).double()  # float32 in the batch
    assert m["reward/running_mean"] == pytest.approx(float(seen.mean()), abs=1e-9)
    assert m["reward/running_std"] == pytest.approx(float(seen.std()), abs=1e-9)
    fresh = make(base, cfg)
    fresh.load_state_dict(up.state_dict())
    assert fresh.reward_stats.state_dict() == up.reward_stats.state_dict() and fresh.reward_stats.count == 12


def test_errors_a_user_can_cause(base, samples, tiny_model_cfg):
    cfg = tiny_config(tiny_model_cfg)
    up = make(base, cfg)
    with pytest.raises(BatchError, match="same tokenizer.*learner vocab 99"):
        train(up, [sample(prompt_ids=[20], response_ids=[21, 150])], 0)
    five = [sample(prompt_ids=[20], response_ids=[21], group_id="g", group_size=5, index=i) for i in range(5)]
    with pytest.raises(BatchError, match="5 samples but algo.group_size is 4"):
        train(up, five, 0)
    kl = tiny_config(tiny_model_cfg, **{"algo.kl_coef": 0.1})
    with pytest.raises(MissingReferenceError, match="ref_logprobs_on=worker"):
        train(make(base, kl), samples, 0)
    # reference log-probs sent by the workers are enough
    with_ref = [copy.deepcopy(s) for s in samples]
    for s in with_ref:
        s.ref_logprobs = s.behaviour_logprobs.copy()
    assert train(make(base, kl), with_ref, 0)["loss/kl"] == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(ConfigError, match="needs a critic"):
        make(base, tiny_config(tiny_model_cfg, **{"algo.estimator": "gae"}))
    with pytest.raises(ConfigError, match="batch_size 10 is not divisible by algo.group_size 4"):  # run_learner's check
        validate(tiny_config(tiny_model_cfg, **{"learner.batch_size": 10}))


def test_dpo_with_all_groups_tied_takes_no_step(base, tiny_model_cfg):
    up = make(base, tiny_config(tiny_model_cfg, **{"algo.estimator": "dpo"}), ref=True)
    w0 = params(up.engine.module)
    tied = [sample(prompt_ids=[20], response_ids=[21, 22], reward=1.0, group_id="t", group_size=2, index=i) for i in range(2)]
    m = train(up, tied, 0)
    assert m["learner/optimizer_steps"] == 0.0 and m["loss/dpo_pairs"] == 0.0
    assert max_diff(w0, params(up.engine.module)) == 0.0


def test_dpo_under_overlong_mask_pairs_only_responses_that_finished(base, samples, tiny_model_cfg):
    # algo.overlong=mask leaves truncated responses out of every loss; DPO paired them all the same.
    # Every sample of the fixture ran to max_new_tokens ("length"): no pair, no step, no change.
    cfg = tiny_config(tiny_model_cfg, **{"algo.estimator": "dpo", "algo.overlong": "mask"})
    up = make(base, cfg, ref=True)
    w0 = params(up.engine.module)
    m = train(up, samples, 0)
    assert (m["loss/dpo_pairs"], m["learner/optimizer_steps"]) == (0.0, 0.0)
    assert max_diff(w0, params(up.engine.module)) == 0.0
    # rewards per group [0, 0, 0, 1/6]: the only preference is row 3's. With it truncated and the
    # others finished, each group's finished rows tie: no pair; with rows 2 and 3 finished, 3 vs 2
    assert [s.reward for s in samples] == [0.0, 0.0, 0.0, pytest.approx(1 / 6)] * 2

    def pairs(finished):
        smp = [copy.deepcopy(s) for s in samples]
        for s in smp:
            s.finish_reason = "stop" if s.group_index in finished else "length"
        return train(make(base, cfg, ref=True), smp, 0)["loss/dpo_pairs"]

    assert pairs((0, 1, 2)) == 0.0 and pairs((2, 3)) == 2.0


def test_tokens_filtered_out_by_top_k_leave_the_loss(base, samples, tiny_model_cfg):
    # sampled at top_k=0 but trained with top_k=3: most sampled tokens now have log-prob -inf
    up = make(base, tiny_config(tiny_model_cfg, **{"rollout.top_k": 3}))
    batch = batch_of(up, samples)
    prox = up.passes.proximal_logprobs(batch)
    expect = float((~torch.isfinite(prox[batch.response_mask])).float().mean())
    w0 = params(up.engine.module)
    m = train(up, samples, 0)
    assert 0.0 < expect < 1.0 and m["learner/nonfinite_logprob_frac"] == pytest.approx(expect)
    assert all(math.isfinite(v) for v in m.values()), m
    assert max_diff(w0, params(up.engine.module)) > 1e-6


def test_dpo_leaves_out_tokens_top_k_filters_and_still_steps(base, samples, tiny_model_cfg):
    # As above, most sampled tokens are -inf under the policy and the reference at top_k=3. In a
    # response's log-prob sum one -inf made every margin (-inf) - (-inf) = nan and the step was
    # skipped; those tokens now leave both sums (policy and reference), and the update is finite.
    up = make(base, tiny_config(tiny_model_cfg, **{"algo.estimator": "dpo", "rollout.top_k": 3}), ref=True)
    w0 = params(up.engine.module)
    m = train(up, samples, 0)
    assert m["loss/dpo_pairs"] == 2.0 and m["learner/optimizer_steps"] == 1.0
    assert all(math.isfinite(v) for v in m.values()), m
    assert max_diff(w0, params(up.engine.module)) > 1e-6


@pytest.mark.parametrize("kl_mode", ["loss", "reward"])
def test_tokens_the_updated_policy_filters_out_leave_the_kl_and_every_step_is_taken(kl_mode, base, tiny_model_cfg):
    # Sampled by these very weights at top_k=4: every token is finite under pi_prox and the
    # reference when the update starts, so the loss mask keeps them all. After the first of 4
    # optimizer steps (2 epochs x 2 minibatches, lr 1e-3) some leave the policy's top 4: log-prob
    # -inf inside the mask. The k3 KL was exp(ref - (-inf)) - (ref - (-inf)) - 1 = inf - inf = nan
    # (in the loss: gradient nan, the step skipped; in the reward: loss/kl nan) and approx_kl
    # ratio - 1 - log ratio = 0 - 1 + inf = inf. Those tokens now leave the KL and approx_kl
    # (counted in loss/filtered_out_frac) and stay in the denominators.
    settings = {"rollout.top_k": 4, "learner.ppo_epochs": 2, "learner.num_minibatches": 2, "learner.batch_size": 16,
                "learner.micro_batch_size": 8, "algo.kl_coef": 0.1, "algo.kl_mode": kl_mode}
    smp = generate_samples(base, PROMPTS + [[23, 31]], group_size=4, max_new_tokens=6, seed=1, reward_fn=digit_reward,
                           top_k=4)
    up = make(base, tiny_config(tiny_model_cfg, **settings), ref=True)
    m = train(up, smp, 0)
    assert m["learner/nonfinite_logprob_frac"] == 0.0 and m["loss/filtered_out_frac"] > 0.0
    assert up.engine.skipped_steps == 0 and m["learner/optimizer_steps"] == 4.0
    assert all(math.isfinite(v) for v in m.values()), {k: v for k, v in m.items() if not math.isfinite(v)}


def test_entropy_bonus_enters_the_total_loss(base, samples, tiny_model_cfg):
    # total = policy - entropy_coef * entropy, per micro-batch and so in the weighted means too
    plain = train(make(base, tiny_config(tiny_model_cfg)), samples, 0)
    assert plain["loss/total"] == pytest.approx(plain["loss/policy"], abs=1e-7)
    up = make(base, tiny_config(tiny_model_cfg, **{"algo.entropy_coef": 0.1}))
    before = params(up.engine.module)
    m = train(up, samples, 0)
    assert m["loss/entropy"] > 1.0  # a random tiny model is far from deterministic
    assert m["loss/total"] == pytest.approx(m["loss/policy"] - 0.1 * m["loss/entropy"], abs=1e-6)
    # and it is trained on: the step differs from the one without the bonus
    without = make(base, tiny_config(tiny_model_cfg))
    train(without, samples, 0)
    assert max_diff(params(up.engine.module), params(without.engine.module)) > 1e-6
    assert max_diff(params(up.engine.module), before) > 0


def test_sequence_level_is_uses_its_own_caps():
    token = AlgoConfig(is_correction="tis").importance_sampling()
    assert (token.level, token.tis_cap, token.mis_low, token.mis_high) == ("token", 2.0, 0.5, 2.0)
    seq = AlgoConfig(is_correction="tis", is_level="sequence").importance_sampling()
    assert (seq.level, seq.tis_cap, seq.mis_low, seq.mis_high) == ("sequence", 1.001, 0.999, 1.001)
    with pytest.raises(ConfigError, match=r"algo.seq_tis_cap must be > 0 \(use a large number to disable truncation\), got 0.0"):
        AlgoConfig(is_level="sequence", seq_tis_cap=0.0).importance_sampling()


def test_sequence_level_defaults_act_where_the_token_caps_would_not():
    # ratio 1 (logp == prox) and A = 1, so each token's loss is -w.
    # row 0: log w = [0.03, -0.01] -> geometric mean e^0.01 = 1.01005 (token weights 1.03, 0.99)
    # row 1: log w = [-0.02, 0.0]  -> geometric mean e^-0.01 = 0.99005
    prox = torch.full((2, 2), -1.0, dtype=torch.float64)
    behav = prox - torch.tensor([[0.03, -0.01], [-0.02, 0.0]], dtype=torch.float64)
    adv, mask = torch.ones(2, 2, dtype=torch.float64), torch.ones(2, 2, dtype=torch.bool)
    g0, g1 = math.exp(0.01), math.exp(-0.01)

    def loss(**algo):
        is_config = AlgoConfig(is_level="sequence", **algo).importance_sampling()
        out, stats = decoupled_ppo_loss(prox, prox, behav, adv, mask, is_config=is_config)
        return out.item(), stats

    # TIS at the token cap 2 leaves both rows alone: -(2 * 1.01005 + 2 * 0.99005) / 4 = -1.00005
    value, stats = loss(is_correction="tis", seq_tis_cap=2.0)
    assert value == pytest.approx(-(g0 + g1) / 2, abs=1e-12) and stats.is_truncated_frac.item() == 0.0
    # the sequence default 1.001 truncates row 0: -(2 * 1.001 + 2 * 0.99005) / 4 = -0.995525
    value, stats = loss(is_correction="tis")
    assert value == pytest.approx(-(1.001 + g1) / 2, abs=1e-12) and stats.is_truncated_frac.item() == 0.5
    # MIS: the band [0.5, 2] keeps everything; the default [0.999, 1.001] drops both rows (loss 0)
    value, stats = loss(is_correction="mis", seq_mis_low=0.5, seq_mis_high=2.0)
    assert value == pytest.approx(-(g0 + g1) / 2, abs=1e-12) and stats.is_masked_frac.item() == 0.0
    value, stats = loss(is_correction="mis")
    assert value == 0.0 and stats.is_masked_frac.item() == 1.0


def test_flops_and_mfu_of_an_update():
    import torch

    from learner.stats import flops_metrics, peak_flops
    from rlhf_core import metric_names as M

    # 1e6 params x 1e4 tokens x 6 = 6e10 FLOP in 0.5 s = 1.2e11 FLOP/s = 0.12 TFLOPS; peak 1e12: MFU 0.12
    assert flops_metrics(10**6, 1e4, 0.5, 1e12) == pytest.approx({M.TRAIN_TFLOPS: 0.12, M.MFU: 0.12})
    assert flops_metrics(10**6, 1e4, 0.5, None) == pytest.approx({M.TRAIN_TFLOPS: 0.12})  # no peak: no MFU
    assert peak_flops(torch.device("cpu"), None) is None
    assert peak_flops(torch.device("cpu"), 50.0) == 50e12  # learner.peak_tflops


@pytest.mark.parametrize("name, tflops", [
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0), ("NVIDIA H200", 989.0),
    ("NVIDIA H200 NVL", 835.0), ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA A100 80GB PCIe", 312.0),
    ("NVIDIA L40", 181.0), ("NVIDIA L40S", 362.0), ("NVIDIA L4", 121.0), ("NVIDIA A10G", 70.0),
    ("NVIDIA GeForce RTX 4090", 165.0), ("NVIDIA GeForce RTX 3090", None),
])
def test_peak_tflops_of_a_gpu_by_its_exact_variant(name, tflops):
    # the first key contained in the name won: the L40 got the L4's 121 (MFU 1.5x too high), the
    # H100 PCIe and NVL the SXM's 989 (MFU 24% and 16% too low); now the longest key contained
    from learner.stats import peak_tflops_by_name

    assert peak_tflops_by_name(name) == tflops


@pytest.mark.parametrize("estimator, epochs, tokens", [("grpo", 2, 152), ("dpo", 3, 114)])
def test_flops_count_the_tokens_each_epoch_trains(estimator, epochs, tokens, base, samples, tiny_model_cfg):
    # rows of 2 + 6 and 5 + 6 tokens, 4 of each: 76 tokens, each trained once per epoch, so 2
    # epochs train 152 (76 were counted, half the FLOPs done). DPO trains its pairs alone: rows
    # 3 and 0 of each group (rewards [0, 0, 0, 1/6]), 2 x 8 + 2 x 11 = 38 an epoch, 114 in 3
    from rlhf_core import metric_names as M

    up = make(base, tiny_config(tiny_model_cfg, **{"algo.estimator": estimator, "learner.ppo_epochs": epochs}), ref=True)
    m = train(up, samples, 0)
    assert m["learner/optimizer_steps"] == float(epochs)
    # TFLOPS = 6 x params x tokens / time
    assert m[M.TRAIN_TFLOPS] * 1e12 * m["learner/time_compute_s"] / (6 * up.total_params) == pytest.approx(tokens)


@pytest.mark.parametrize("entropy_coef", [0.0, 0.01])
def test_chunked_logprobs_do_not_change_the_update(base, samples, tiny_model_cfg, entropy_coef, monkeypatch):
    # learner.logits_chunk_tokens=4: every micro-batch goes through the chunked LM head, by the
    # fused head's written-out backward (entropy a statistic) or checkpointed autograd (an
    # entropy bonus needs its gradient); learner.keep_head_logits (the fused head's backward reads
    # the forward's logits) changes nothing either
    import learner.lm_head
    from learner.lm_head import lm_parts

    assert lm_parts(base) is not None  # the tiny Llama's body and head are found
    fused_calls = []
    real = learner.lm_head.fused_response_logprobs
    monkeypatch.setattr(learner.lm_head, "fused_response_logprobs", lambda *a, **kw: fused_calls.append(1) or real(*a, **kw))
    results, norms = [], []
    for chunk, keep in ((4, False), (10**6, False), (4, True)):
        up = make(base, tiny_config(tiny_model_cfg, **{"learner.logits_chunk_tokens": chunk, "learner.keep_head_logits": keep,
                                                      "algo.entropy_coef": entropy_coef}))
        norms.append(train(up, samples, 0)["learner/grad_norm"])
        results.append(params(up.engine.module))
    assert norms[0] == pytest.approx(norms[1], rel=1e-5) and norms[2] == pytest.approx(norms[0], rel=1e-6)
    assert max_diff(results[0], results[1]) < 3e-5 and max_diff(results[0], params(base)) > 5e-4
    assert max_diff(results[2], results[0]) < 1e-6
    assert bool(fused_calls) == (entropy_coef == 0.0)


def test_prox_comes_from_the_training_pass_only_when_provably_the_same():
    from learner.update import has_dropout, prox_is_training_pass
    from rlhf_core.config import Config

    plain = torch.nn.Linear(2, 2)

    def cfg(**kw):
        c = Config()
        for key, value in kw.items():
            section, name = key.split(".")
            setattr(getattr(c, section), name, value)
        return c

    assert prox_is_training_pass(cfg(), plain)  # one epoch, one minibatch, no filtering, no dropout
    for not_same in ({"learner.ppo_epochs": 2}, {"learner.num_minibatches": 2}, {"rollout.top_k": 5},
                     {"rollout.top_p": 0.9}, {"rollout.temperature": 0.0}, {"algo.vtrace": True}, {"algo.estimator": "dpo"},
                     {"algo.kl_coef": 0.1, "algo.kl_mode": "reward"}):
        assert not prox_is_training_pass(cfg(**not_same), plain), not_same
    assert prox_is_training_pass(cfg(**{"algo.kl_coef": 0.1, "algo.kl_mode": "loss"}), plain)  # KL after the pass
    assert not prox_is_training_pass(cfg(), torch.nn.Sequential(plain, torch.nn.Dropout(0.1)))
    # HF attention applies config.attention_dropout functionally: the config counts too
    from transformers import LlamaConfig, LlamaForCausalLM

    tiny = dict(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2)
    assert not has_dropout(LlamaForCausalLM(LlamaConfig(**tiny)))
    assert has_dropout(LlamaForCausalLM(LlamaConfig(**tiny, attention_dropout=0.1)))


@pytest.mark.parametrize("stale", [False, True])
def test_prox_from_the_training_pass_gives_the_update_of_a_separate_pass(stale, base, samples, tiny_model_cfg):
    # With one epoch of one minibatch the training pass runs the weights before the update, so
    # pi_prox read off it (detached) equals the no-grad pass's: the same step and the same metrics.
    cfg = tiny_config(tiny_model_cfg, **{"learner.lr": 3e-3, "learner.micro_batch_size": 3})
    results = []
    for reuse in (True, False):
        up = make(base, cfg)
        assert up.prox_from_training_pass
        up.prox_from_training_pass = reuse
        if stale:  # samples made by older weights: pi_prox != mu, the IS weights act
            train(up, samples, 0)
        m = train(up, samples, 1 if stale else 0)
        assert m["learner/prox_pass"] == float(not reuse)
        results.append((params(up.engine.module), m))
    (w_reuse, m_reuse), (w_pass, m_pass) = results
    assert max_diff(w_reuse, w_pass) < 1e-6
    for key in ("loss/policy", "loss/ratio_mean", "staleness/is_weight_mean", "staleness/is_weight_max",
                "staleness/behav_prox_kl", "staleness/is_truncated_frac", "learner/grad_norm"):
        assert m_reuse[key] == pytest.approx(m_pass[key], rel=1e-5, abs=1e-7), key
    if stale:
        assert m_pass["staleness/behav_prox_kl"] > 1e-4  # the check compares real IS weights
    # the mismatch, over 3 micro-batches or in one pass, is the same; every token is in one split
    # (all lagged when stale), whose KL is staleness/behav_prox_kl's (float64 here, float32 there)
    split, other = ("lagged", "lag0") if stale else ("lag0", "lagged")
    for key in M.METRIC_HELP:
        assert m_reuse[key] == pytest.approx(m_pass[key], rel=1e-5, abs=1e-9), key
    assert (m_pass[f"mismatch/{split}_tokens"], m_pass[f"mismatch/{other}_tokens"]) == (m_pass[M.NUM_TOKENS], 0.0)
    assert m_pass[f"mismatch/{split}_kl_k3"] == pytest.approx(m_pass["staleness/behav_prox_kl"], rel=1e-4, abs=1e-9)


@pytest.mark.slow
def test_compiled_blocks_give_the_update_of_eager_ones(base, samples, tiny_model_cfg, monkeypatch):
    # learner.compile: each decoder layer through torch.compile (inductor) in place, and the fused
    # LM head's elementwise work too (learner.logits_chunk_tokens=4 sends every micro-batch through
    # it). Two updates in micro-batches of 3, 3 and 2 samples of different padded lengths (dynamic
    # shapes): the same gradient norms and weights as eager, to float rounding (the fused kernels
    # sum in another order; the bound is that of the micro-batch test above), under the same
    # parameter names.
    import learner.lm_head

    heads = []
    real = learner.lm_head._head_math
    monkeypatch.setattr(learner.lm_head, "_head_math", lambda compiled: heads.append(compiled) or real(compiled))
    runs = []
    for compiled in (False, True):
        up = make(base, tiny_config(tiny_model_cfg, **{"learner.micro_batch_size": 3, "learner.compile": compiled,
                                                      "learner.logits_chunk_tokens": 4}))
        norms = [train(up, samples, v)["learner/grad_norm"] for v in (0, 1)]
        runs.append((norms, params(up.engine.module), up.engine.module))
    assert sorted(set(heads)) == [False, True] and heads == sorted(heads)  # eager head in the first run, compiled in the second
    (eager_norms, eager, _), (norms, compiled, module) = runs
    blocks = [m for m in module.modules() if type(m).__name__ == "LlamaDecoderLayer"]
    assert len(blocks) == tiny_model_cfg.tiny.num_layers and all(b._compiled_call_impl is not None for b in blocks)
    assert set(compiled) == set(eager) and set(module.state_dict()) == set(base.state_dict())
    assert norms == pytest.approx(eager_norms, rel=1e-4)
    assert max_diff(compiled, eager) < 3e-5 and max_diff(compiled, params(base)) > 5e-4


def test_compile_by_default_only_for_a_model_trained_in_full_on_a_gpu(tiny_model_cfg):
    # learner.compile=null (the default): compiled on a GPU (measured faster there), eager on a
    # CPU (slower compiled), with LoRA adapters (not measured) or without named blocks; set, as set.
    from learner.engines import wants_compile
    from rlhf_core.lora import ADAPTER_MARK
    from rlhf_core.models import load_policy

    assert tiny_config(tiny_model_cfg).learner.compile is None
    model = load_policy(tiny_model_cfg)
    assert wants_compile(None, model, on_gpu=True) and not wants_compile(None, model, on_gpu=False)
    assert wants_compile(True, model, on_gpu=False) and not wants_compile(False, model, on_gpu=True)
    assert not wants_compile(None, torch.nn.Linear(2, 2), on_gpu=True)  # no blocks named
    # an adapter as peft names it (rlhf_core.lora; importing peft alone takes seconds)
    model.lm_head.register_parameter(f"{ADAPTER_MARK}A", torch.nn.Parameter(torch.zeros(1)))
    assert not wants_compile(None, model, on_gpu=True)


def test_compile_is_refused_where_it_cannot_work(tiny_model_cfg):
    from learner.engines import compile_blocks

    with pytest.raises(ConfigError, match="names no transformer blocks"):
        compile_blocks(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    with pytest.raises(ConfigError, match="learner.engine=torch only"):
        validate(tiny_config(tiny_model_cfg, **{"learner.compile": True, "learner.engine": "deepspeed"}))
