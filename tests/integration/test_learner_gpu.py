"""The learner's fused LM head on a GPU, in bf16 at a real vocabulary's size: its elementwise work
through ``torch.compile`` (what ``learner.compile`` runs, Triton kernels there) against eager
torch. Skipped without CUDA."""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = [pytest.mark.integration, pytest.mark.gpu, pytest.mark.timeout(300)]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_compiled_head_gives_the_eager_heads_logprobs_and_gradients_in_bf16(temperature):
    from learner.batch import _head_math, _LinearLogprobs

    # Qwen2-0.5B's head (896 wide, 151,936 tokens), 2,500 positions in chunks of 1,024 (the last
    # one short); the first 64 positions sample their most likely token with p near 1, where
    # 1 - p is what a rounded p would lose.
    gen = torch.Generator(device="cuda").manual_seed(0)
    n, width, vocab = 2500, 896, 151_936
    hidden = torch.randn(n, width, device="cuda", generator=gen).bfloat16()
    weight = (torch.randn(vocab, width, device="cuda", generator=gen) * 0.05).bfloat16()
    ids = torch.randint(0, vocab, (n,), device="cuda", generator=gen)
    # token i's logit at position i raised by about log(V) + 8 (the others' log-sum-exp is about log(V) + 1)
    weight[:64] += hidden[:64] * ((math.log(vocab) + 8) / width)
    ids[:64] = torch.arange(64, device="cuda")
    g = torch.randn(n, device="cuda", generator=gen)
    out = {}
    for compiled in (False, True):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        logp, ent = _LinearLogprobs.apply(h, w, ids, temperature, 1024, True, _head_math(compiled))
        (logp * g).sum().backward()
        out[compiled] = logp.detach(), ent, h.grad, w.grad
    (logp, ent, gh, gw), (c_logp, c_ent, c_gh, c_gw) = out[False], out[True]
    assert 0.9 < float(logp[:64].exp().min())  # near-certain (some exactly certain in fp32 at T = 0.7)
    torch.testing.assert_close(c_logp, logp, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(c_ent, ent, rtol=1e-4, atol=1e-3)
    # dz in bf16 differs by at most a rounding per entry; the matmuls that sum them agree to that
    assert rel_err(c_gh, gh) < 1e-2 and rel_err(c_gw, gw) < 1e-2
    # where p is near the one-hot the gradient is small; both keep it
    assert rel_err(c_gh[:64], gh[:64]) < 2e-2 and float(gh[:64].float().abs().sum()) > 0


def test_an_updates_compute_time_includes_its_last_optimizer_step(tiny_model_cfg):
    # The metrics' host copy waits for the gradient norm, which the optimizer step follows on the
    # stream: an update whose step ends with 50 ms of queued GPU work (torch.cuda._sleep) must
    # return with the stream idle and count those 50 ms in learner/time_compute_s (and so in MFU).
    import copy
    import dataclasses
    import time

    from learner.engine_factory import make_engine
    from learner.update import PolicyUpdater
    from learner_helpers import digit_reward, generate_samples, tiny_config
    from rlhf_core.models import load_policy

    base = load_policy(tiny_model_cfg)  # on the CPU, where the test's sampler runs
    samples = generate_samples(base, [[20, 30], [21, 30, 4]], group_size=4, max_new_tokens=6, seed=1,
                               reward_fn=digit_reward)
    cfg = tiny_config(dataclasses.replace(tiny_model_cfg, device="cuda"))
    engine = make_engine(cfg, copy.deepcopy(base).cuda())
    up = PolicyUpdater(cfg, engine)
    up.update(samples, 0)  # warm: kernels loaded, allocator primed
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    torch.cuda._sleep(1_000_000)
    torch.cuda.synchronize()
    per_million = time.perf_counter() - t0  # seconds per million sleep cycles on this GPU
    cycles = int(1e6 * 0.05 / per_million)
    step = engine.step

    def slow_step():
        norm = step()
        torch.cuda._sleep(cycles)
        return norm

    engine.step = slow_step
    out = up.update(samples, 1)
    assert torch.cuda.current_stream().query()  # nothing left running when update returns
    assert out["learner/time_compute_s"] >= 0.045
