"""learner.batch: the stop-token check, collate layout, group order, errors and micro-batches."""

from __future__ import annotations

import pytest
import torch

from factories import sample
from learner.batch import BatchError, collate, micro_batches, split_stop_token_misfits
from learner_helpers import PAD, two_samples
from rlhf_core.errors import FailureWindow


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


def refuse_misfits(samples, eos):
    """The intake as it is once most recent samples misfit: the first misfit raises."""
    return split_stop_token_misfits(samples, eos, FailureWindow(window=1, max_share=0.0, min_count=1))


def test_stop_tokens_must_be_the_learners_end_of_sequence_ids():
    eos = frozenset({2})
    fine = [sample(prompt_ids=[1], response_ids=[5, 6, 2]),  # stopped on EOS
            sample(prompt_ids=[1], response_ids=[5, 6, 7], finish_reason="length"),  # cut at the length limit: any last token
            sample(prompt_ids=[1], response_ids=[2], group_id="g1")]  # EOS as the only token
    assert refuse_misfits(fine, eos) == (fine, [])
    odd = [sample(prompt_ids=[1], response_ids=[5, 3])]
    assert refuse_misfits(odd, frozenset()) == (odd, [])  # no EOS known (or stop strings): nothing to check
    with pytest.raises(BatchError) as err:  # "stop" on <unk> (3): the worker's EOS is not ours
        refuse_misfits(fine + [sample(prompt_ids=[1], response_ids=[5, 3], group_id="odd")], eos)
    assert "sample 'odd/0'" in str(err.value) and "finished with 'stop' on token 3" in str(err.value)
    assert "end-of-sequence token ids [2]" in str(err.value)
    with pytest.raises(BatchError, match="holds token 2 at position 1, where generation should have stopped"):
        refuse_misfits([sample(prompt_ids=[1], response_ids=[5, 2, 7], finish_reason="length")], eos)  # our EOS did not stop it


def test_a_few_misfits_are_set_aside_and_many_stop_the_learner(tiny_model_cfg):
    # The Learner's window: more than half of the last 64 samples, once 8 are seen. A first group
    # of 4 stopping on <unk> is set aside (to be dead-lettered), the rest kept; a second such
    # group makes 8 of 12 misfits: the tokenizers differ, and nothing is trained.
    from learner.trainer import _check_tokenizer
    from rlhf_core.models import load_policy

    eos = _check_tokenizer(None, load_policy(tiny_model_cfg))
    assert eos == frozenset({2})
    assert _check_tokenizer(None, load_policy(tiny_model_cfg), stop_strings=["."]) == frozenset()  # check off
    recent = FailureWindow(window=64, max_share=0.5, min_count=8)
    odd = [sample(prompt_ids=[20], response_ids=[21, 3], group_id="odd", group_size=4, index=i) for i in range(4)]
    own = [sample(prompt_ids=[20], response_ids=[21, 2], group_id="own", group_size=4, index=i) for i in range(4)]
    keep, misfits = split_stop_token_misfits(odd + own, eos, recent)
    assert keep == own and [s for s, _ in misfits] == odd
    assert misfits[0][1] == ("sample 'odd/0' from worker w0 does not fit the learner's end-of-sequence token ids "
                             "[2]: it finished with 'stop' on token 3, which is not one of them")
    with pytest.raises(BatchError, match="end-of-sequence token ids \\[2\\]: it finished with 'stop' on token 3"):
        split_stop_token_misfits(odd, eos, recent)


def test_a_group_larger_than_its_group_size_is_refused():
    s = [sample(prompt_ids=[1], response_ids=[4], group_id="A", group_size=2, index=i % 2) for i in range(3)]
    with pytest.raises(BatchError, match="group 'A' has 3 samples .* group_size 2"):
        collate(s, PAD)
    # the samples agree, the learner's algo.group_size does not (an estimator comparing a group's responses)
    five = [sample(prompt_ids=[20], response_ids=[21], group_id="g", group_size=5, index=i) for i in range(5)]
    with pytest.raises(BatchError, match="5 samples but algo.group_size is 4"):
        collate(five, PAD, max_group_size=4)
    assert collate(five, PAD).group_sizes.tolist() == [5]  # an estimator that does not compare: any size


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


