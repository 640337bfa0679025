"""learner.engines: the LR schedule, the torch engine, and the single-process distributed helpers."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from factories import sample
from learner.engine_factory import make_engine
from learner.engines import TorchEngine, all_reduce_sum, broadcast_samples, lr_lambda, total_optimizer_steps
from rlhf_core.config import Config, ConfigError, LearnerConfig
from rlhf_core.models import load_critic, load_policy


def test_warmup_then_cosine_to_the_floor():
    cfg = LearnerConfig(warmup_steps=2, max_updates=3, ppo_epochs=1, num_minibatches=2, min_lr_ratio=0.1)
    assert total_optimizer_steps(cfg) == 6
    f = lr_lambda(cfg)
    # warm-up: (step + 1) / 2; cosine over the 4 steps after it: 0.1 + 0.9 * 0.5 * (1 + cos(pi * k / 4))
    expect = [0.5, 1.0, 1.0, 0.1 + 0.9 * 0.5 * (1 + 0.5 ** 0.5), 0.55, 0.1 + 0.9 * 0.5 * (1 - 0.5 ** 0.5), 0.1, 0.1]
    assert [f(s) for s in range(8)] == pytest.approx(expect)
    const = lr_lambda(LearnerConfig(warmup_steps=4, lr_schedule="constant"))
    assert [const(s) for s in (0, 3, 4, 1000)] == [0.25, 1.0, 1.0, 1.0]


@pytest.fixture(scope="module")
def base(tiny_model_cfg):
    return load_policy(tiny_model_cfg)


def loss_of(engine):
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    return engine.forward(input_ids=ids).logits.float().logsumexp(-1).mean()


def test_torch_engine_steps_clips_and_schedules(base):
    cfg = LearnerConfig(lr=0.01, warmup_steps=2, max_updates=4, grad_clip=0.5)
    eng = TorchEngine(copy.deepcopy(base), cfg)
    assert eng.lr == pytest.approx(0.005) and eng.global_step == 0 and eng.is_rank0
    eng.backward(loss_of(eng))
    grads = [p.grad for p in eng.module.parameters() if p.grad is not None]
    raw = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))
    norm = eng.step()
    assert norm == pytest.approx(raw, rel=1e-5) and raw > 0.5  # the norm before clipping is reported
    assert eng.global_step == 1 and eng.lr == pytest.approx(0.01)
    assert all(p.grad is None for p in eng.module.parameters())  # zeroed for the next accumulation


def test_non_finite_gradient_skips_the_step(base):
    eng = TorchEngine(copy.deepcopy(base), LearnerConfig(lr=0.01))
    before = {n: p.detach().clone() for n, p in eng.module.named_parameters()}
    eng.backward(loss_of(eng) * float("nan"))
    assert math.isnan(eng.step())
    assert eng.skipped_steps == 1 and eng.global_step == 0 and eng.lr == pytest.approx(0.01)
    assert all(torch.equal(before[n], p) for n, p in eng.module.named_parameters())


def test_named_full_parameters_are_cpu_copies_in_state_dict_names(base):
    eng = TorchEngine(copy.deepcopy(base), LearnerConfig())
    full = dict(eng.named_full_parameters(dtype=torch.bfloat16))
    assert set(full) == set(base.state_dict())
    assert all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in full.values())
    full32 = dict(eng.named_full_parameters())
    full32["lm_head.weight"].zero_()  # a copy: the model is untouched
    assert float(eng.module.lm_head.weight.detach().abs().sum()) > 0


def test_make_engine_picks_the_critic_lr(base, tiny_model_cfg):
    cfg = Config()
    cfg.learner.lr, cfg.learner.critic_lr = 1e-3, 5e-3
    assert make_engine(cfg, copy.deepcopy(base)).lr == pytest.approx(1e-3)
    assert make_engine(cfg, load_critic(tiny_model_cfg)).lr == pytest.approx(5e-3)
    cfg.learner.engine = "nope"
    with pytest.raises(ConfigError, match="learner.engine='nope'"):
        make_engine(cfg, copy.deepcopy(base))


def test_distributed_helpers_are_identity_in_one_process():
    t = torch.tensor([1.0, 2.0])
    assert all_reduce_sum(t) is t and t.tolist() == [1.0, 2.0]
    s = [sample(prompt_ids=[1], response_ids=[2, 3], reward=0.5)]
    assert broadcast_samples(s) == s


def test_a_bf16_model_is_trained_through_fp32_masters_so_tiny_updates_are_kept(base, tmp_path):
    # Adam moves each weight by about lr per step. A bf16 weight near 0.02 has a spacing of
    # 2^-6 * 2^-7 ~ 1.2e-4, so a 1e-6 step rounds away: stepped directly, the bf16 model never
    # changes. Through fp32 masters the steps accumulate: after one step the masters moved by
    # ~1e-6, and after 200 steps (~2e-4 per weight) the rounded bf16 weights move too.
    cfg = LearnerConfig(lr=1e-6, warmup_steps=0, lr_schedule="constant", grad_clip=0.0, max_updates=1000)
    bf16 = copy.deepcopy(base).to(torch.bfloat16)
    eng = TorchEngine(copy.deepcopy(bf16), cfg)
    assert eng.masters is not None and all(m.dtype == torch.float32 for m in eng.masters)
    start = [m.clone() for m in eng.masters]
    eng.backward(loss_of(eng))
    eng.step()
    moved = [float((m - s).abs().max()) for m, s in zip(eng.masters, start)]
    assert max(moved) == pytest.approx(1e-6, rel=0.05)  # one Adam step of lr
    for _ in range(199):
        eng.backward(loss_of(eng))
        eng.step()
    changed = sum(int((p != q).sum()) for p, q in zip(eng.module.parameters(), bf16.parameters()))
    assert changed > 0.3 * sum(p.numel() for p in bf16.parameters())
    # the same 200 steps straight on the bf16 weights lose most of them (measured: 1,816 of
    # 94,912 weights changed, against 86,774 through the masters)
    plain = copy.deepcopy(bf16)
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-6, weight_decay=0.0)
    for _ in range(200):
        plain(input_ids=torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])).logits.float().logsumexp(-1).mean().backward()
        opt.step()
        opt.zero_grad()
    plain_changed = sum(int((p != q).sum()) for p, q in zip(plain.parameters(), bf16.parameters()))
    assert plain_changed < 0.25 * changed, (plain_changed, changed)  # only weights near 0 can take a 1e-6 step
    # checkpoints keep the exact masters
    eng.save_state(tmp_path / "ck")
    again = TorchEngine(copy.deepcopy(bf16), cfg)
    again.load_state(tmp_path / "ck")
    assert all(torch.equal(a, b) for a, b in zip(again.masters, eng.masters))


def test_deepspeed_keeps_fp32_masters_for_a_bf16_model():
    from learner.engine_deepspeed import ds_config

    cfg = LearnerConfig(bf16=False)
    assert ds_config(cfg, 1, on_gpu=True, bf16_model=True)["bf16"] == {"enabled": True}
    assert ds_config(cfg, 1, on_gpu=True, bf16_model=False)["bf16"] == {"enabled": False}
