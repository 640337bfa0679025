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
    from learner.lm_head import _head_math, _LinearLogprobs

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
