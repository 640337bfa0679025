"""learner.batch: collate layout, group order, errors and micro-batches."""

from __future__ import annotations

import pytest
import torch

from factories import sample
from learner.batch import BatchError, collate, micro_batches
from learner_helpers import PAD, two_samples


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
