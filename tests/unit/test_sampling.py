"""rlhf_core.sampling: temperature -> top-k -> top-p, sampling and log-probs, on tiny tensors.

Logits are written as logs of probabilities so the expected numbers can be read off directly.
"""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_core.sampling import process_logits, response_logprobs, sample_tokens, token_logprobs

NEG_INF = float("-inf")


def logits_of(*probs: float) -> torch.Tensor:
    return torch.tensor([math.log(p) for p in probs])


def kept(x: torch.Tensor) -> list[bool]:
    return torch.isfinite(x).tolist()


def test_identity_when_everything_is_off():
    x = torch.tensor([[1.0, -2.0, 0.5]])
    assert torch.equal(process_logits(x), x)


def test_temperature_divides_logits():
    # probs [1/7, 2/7, 4/7]; temperature 0.5 doubles the logits -> probs proportional to [1, 4, 16] / 21
    x = logits_of(1 / 7, 2 / 7, 4 / 7)
    probs = process_logits(x, temperature=0.5).softmax(-1)
    torch.testing.assert_close(probs, torch.tensor([1 / 21, 4 / 21, 16 / 21]))


def test_top_k_keeps_the_k_largest():
    x = torch.tensor([1.0, 3.0, 2.0, 0.0])
    out = process_logits(x, top_k=2)
    assert out.tolist() == [NEG_INF, 3.0, 2.0, NEG_INF]
    # top_k >= vocab is off
    assert torch.equal(process_logits(x, top_k=4), x)


def test_top_k_keeps_ties_with_the_kth_value():
    # k=2 and the 2nd and 3rd largest tie at 2.0: both stay (as transformers' TopKLogitsWarper)
    x = torch.tensor([1.0, 3.0, 2.0, 2.0])
    assert kept(process_logits(x, top_k=2)) == [False, True, True, True]


@pytest.mark.parametrize(
    "top_p, expect",
    [
        # probs [0.5, 0.3, 0.15, 0.05]; mass before each token: [0, 0.5, 0.8, 0.95]
        (0.4, [True, False, False, False]),  # 0.5 >= 0.4 already: only the first
        (0.7, [True, True, False, False]),  # second kept (0.5 < 0.7), third not (0.8 >= 0.7)
        (0.9, [True, True, True, False]),
        (0.99, [True, True, True, True]),
    ],
)
def test_top_p_keeps_the_smallest_prefix_reaching_p(top_p, expect):
    x = logits_of(0.15, 0.5, 0.05, 0.3)  # shuffled, so the scatter back to vocab order is tested
    order = [1, 3, 0, 2]  # vocab indices sorted by probability
    out = kept(process_logits(x, top_p=top_p))
    assert [out[i] for i in order] == expect


def test_top_p_keeps_every_token_tied_with_the_last_one_kept():
    # probs [0.4, 0.2, 0.2, 0.2], top_p=0.5: the 0.4 and one 0.2 reach it (mass before the 2nd is
    # 0.4 < 0.5, before the 3rd 0.6), but which 0.2 a sort puts second is arbitrary, so all three
    # stay, as top-k keeps ties with its k-th value. (vLLM's ascending cut, mass 0.2, 0.4 <= 1 - 0.5,
    # dropped two of them: the learner had -inf for tokens the engine sampled.)
    x = logits_of(0.2, 0.4, 0.2, 0.2)
    assert kept(process_logits(x, top_p=0.5)) == [True, True, True, True]
    assert kept(process_logits(x[None], torch.ones(1), torch.zeros(1, dtype=torch.long), torch.tensor([0.5]))) == [[True] * 4]
    # without the tie the cut is the same: probs [0.4, 0.3, 0.2, 0.1] keep the first two
    assert kept(process_logits(logits_of(0.4, 0.3, 0.2, 0.1), top_p=0.5)) == [True, True, False, False]


def test_top_p_cuts_where_vllm_does_and_keeps_every_token_it_may_sample():
    """The vllm engine samples through vLLM's top-k/top-p and the learner recomputes through this
    module. Float32 logits: the same tokens and the same log-probs, bit for bit. Logits of a
    bfloat16 model tie often at the cut, where vLLM keeps some of a tie: each one it keeps is kept
    here too (with the rest of the tie, so the log-probs differ there: docs/vllm.md)."""
    ops = pytest.importorskip("vllm.v1.sample.ops.topk_topp_sampler")
    torch.manual_seed(0)
    rows, vocab = 16, 32000
    k = torch.randint(1, 200, (rows,))
    k[::2] = vocab  # top-p alone on half the rows
    p = torch.rand(rows) * 0.5 + 0.5
    for dtype in (torch.float32, torch.bfloat16):
        logits = (torch.randn(rows, vocab) * 3).to(dtype).float()
        for kk, pp, ours in ((None, torch.full((rows,), 0.9), process_logits(logits, 1.0, 0, 0.9)),
                             (k, p, process_logits(logits, torch.ones(rows), k, p))):
            theirs = ops.apply_top_k_top_p_pytorch(logits.clone(), kk, pp)
            lost = torch.isfinite(theirs) & ~torch.isfinite(ours)
            assert not lost.any(), f"{int(lost.sum())} tokens vLLM may sample are -inf here ({dtype})"
            if dtype == torch.float32:
                assert torch.equal(torch.log_softmax(ours, -1), torch.log_softmax(theirs, -1))


