"""learner.batch: collate layout, group order, errors, micro-batches and the logits alignment."""

from __future__ import annotations

import pytest
import torch

from factories import sample
from learner.batch import BatchError, check_stop_tokens, collate, gather_response, micro_batches, response_logits

PAD = 0


def two_samples():
    a = sample(prompt_ids=[5, 6], response_ids=[7, 8, 9], behaviour_logprobs=[-0.1, -0.2, -0.3], token_versions=[3, 3, 4],
               reward=1.0, group_id="g0", group_size=2, index=0, ref_logprobs=[-1.0, -1.5, -2.0],
               reward_components={"count": 0.5})
    b = sample(prompt_ids=[10, 11, 12], response_ids=[13], behaviour_logprobs=[-0.5], token_versions=[2], reward=0.0,
               group_id="g0", group_size=2, index=1, ref_logprobs=[-0.7], finish_reason="length")
    return a, b


def test_collate_two_samples_exact_tensors():
    batch = collate(two_samples(), PAD)
    # L = max(2 + 3, 3 + 1) = 5, T = 3; right padding with PAD
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9], [10, 11, 12, 13, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    assert batch.response_start.tolist() == [2, 3]
    assert batch.response_ids.tolist() == [[7, 8, 9], [13, 0, 0]]
    assert batch.response_mask.tolist() == [[True, True, True], [True, False, False]]
    torch.testing.assert_close(batch.behaviour_logprobs, torch.tensor([[-0.1, -0.2, -0.3], [-0.5, 0.0, 0.0]]))
    torch.testing.assert_close(batch.ref_logprobs, torch.tensor([[-1.0, -1.5, -2.0], [-0.7, 0.0, 0.0]]))
    assert batch.token_versions.tolist() == [[3, 3, 4], [2, -1, -1]]
    assert batch.rewards.tolist() == [1.0, 0.0]
    assert batch.group_index.tolist() == [0, 0]
    assert batch.group_sizes.tolist() == [2]
    assert batch.truncated.tolist() == [False, True]
    assert batch.sample_ids == ["g0/0", "g0/1"]
    assert batch.lengths.tolist() == [5, 4]


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


def test_groups_become_contiguous_in_order_of_their_ids_whatever_the_arrival():
    s = [sample(prompt_ids=[1], response_ids=[6], group_id="A", group_size=3, index=2),
         sample(prompt_ids=[1], response_ids=[7], group_id="C", group_size=1, index=0),
         sample(prompt_ids=[1], response_ids=[5], group_id="B", group_size=2, index=0),
         sample(prompt_ids=[1], response_ids=[4], group_id="A", group_size=3, index=0)]
    batch = collate(s, PAD)
    assert batch.sample_ids == ["A/0", "A/2", "B/0", "C/0"]
    assert batch.response_ids[:, 0].tolist() == [4, 6, 5, 7]
    assert batch.group_index.tolist() == [0, 0, 1, 2]
    assert batch.group_sizes.tolist() == [2, 1, 1]  # A is partial (one sample dead-lettered)
    # the workers' timing decides the arrival order: any order of the same samples, the same batch
    for order in ([3, 2, 1, 0], [1, 3, 0, 2]):
        again = collate([s[i] for i in order], PAD)
        assert again.sample_ids == batch.sample_ids and again.input_ids.equal(batch.input_ids)


def test_ref_logprobs_are_all_or_none():
    a, b = two_samples()
    b.ref_logprobs = None
    assert collate([a, b], PAD).ref_logprobs is None


def test_token_ids_outside_the_vocabulary_name_both_vocabularies():
    s = [sample(prompt_ids=[1, 2], response_ids=[3, 120])]
    with pytest.raises(BatchError) as err:
        collate(s, PAD, vocab_size=99)
    msg = str(err.value)
    assert "same tokenizer" in msg and "learner vocab 99" in msg and "max 120" in msg
    collate(s, PAD, vocab_size=121)  # fits


def test_stop_tokens_must_be_the_learners_end_of_sequence_ids():
    eos = frozenset({2})
    fine = [sample(prompt_ids=[1], response_ids=[5, 6, 2]),  # stopped on EOS
            sample(prompt_ids=[1], response_ids=[5, 6, 7], finish_reason="length"),  # cut at the length limit: any last token
            sample(prompt_ids=[1], response_ids=[2], group_id="g1")]  # EOS as the only token
    check_stop_tokens(fine, eos)
    check_stop_tokens([sample(prompt_ids=[1], response_ids=[5, 3])], frozenset())  # no EOS known: nothing to check
    with pytest.raises(BatchError) as err:  # "stop" on <unk> (3): the worker's EOS is not ours
        check_stop_tokens(fine + [sample(prompt_ids=[1], response_ids=[5, 3], group_id="odd")], eos)
    assert "sample 'odd/0'" in str(err.value) and "finished with 'stop' on token 3" in str(err.value)
    assert "end-of-sequence token ids [2]" in str(err.value)
    with pytest.raises(BatchError, match="holds token 2 at position 1, where generation should have stopped"):
        check_stop_tokens([sample(prompt_ids=[1], response_ids=[5, 2, 7], finish_reason="length")], eos)  # our EOS did not stop it


def test_a_group_larger_than_its_group_size_is_refused():
    s = [sample(prompt_ids=[1], response_ids=[4], group_id="A", group_size=2, index=i % 2) for i in range(3)]
    with pytest.raises(BatchError, match="group 'A' has 3 samples .* group_size 2"):
        collate(s, PAD)


def test_empty_batch_and_empty_prompt_are_refused():
    with pytest.raises(BatchError, match="empty batch"):
        collate([], PAD)
    with pytest.raises(BatchError, match="empty prompt"):
        collate([sample(prompt_ids=[], response_ids=[4])], PAD)


def test_micro_batches_sort_by_length_and_trim_padding():
    lens = [(3, 2), (1, 3), (1, 1), (4, 3)]  # (prompt, response): totals 5, 4, 2, 7
    s = [sample(prompt_ids=list(range(1, p + 1)), response_ids=[9] * r, group_id=f"g{i}") for i, (p, r) in enumerate(lens)]
    batch = collate(s, PAD)
    assert tuple(batch.input_ids.shape) == (4, 7)
    got = [(rows.tolist(), tuple(mb.input_ids.shape), tuple(mb.response_mask.shape)) for rows, mb in micro_batches(batch, 2)]
    assert got == [([3, 0], (2, 7), (2, 3)), ([1, 2], (2, 4), (2, 3))]
    # size 3: a short last chunk, trimmed to its own lengths
    got = [(rows.tolist(), tuple(mb.input_ids.shape)) for rows, mb in micro_batches(batch, 3)]
    assert got == [([3, 0, 1], (3, 7)), ([2], (1, 2))]


def test_select_carries_extras_and_blanks_filler_rows():
    batch = collate(two_samples(), PAD)
    batch = batch.with_extras(adv=torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]]))
    sub = batch.select([1, 0], drop=[False, True])
    assert sub.sample_ids == ["g0/1", "g0/0"]
    assert sub.token_extras["adv"].tolist() == [[4.0, 0.0, 0.0], [1.0, 2.0, 3.0]]
    assert sub.response_mask.tolist() == [[True, False, False], [False, False, False]]  # row 2 is a filler
    only_b = batch.select([1])
    assert tuple(only_b.input_ids.shape) == (1, 4) and only_b.token_extras["adv"].tolist() == [[4.0]]


def test_stop_token_misfits_name_each_offending_sample():
    from learner.batch import stop_token_misfits

    eos = frozenset({2})
    samples = [
        sample(prompt_ids=[1], response_ids=[5, 2]),                         # fine: stops on EOS
        sample(prompt_ids=[1], response_ids=[5, 3], group_id="g2"),          # 'stop' on 3, not an EOS
        sample(prompt_ids=[1], response_ids=[2, 5, 6], finish_reason="length", group_id="g3"),  # EOS inside
    ]
    assert stop_token_misfits(samples, eos) == [
        (1, "finished with 'stop' on token 3, which is not one of them"),
        (2, "holds token 2 at position 0, where generation should have stopped"),
    ]
    assert stop_token_misfits(samples, frozenset()) == []


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

    from learner.batch import fused_head, fused_response_logprobs, lm_parts
    from learner.losses import entropy_from_logits
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
    from learner import batch as B
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
    from learner.batch import fused_head

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

    from learner.batch import chunked_response_logprobs, lm_parts
    from learner.losses import entropy_from_logits
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
