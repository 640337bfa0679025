"""learner.lm_head: the logits alignment, the forward without a padding mask, the fused LM head
with its written-out backward, the chunked head, and the entropy of logits."""

from __future__ import annotations

import math

import pytest
import torch

from factories import sample
from learner.batch import collate
from learner.lm_head import entropy_from_logits, gather_response, response_logits
from learner_helpers import PAD, T, close, two_samples  # noqa: E402

INF = float("inf")


class TestEntropy:
    def test_values(self):
        # uniform over 4 -> ln 4; two -inf entries -> uniform over 2 -> ln 2;
        # [0, ln 3] -> -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.562335
        logits = T([[[0.0, 0.0, 0.0, 0.0], [0.0, -INF, -INF, 0.0], [0.0, math.log(3.0), -INF, -INF]]])
        close(entropy_from_logits(logits), [[math.log(4), math.log(2), 0.5623351]])

    def test_gradient_finite_with_neg_inf(self):
        logits = T([[[0.0, -INF, 1.0]]]).requires_grad_()
        entropy_from_logits(logits).sum().backward()
        assert torch.isfinite(logits.grad).all()


def test_response_positions_are_predicted_by_the_previous_position():
    batch = collate(two_samples(), PAD)
    # per-position outputs encode their position: out[b, p] = 10 * p + b
    out = torch.arange(5)[None, :] * 10 + torch.arange(2)[:, None]
    # row 0: response tokens at 2, 3, 4 are predicted at 1, 2, 3; row 1: token at 3 predicted at 2,
    # padding positions clamp inside the sequence (masked anyway)
    assert gather_response(out, batch).tolist() == [[10, 20, 30], [21, 31, 41]]
    # with logits_to_keep the outputs start at an offset: positions 1..4 kept
    assert gather_response(out[:, 1:], batch, offset=1).tolist() == [[10, 20, 30], [21, 31, 41]]


class OracleLM:
    """A 'model' whose logits at position p put all mass on input_ids[p + 1] (the next token)."""

    def __init__(self, vocab: int = 20, keep_arg: str = "honours"):
        self.vocab, self.keep_arg, self.calls = vocab, keep_arg, []

    def __call__(self, input_ids, attention_mask, use_cache=False, **kw):
        if "logits_to_keep" in kw and self.keep_arg == "refuses":
            raise TypeError("forward() got an unexpected keyword argument 'logits_to_keep'")
        nxt = torch.cat([input_ids[:, 1:], torch.zeros_like(input_ids[:, :1])], 1)
        logits = torch.nn.functional.one_hot(nxt, self.vocab).float() * 10
        keep = kw.get("logits_to_keep", 0) if self.keep_arg == "honours" else 0
        self.calls.append(keep)
        return type("Out", (), {"logits": logits[:, -keep:] if keep else logits})()


@pytest.mark.parametrize("keep_arg", ["honours", "refuses", "ignores"])
def test_response_logits_predict_the_response_tokens(keep_arg):
    batch = collate(two_samples(), PAD)
    lm = OracleLM(keep_arg=keep_arg)
    logits = response_logits(lm, batch)
    assert logits.shape == (2, 3, 20)
    pred = logits.argmax(-1)
    assert pred[batch.response_mask].tolist() == [7, 8, 9, 13]
    # the shortest prompt has 2 tokens: positions 1..4 are needed, so 4 of 5 are kept
    # honoured: the LM head runs on 4 of 5 positions; refused (TypeError): one full pass after
    # the refusal; ignored (swallowed by **kwargs): full logits, still aligned
    assert lm.calls == ([4] if keep_arg == "honours" else [0])