def test_top_p_just_below_one_filters_the_same_on_both_sides():
    # 0.99999999 is 1.0 in float32, as the hf engine holds its rows' settings: top-p is off there,
    # and was on in the learner's scalar path (a Python float < 1), whose float32 masses reach 1.0
    # in the tail: tokens the worker could sample had log-prob -inf in the learner's recomputation
    torch.manual_seed(0)
    logits = torch.randn(4, 50000) * 4
    p = 0.99999999
    engine = process_logits(logits, torch.ones(4), torch.zeros(4, dtype=torch.long), torch.full((4,), p))
    assert torch.equal(engine, logits)
    assert torch.equal(process_logits(logits, 1.0, 0, p), engine)


def test_top_p_applies_to_the_renormalised_top_k_distribution():
    # probs [0.4, 0.3, 0.2, 0.1]. Alone, top_p=0.5 keeps two (mass before the 2nd is 0.4 < 0.5).
    # After top_k=2 the distribution is [4/7, 3/7]: mass before the 2nd is 0.571 >= 0.5 -> one kept.
    x = logits_of(0.4, 0.3, 0.2, 0.1)
    assert kept(process_logits(x, top_p=0.5)) == [True, True, False, False]
    assert kept(process_logits(x, top_k=2, top_p=0.5)) == [True, False, False, False]


def test_logprobs_are_under_the_processed_distribution():
    # top_k=2 on [0.4, 0.3, 0.2, 0.1] renormalises to [4/7, 3/7]: log-probs log(4/7), log(3/7)
    x = logits_of(0.4, 0.3, 0.2, 0.1).expand(2, 4)
    lp = token_logprobs(process_logits(x, top_k=2), torch.tensor([0, 1]))
    torch.testing.assert_close(lp, torch.tensor([math.log(4 / 7), math.log(3 / 7)]))
    # a filtered token has log-prob -inf
    assert token_logprobs(process_logits(x, top_k=2), torch.tensor([2, 3])).tolist() == [NEG_INF, NEG_INF]


def test_temperature_zero_is_greedy_with_logprob_zero():
    x = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 2.9]])
    out = process_logits(x, temperature=0.0)
    assert kept(out) == [[False, True, False], [True, False, False]]
    assert sample_tokens(out).tolist() == [1, 0]
    assert token_logprobs(out, torch.tensor([1, 0])).tolist() == [0.0, 0.0]


def test_per_row_settings_match_row_by_row_scalars():
    torch.manual_seed(0)
    x = torch.randn(4, 50)
    temps, ks, ps = [1.0, 0.7, 0.0, 1.3], [0, 5, 0, 10], [0.9, 1.0, 0.5, 0.8]
    batched = process_logits(x, torch.tensor(temps), torch.tensor(ks), torch.tensor(ps))
    for i in range(4):
        torch.testing.assert_close(batched[i], process_logits(x[i : i + 1], temps[i], ks[i], ps[i])[0], rtol=0, atol=0)
    # a per-row temperature tensor with scalar top-k / top-p
    mixed = process_logits(x, torch.tensor(temps), 5, 0.9)
    for i in range(4):
        torch.testing.assert_close(mixed[i], process_logits(x[i : i + 1], temps[i], 5, 0.9)[0], rtol=0, atol=0)


def test_per_row_settings_broadcast_over_time():
    # [B, T, V] logits with [B] settings, as the learner recomputes whole responses
    torch.manual_seed(1)
    x = torch.randn(2, 3, 20)
    batched = process_logits(x, torch.tensor([0.5, 1.0]), torch.tensor([3, 0]), torch.tensor([1.0, 0.6]))
    for b, (t, k, p) in enumerate([(0.5, 3, 1.0), (1.0, 0, 0.6)]):
        torch.testing.assert_close(batched[b], process_logits(x[b], t, k, p), rtol=0, atol=0)


def test_sampling_follows_the_distribution_and_never_draws_filtered_tokens():
    x = logits_of(0.5, 0.3, 0.15, 0.05).expand(20_000, 4)
    processed = process_logits(x, top_k=3)  # token 3 filtered; renormalised [0.5, 0.3, 0.15] / 0.95
    gen = torch.Generator().manual_seed(0)
    tokens = sample_tokens(processed, gen)
    freq = torch.bincount(tokens, minlength=4).float() / tokens.numel()
    assert freq[3].item() == 0.0
    torch.testing.assert_close(freq[:3], torch.tensor([0.5, 0.3, 0.15]) / 0.95, rtol=0, atol=0.015)
    # same seed, same draws
    again = sample_tokens(processed, torch.Generator().manual_seed(0))
    assert torch.equal(tokens, again)


def test_response_logprobs_equals_stepwise_processing():
    torch.manual_seed(2)
    logits = torch.randn(2, 5, 30)
    tokens = torch.randint(0, 30, (2, 5))
    full = response_logprobs(logits, tokens, temperature=0.8, top_k=0, top_p=1.0)
    for t in range(5):
        step = token_logprobs(process_logits(logits[:, t], 0.8, 0, 1.0), tokens[:, t])
        torch.testing.assert_close(full[:, t], step, rtol=0, atol=0)
    assert full.dtype == torch.float32 and (full <= 0).all()


def test_low_precision_logits_are_processed_in_float32_and_differentiable():
    logits = torch.randn(3, 16, dtype=torch.bfloat16, requires_grad=True)
    lp = response_logprobs(logits[None], torch.tensor([[0, 1, 2]]), temperature=0.9, top_k=8, top_p=0.9)
    assert lp.dtype == torch.float32
    finite = torch.isfinite(lp)
    lp[finite].sum().backward()
    assert logits.grad is not None and torch.isfinite(logits.grad.float()).all()
    # entries filtered by top-k get no gradient
    filtered = ~torch.isfinite(process_logits(logits.detach(), 0.9, 8, 0.9))
    assert (logits.grad.float()[filtered] == 0).all()
