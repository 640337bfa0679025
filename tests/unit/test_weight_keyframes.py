"""Keyframe policy and pull plans: which versions travel as deltas, what a worker holding some
version is sent, and that every worker ends bit for bit on the learner's content hash."""

from __future__ import annotations

import pytest
import torch

from rlhf_core.choices import DeltaMode
from rlhf_core.config import WeightServerConfig
from weight_server import delta as D
from weight_server import protocol as P
from weight_server.keyframes import KeyframePolicy, PullPlan, VersionDelta, apply, apply_verified, plan_pull
from weight_server.tensors import TORCH_TO_WIRE, byte_view


def _version(tensors: dict[str, torch.Tensor]) -> tuple[P.Layout, list[memoryview]]:
    views = [byte_view(t) for t in tensors.values()]
    layout = P.make_layout([(n, TORCH_TO_WIRE[t.dtype], tuple(t.shape)) for n, t in tensors.items()],
                           [P.tensor_hash(v) for v in views])
    return layout, views


def _meta(tensors: dict[str, torch.Tensor]) -> tuple[list[str], list[int]]:
    return [TORCH_TO_WIRE[t.dtype] for t in tensors.values()], [t.element_size() for t in tensors.values()]


def _nudge(tensors: dict[str, torch.Tensor], g: torch.Generator, share: float) -> dict[str, torch.Tensor]:
    """A copy with about ``share`` of each floating tensor's elements moved by one step of 1%."""
    out = {}
    for name, t in tensors.items():
        t = t.clone()
        if t.is_floating_point() and t.numel():
            mask = torch.rand(t.shape, generator=g) < share
            t[mask] = (t[mask].float() * 1.01).to(t.dtype)
        out[name] = t
    return out


@pytest.mark.parametrize(
    ("mode", "dtype", "tries"),
    # auto: 16-bit floats only; on: every float; off: nothing. Integer tensors never.
    [(DeltaMode.auto, "bfloat16", True), (DeltaMode.auto, "float16", True), (DeltaMode.auto, "float32", False),
     (DeltaMode.on, "float32", True), (DeltaMode.off, "bfloat16", False), (DeltaMode.on, "int64", False)],
)
def test_which_dtypes_try_a_delta(mode, dtype, tries):
    assert KeyframePolicy(mode).tries_delta(dtype) is tries


def test_policy_from_config_checks_it():
    cfg = WeightServerConfig(delta=DeltaMode.auto, keyframe_every=4, delta_max_share=0.25)
    assert KeyframePolicy.of(cfg) == KeyframePolicy(DeltaMode.auto, 4, 0.25)


def test_keyframe_every_and_gaps_and_off():
    # A 4096-element bf16 tensor (8192 bytes) with one change: the xor entry is a tag byte + zlib
    # of 8190 zero bytes and one 0x80 (about 40 bytes), a delta. A 4-element one (8 bytes) with one
    # change: the xor would be ~16 bytes, so the entry is `whole` (1 + 8 = 9 bytes), not below
    # 0.5 * 8: a keyframe.
    old = torch.zeros(4096, dtype=torch.bfloat16)
    new = old.clone()
    new[2] = 1.0
    args = ([byte_view(old)], [byte_view(new)], ["bfloat16"], [2])
    tiny = ([byte_view(old[:4])], [byte_view(new[:4])], ["bfloat16"], [2])
    policy = KeyframePolicy(DeltaMode.auto, keyframe_every=3, max_share=0.5)
    delta = policy.encode(4, 5, 0, *args)
    assert delta is not None and delta.nbytes < 100 and D.codec_of(delta.entries[0]) == D.DeltaCodec.xor
    assert policy.encode(4, 5, 1, *args) is not None
    assert policy.encode(4, 5, 2, *args) is None  # the third version after a keyframe: keyframe_every=3
    assert policy.encode(4, 6, 0, *args) is None  # a gap: not a delta against v4
    assert policy.encode(4, 5, 0, *tiny) is None  # not below half the whole
    assert KeyframePolicy(DeltaMode.off).encode(4, 5, 0, *args) is None


