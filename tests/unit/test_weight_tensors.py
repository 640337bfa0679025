"""Torch-side helpers of the weight server: inputs, byte views (bfloat16 included), target checks."""

from __future__ import annotations

import pytest
import torch

from rlhf_core.errors import UserError
from weight_server import protocol as P
from weight_server.errors import TensorMismatchError
from weight_server.tensors import byte_view, check_target, named_tensors, staged, target_of, transfer_dtype


def test_named_tensors_sorted_from_module_mapping_and_pairs():
    lin = torch.nn.Linear(2, 3)
    assert [n for n, _ in named_tensors(lin)] == ["bias", "weight"]
    assert [n for n, _ in named_tensors({"z": torch.zeros(1), "a": torch.ones(1)})] == ["a", "z"]
    assert [n for n, _ in named_tensors(iter([("y", torch.zeros(1)), ("x", torch.zeros(1))]))] == ["x", "y"]


@pytest.mark.parametrize(
    "source, message",
    [
        ([("a", torch.zeros(1)), ("a", torch.zeros(1))], "appears twice"),
        ({"a": [1.0]}, "not a torch.Tensor"),
        ({"a": torch.zeros(2, dtype=torch.complex64)}, "cannot go on the wire"),
        ({"": torch.zeros(1)}, "non-empty strings"),
    ],
)
def test_named_tensors_rejects(source, message):
    with pytest.raises(UserError, match=message):
        named_tensors(source)


def test_byte_view_is_zero_copy_and_handles_bfloat16():
    t = torch.tensor([1.0, -2.0], dtype=torch.bfloat16)
    view = byte_view(t)
    assert bytes(view) == t.view(torch.int16).numpy().tobytes()
    assert len(view) == 4
    f = torch.zeros(3)
    v = byte_view(f)
    f[0] = 1.0  # the view sees later writes: no copy was made
    assert bytes(v[:4]) == torch.tensor([1.0]).numpy().tobytes()
    assert bytes(byte_view(torch.zeros(0))) == b""


def test_transfer_dtype_names():
    assert transfer_dtype("as_trained") is None
    assert transfer_dtype("bfloat16") is torch.bfloat16
    assert transfer_dtype(torch.float16) is torch.float16
    with pytest.raises(UserError, match="not one of"):
        transfer_dtype("fp8")


def test_check_target_names_missing_and_extra():
    lay = P.make_layout([("a", "float32", [2]), ("b", "float32", [3])])
    with pytest.raises(TensorMismatchError, match=r"1 published tensor\(s\) missing from the target \(e.g. \['b'\]\)"):
        check_target(lay, {"a": torch.zeros(2)})
    with pytest.raises(TensorMismatchError, match=r"1 target tensor\(s\) not in the published version \(e.g. \['c'\]\)"):
        check_target(lay, {"a": torch.zeros(2), "b": torch.zeros(3), "c": torch.zeros(1)})
    with pytest.raises(TensorMismatchError, match=r"tensor 'b': target shape \(4,\) != published shape \(3,\)"):
        check_target(lay, {"a": torch.zeros(2), "b": torch.zeros(4)})
    check_target(lay, {"a": torch.zeros(2, dtype=torch.float64), "b": torch.zeros(3)})  # dtypes may differ


def test_staged_views_share_the_staging_buffer():
    lay = P.make_layout([("a", "float32", [2]), ("b", "bfloat16", [2, 2])])
    slab = torch.zeros(lay.total_bytes, dtype=torch.uint8)
    a = staged(slab, lay, 0)
    b = staged(slab, lay, 1)
    slab[0:4] = torch.tensor([1.5]).view(torch.uint8)
    assert a.tolist() == [1.5, 0.0]
    assert b.shape == (2, 2) and b.dtype == torch.bfloat16
    assert b.data_ptr() == slab.data_ptr() + 64


def test_target_of_rejects_other_types():
    with pytest.raises(UserError, match="takes an nn.Module or a dict of tensors"):
        target_of([torch.zeros(1)])
    with pytest.raises(UserError, match="values must be tensors"):
        target_of({"a": 1.0})


def test_target_of_a_module_with_tied_weights_names_each_tensor_once():
    # Qwen2-0.5B ties lm_head to the embedding: a learner publishes named_parameters(), which
    # holds the shared tensor once, under its first name; the pull target must not ask for the alias.
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(5, 3)
            self.head = torch.nn.Linear(3, 5, bias=False)
            self.head.weight = self.embed.weight
            self.register_buffer("scale", torch.ones(3))

    m = Tied()
    assert list(m.state_dict()) == ["scale", "embed.weight", "head.weight"]
    target = target_of(m)
    assert list(target) == ["scale", "embed.weight"]
    assert [n for n, _ in m.named_parameters()] == ["embed.weight"]  # what a learner publishes, with "scale"
    target["embed.weight"].copy_(torch.full((5, 3), 2.0))
    assert bool((m.head.weight == 2.0).all())  # the alias follows the tensor it shares
    # untied modules keep every name
    assert list(target_of(torch.nn.Linear(2, 2))) == ["weight", "bias"]
