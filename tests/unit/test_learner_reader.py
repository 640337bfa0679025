"""learner.reader: the tokenizer against the model, and the samples' end-of-sequence tokens
against the learner's (a few misfits set aside, most of them stop the learner)."""

from __future__ import annotations

import pytest

from factories import sample
from learner.batch import BatchError
from learner.reader import check_tokenizer, split_stop_token_misfits, stop_token_misfits
from rlhf_core.errors import FailureWindow


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
    from rlhf_core.models import load_policy

    eos = check_tokenizer(None, load_policy(tiny_model_cfg))
    assert eos == frozenset({2})
    assert check_tokenizer(None, load_policy(tiny_model_cfg), stop_strings=["."]) == frozenset()  # check off
    recent = FailureWindow(window=64, max_share=0.5, min_count=8)
    odd = [sample(prompt_ids=[20], response_ids=[21, 3], group_id="odd", group_size=4, index=i) for i in range(4)]
    own = [sample(prompt_ids=[20], response_ids=[21, 2], group_id="own", group_size=4, index=i) for i in range(4)]
    keep, misfits = split_stop_token_misfits(odd + own, eos, recent)
    assert keep == own and [s for s, _ in misfits] == odd
    assert misfits[0][1] == ("sample 'odd/0' from worker w0 does not fit the learner's end-of-sequence token ids "
                             "[2]: it finished with 'stop' on token 3, which is not one of them")
    with pytest.raises(BatchError, match="end-of-sequence token ids \\[2\\]: it finished with 'stop' on token 3"):
        split_stop_token_misfits(odd, eos, recent)


def test_stop_token_misfits_name_each_offending_sample():
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