def test_float32_under_auto_goes_whole_inside_a_delta():
    # a bf16 tensor with one change travels as xor; an fp32 one (auto: never delta-encoded) whole,
    # an unchanged fp32 one as `same` (1 byte)
    b16 = torch.zeros(4096, dtype=torch.bfloat16)
    f32, same = torch.zeros(64), torch.ones(64)
    nb16, nf32 = b16.clone(), f32.clone()
    nb16[0], nf32[0] = 1.0, 1.0
    delta = KeyframePolicy(DeltaMode.auto).encode(
        0, 1, 0, [byte_view(b16), byte_view(f32), byte_view(same)], [byte_view(nb16), byte_view(nf32), byte_view(same)],
        ["bfloat16", "float32", "float32"], [2, 4, 4])
    assert delta is not None
    assert [D.codec_of(e) for e in delta.entries] == [D.DeltaCodec.xor, D.DeltaCodec.whole, D.DeltaCodec.same]
    assert len(delta.entries[1]) == 1 + 256 and len(delta.entries[2]) == 1


@pytest.mark.parametrize(
    ("held", "newest", "keyframe", "deltas", "plan"),
    [
        (4, 5, 0, [1, 2, 3, 4, 5], PullPlan(False, (5,))),  # holds v-1: only the delta
        (2, 5, 0, [1, 2, 3, 4, 5], PullPlan(False, (3, 4, 5))),  # missed two: the deltas since
        (0, 5, 0, [1, 2, 3, 4, 5], PullPlan(False, (1, 2, 3, 4, 5))),  # holds the keyframe itself
        (None, 5, 0, [1, 2, 3, 4, 5], PullPlan(True)),  # joined late: the whole newest version
        (3, 12, 10, [11, 12], PullPlan(True)),  # older than the newest keyframe
        (11, 13, 10, [13], PullPlan(True)),  # delta v12 not held (the server restarted): whole
        (5, 5, 0, [1, 2, 3, 4, 5], PullPlan(False)),  # already current: nothing
        (7, 5, 0, [1, 2, 3, 4, 5], PullPlan(True)),  # ahead of the server (it lost versions): whole
        (4, 5, None, [], PullPlan(True)),  # no keyframe yet
    ],
)
def test_plan_pull(held, newest, keyframe, deltas, plan):
    assert plan_pull(held, newest, keyframe, deltas) == plan


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_workers_at_every_version_end_bit_for_bit_on_the_published_hash(dtype):
    # A learner publishes 12 versions (keyframe_every=5, so keyframes at v0, v5, v10); the
    # "server" keeps its newest keyframe and the deltas since. A worker holding each earlier version
    # follows its plan and must land on v11's content hash exactly.
    g = torch.Generator().manual_seed(0)
    cur = {"a.weight": torch.randn(64, 33, generator=g).to(dtype), "b.bias": torch.randn(7, generator=g).to(dtype),
           "c.steps": torch.arange(5)}
    policy = KeyframePolicy(DeltaMode.auto, keyframe_every=5, max_share=0.9)
    dtypes, sizes = _meta(cur)
    history = {0: cur}
    keyframe, since, deltas = 0, 0, {}
    for v in range(1, 12):
        new = _nudge(history[v - 1], g, 0.05)
        history[v] = new
        d = policy.encode(v - 1, v, since, _version(history[v - 1])[1], _version(new)[1], dtypes, sizes)
        if d is None:
            keyframe, since, deltas = v, 0, {}
        else:
            since += 1
            deltas[v] = d
    assert keyframe == 10 and sorted(deltas) == [11]
    want = _version(history[11])[0]
    for held in range(12):
        plan = plan_pull(held, 11, keyframe, list(deltas))
        if plan.whole:
            got = [bytes(v) for v in _version(history[11])[1]]
        else:
            got = [bytes(v) for v in _version(history[held])[1]]
            for v in plan.deltas:
                got = [bytes(b) for b in apply(got, deltas[v], sizes)]
        assert [P.tensor_hash(b) for b in got] == want.hashes(), held
        assert plan.whole == (held < 10)