@pytest.mark.parametrize(("compiled", "keep"), [(False, False), (True, False), (False, True)],
                         ids=["eager", "compiled", "kept-logits"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_logprobs_equal_the_full_logits_path_values_and_gradients(tiny_model_cfg, temperature, compiled, keep):
    # The written-out backward of the fused head (chunks of 5 of the 21 response positions, the
    # last chunk short) against autograd through one [B, T, V] logits tensor: log-probs,
    # entropies (a statistic: no gradient) and every parameter's gradient, the tied head's too;
    # its elementwise work in eager torch and through torch.compile (learner.compile); the
    # backward recomputing each chunk's logits, or reading those the forward kept
    # (learner.keep_head_logits).
    import copy

    from learner.lm_head import fused_head, fused_response_logprobs, lm_parts
    from rlhf_core.models import load_policy
    from rlhf_core.sampling import process_logits, token_logprobs

    model = load_policy(tiny_model_cfg)
    twin = copy.deepcopy(model)
    batch = collate([sample(prompt_ids=[1, 5 + i, 6], response_ids=[7 + j for j in range(3 + 2 * i)], group_id=f"g{i}")
                     for i in range(3)], pad_id=0, device=torch.device("cpu"), vocab_size=99)
    full = process_logits(response_logits(model, batch), temperature, 0, 1.0)
    want_logp, want_ent = token_logprobs(full, batch.response_ids), entropy_from_logits(full)
    body, head = lm_parts(twin)
    got_logp, got_ent = fused_response_logprobs(body, fused_head(head), batch, temperature, 5, True, compiled, keep)
    mask = batch.response_mask
    torch.testing.assert_close(got_logp[mask], want_logp[mask], rtol=0, atol=1e-5)
    torch.testing.assert_close(got_ent[mask], want_ent[mask], rtol=0, atol=1e-5)
    assert not got_ent.requires_grad
    weights = torch.linspace(-1.0, 1.0, mask.numel()).reshape(mask.shape)  # a different gradient per token
    (want_logp * weights * mask).sum().backward()
    (got_logp * weights * mask).sum().backward()
    for (name, a), b in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_a_no_grad_pass_keeps_no_head_logits(tiny_model_cfg, monkeypatch):
    # learner.keep_head_logits holds a micro-batch's logits for its backward; a pass with no
    # backward (pi_prox, reference log-probs) must still hold one chunk at a time
    from learner import lm_head as B
    from rlhf_core.models import load_policy

    seen = []
    real = B._LinearLogprobs.apply
    monkeypatch.setattr(B._LinearLogprobs, "apply", lambda *a: seen.append(a[-1]) or real(*a))
    body, head = B.lm_parts(load_policy(tiny_model_cfg))
    batch = collate([sample(prompt_ids=[1, 5, 6], response_ids=[7, 8, 9, 10])], pad_id=0, device=torch.device("cpu"),
                    vocab_size=99)
    with torch.no_grad():
        B.fused_response_logprobs(body, B.fused_head(head), batch, 1.0, 2, False, keep_logits=True)
    B.fused_response_logprobs(body, B.fused_head(head), batch, 1.0, 2, False, keep_logits=True)
    assert seen == [False, True]


def test_policy_forward_without_the_padding_mask_gives_every_real_token_the_masked_result(tiny_model_cfg):
    # Rows of 4, 6 and 8 tokens right-padded to 8: the learner's forward passes no attention mask
    # (causal attention never looks right), so each response token's log-prob and its gradient
    # must be those of a forward with the padding mask. Padding positions may differ: no loss reads them.
    import copy

    from rlhf_core.models import load_policy
    from rlhf_core.sampling import token_logprobs

    model = load_policy(tiny_model_cfg)
    twin = copy.deepcopy(model)
    batch = collate([sample(prompt_ids=[1, 5 + i], response_ids=[7 + j for j in range(2 + 2 * i)], group_id=f"g{i}")
                     for i in range(3)], pad_id=0, device=torch.device("cpu"), vocab_size=99)
    assert batch.attention_mask.sum(-1).tolist() == [4, 6, 8]
    masked = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    want = token_logprobs(gather_response(masked, batch), batch.response_ids)
    got = token_logprobs(response_logits(twin, batch), batch.response_ids)
    mask = batch.response_mask
    torch.testing.assert_close(got[mask], want[mask], rtol=0, atol=1e-5)
    (want * mask).sum().backward()
    (got * mask).sum().backward()
    for (name, a), b in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_fused_head_only_for_a_plain_bias_free_linear():
    from learner.lm_head import fused_head

    plain = torch.nn.Linear(4, 6, bias=False)
    assert fused_head(plain) is plain.weight
    assert fused_head(torch.nn.Linear(4, 6)) is None  # a bias: the chunked path
    class Wrapped(torch.nn.Linear):  # a subclass (a LoRA layer, a quantised head) may compute more
        pass
    assert fused_head(Wrapped(4, 6, bias=False)) is None
    partitioned = torch.nn.Linear(4, 6, bias=False)
    partitioned.weight = torch.nn.Parameter(torch.empty(0))  # what ZeRO-3 leaves outside a forward
    assert fused_head(partitioned) is None


@pytest.mark.parametrize("settings", [(1.0, 0, 1.0), (0.8, 20, 0.9)])
def test_chunked_logprobs_equal_the_full_logits_path_values_and_gradients(tiny_model_cfg, settings):
    # Chunks of 5 response positions (the batch has 3 x 7 = 21): the numbers and the gradients
    # must be those of one [B, T, V] logits tensor, to float tolerance.
    import copy

    from learner.lm_head import chunked_response_logprobs, lm_parts
    from rlhf_core.models import load_policy
    from rlhf_core.sampling import process_logits, token_logprobs

    model = load_policy(tiny_model_cfg)
    twin = copy.deepcopy(model)
    batch = collate([sample(prompt_ids=[1, 5 + i, 6], response_ids=[7 + j for j in range(3 + 2 * i)], group_id=f"g{i}")
                     for i in range(3)], pad_id=0, device=torch.device("cpu"), vocab_size=99)
    t, k, p = settings
    process = lambda x: process_logits(x, t, k, p)  # noqa: E731
    full = process(response_logits(model, batch))
    want_logp, want_ent = token_logprobs(full, batch.response_ids), entropy_from_logits(full)
    got_logp, got_ent = chunked_response_logprobs(*lm_parts(twin), batch, process, 5, entropy_from_logits)
    mask = batch.response_mask
    torch.testing.assert_close(got_logp[mask], want_logp[mask], rtol=0, atol=1e-5)
    torch.testing.assert_close(got_ent[mask], want_ent[mask], rtol=0, atol=1e-5)
    ((want_logp + want_ent) * mask).sum().backward()
    ((got_logp + got_ent) * mask).sum().backward()
    for (name, a), b in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)