def test_a_corrupted_delta_fails_the_hash_check():
    # one flipped byte inside a `whole` entry decodes fine but no longer hashes to the published
    # tensor: the worker must see the mismatch (and pull whole), never apply it silently
    # (random new values: their xor does not compress, so the entry is `whole`; a flipped byte in
    # an xor entry fails zlib's checksum instead, a DeltaError, which also means a whole pull)
    g = torch.Generator().manual_seed(1)
    # (an unchanged 1 KiB tensor beside it keeps the version's delta below half the whole: 66 bytes
    # against 1088)
    old = {"u": torch.zeros(256), "w": torch.zeros(16)}
    new = {"u": torch.zeros(256), "w": torch.randn(16, generator=g)}
    d = KeyframePolicy(DeltaMode.on).encode(0, 1, 0, _version(old)[1], _version(new)[1], ["float32"] * 2, [4, 4])
    assert d is not None and [D.codec_of(e) for e in d.entries] == [D.DeltaCodec.same, D.DeltaCodec.whole]
    assert d.nbytes == 1 + 65
    bad = bytearray(d.entries[1])
    bad[5] ^= 0x01
    got = apply([bytes(v) for v in _version(old)[1]], VersionDelta(0, 1, (d.entries[0], bytes(bad))), [4, 4])
    assert P.tensor_hash(got[1]) != _version(new)[0].hashes()[1]
    with pytest.raises(D.DeltaError, match="2 tensors"):
        apply([b""], d, [4])


def test_apply_verified_lands_on_the_hashes_or_refuses(caplog):
    # v0 -> v1 -> v2 (bf16, 5% of elements nudged each): the chain from v0 lands on v2's published
    # hashes; a chain with one flipped byte (in a decodable `whole` entry, so only the hash can
    # tell) or one that does not decode gives None and a log line: pull the whole version
    g = torch.Generator().manual_seed(2)
    v0 = {"a": torch.randn(2048, generator=g).to(torch.bfloat16), "b": torch.randn(8, generator=g).to(torch.bfloat16)}
    v1 = _nudge(v0, g, 0.05)
    v2 = _nudge(v1, g, 0.05)
    dtypes, sizes = _meta(v0)
    policy = KeyframePolicy(DeltaMode.auto, max_share=0.9)
    d1 = policy.encode(0, 1, 0, _version(v0)[1], _version(v1)[1], dtypes, sizes)
    d2 = policy.encode(1, 2, 1, _version(v1)[1], _version(v2)[1], dtypes, sizes)
    assert d1 is not None and d2 is not None
    layout2, views2 = _version(v2)
    got = apply_verified(_version(v0)[1], [d1, d2], layout2)
    assert got is not None and [bytes(b) for b in got] == [bytes(v) for v in views2]
    assert apply_verified(_version(v0)[1], [d2], layout2) is None  # v1's delta skipped: hashes differ
    assert D.codec_of(d2.entries[1]) == D.DeltaCodec.whole  # 8 bf16 values: the xor is not smaller
    flipped = bytearray(d2.entries[1])
    flipped[3] ^= 0x40
    bad = VersionDelta(1, 2, (d2.entries[0], bytes(flipped)))
    with caplog.at_level("WARNING", logger="weight_server.keyframes"):
        assert apply_verified(_version(v0)[1], [d1, bad], layout2) is None
        assert apply_verified(_version(v0)[1], [d1, VersionDelta(1, 2, (d2.entries[0][:-3], d2.entries[1]))], layout2) is None
    assert "differ from the published hashes" in caplog.text and "did not apply" in caplog.text
