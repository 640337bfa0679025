"""Weight-server wire protocol: layout, content hash, header caps, segment checks, HMAC, chunk plan."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlhf_core.wire import WireError, encode_record
from weight_server import protocol as P
from weight_server.auth import Signer
from weight_server.publisher import plan_chunks
from weight_server.tensors import byte_view

H0 = bytes(16)
H1 = bytes([1]) * 16


def test_layout_aligns_every_tensor_to_64_bytes():
    # float32 [3] = 12 bytes at 0; int64 [2, 5] = 80 bytes at 64; bfloat16 [] = 2 bytes at 64 + 128 = 192
    lay = P.make_layout([("a", "float32", [3]), ("b", "int64", [2, 5]), ("c", "bfloat16", [])])
    assert [(t.offset, t.nbytes) for t in lay.tensors] == [(0, 12), (64, 80), (192, 2)]
    assert lay.total_bytes == 256
    assert lay.data_bytes == 94


def test_chunk_ranges_and_covering():
    assert P.chunk_count(0, 10) == 0
    assert P.chunk_count(25, 10) == 3
    assert P.chunk_range(2, 25, 10) == (20, 5)
    lay = P.make_layout([("a", "uint8", [100]), ("b", "uint8", [10]), ("c", "uint8", [300])])
    # a: [0, 100), b: [128, 138), c: [192, 492); chunks of 64 bytes
    assert P.chunks_covering(lay, [1], 64) == [2]
    assert P.chunks_covering(lay, [0], 64) == [0, 1]
    assert P.chunks_covering(lay, [2], 64) == [3, 4, 5, 6, 7]


def test_content_hash_depends_on_name_dtype_shape_and_bytes():
    base = P.make_layout([("w", "float32", [2, 3])], [H0]).content_hash()
    assert P.make_layout([("w", "float32", [2, 3])], [H0]).content_hash() == base
    assert P.make_layout([("w", "float32", [3, 2])], [H0]).content_hash() != base  # same bytes, other shape
    assert P.make_layout([("v", "float32", [2, 3])], [H0]).content_hash() != base
    assert P.make_layout([("w", "int32", [2, 3])], [H0]).content_hash() != base
    assert P.make_layout([("w", "float32", [2, 3])], [H1]).content_hash() != base
    assert len(base) == 16


def _tensor_list(items):
    return {"tensors": items}


@pytest.mark.parametrize(
    "items, message",
    [
        ([["b", "float32", [1], H0], ["a", "float32", [1], H0]], "sorted"),
        ([["a", "float32", [1], H0], ["a", "float32", [1], H0]], "unique"),
        ([["a", "complex64", [1], H0]], "unknown dtype"),
        ([["a", "float32", [-1], H0]], "shape"),
        ([["a", "float32", [1], b"short"]], "hash must be 16 bytes"),
        ([["a", "float32", [1]]], "must be [name, dtype, shape, hash]"),
        ([["", "float32", [1], H0]], "tensor name"),
    ],
)
def test_tensor_list_rejects(items, message):
    with pytest.raises(WireError, match=message.replace("[", r"\[").replace("]", r"\]")):
        P.parse_tensor_list(_tensor_list(items), "tensors", max_tensors=10, max_version_bytes=1 << 20)


def test_tensor_list_caps_count_and_size():
    items = [[f"t{i:02d}", "uint8", [1], H0] for i in range(11)]
    with pytest.raises(WireError, match="11 tensors exceed max_tensors 10"):
        P.parse_tensor_list(_tensor_list(items), "tensors", max_tensors=10, max_version_bytes=1 << 20)
    with pytest.raises(WireError, match="exceeds max_version_bytes 1000"):
        P.parse_tensor_list(_tensor_list([["a", "float32", [1000], H0]]), "tensors", 10, 1000)


def test_header_caps_apply_per_kind():
    small = P.encode(P.LATEST, rid=1, name="policy")
    assert P.decode(small, P.CLIENT_KINDS, 64, 1024)["name"] == "policy"
    big_latest = P.encode(P.LATEST, rid=1, name="x" * 200)
    with pytest.raises(WireError, match="exceeds max_header_bytes 64"):
        P.decode(big_latest, P.CLIENT_KINDS, 64, 1024)
    # a PUB_BEGIN carries the tensor list and may use max_manifest_bytes
    begin = P.encode(P.PUB_BEGIN, rid=1, name="p", version=1, tensors=[["a", "uint8", [1], H0]] * 5, content_hash=H0)
    assert 64 < len(begin) < 1024
    assert P.decode(begin, P.CLIENT_KINDS, 64, 1024)["kind"] == P.PUB_BEGIN
    with pytest.raises(WireError, match="exceeds the cap of 100 bytes"):
        P.decode(begin, P.CLIENT_KINDS, 64, 100)


def test_decode_rejects_server_kinds_and_garbage():
    with pytest.raises(WireError, match="expected a record of kind"):
        P.decode(encode_record(P.CHUNK, {"rid": 1}), P.CLIENT_KINDS, 1024, 1024)
    with pytest.raises(WireError):
        P.decode(b"\xc1\xff\x00garbage", P.CLIENT_KINDS, 1024, 1024)


@pytest.mark.parametrize(
    "segments, message",
    [
        ([[0, 10], [5, 10]], "overlaps"),
        ([[0, 10], [95, 10]], "outside"),
        ([[-1, 4]], "outside"),
        ([], "1-4096 segments"),
        ([[0, "x"]], "two ints"),
    ],
)
def test_segments_rejected(segments, message):
    with pytest.raises(WireError, match=message):
        P.parse_segments({"segments": segments}, total_bytes=100)


def test_segments_accepted_in_order():
    assert P.parse_segments({"segments": [[0, 10], [10, 5], [64, 36]]}, 100) == [(0, 10), (10, 5), (64, 36)]


def test_hmac_covers_bytes_and_frame_boundaries():
    signer = Signer("0123456789abcdef-secret")
    frames = [b"header", memoryview(b"abcdef")]
    mac = signer.sign(frames)
    assert len(mac) == 32
    assert signer.verify(frames, mac)
    assert not signer.verify([b"header", b"abcdeX"], mac)
    assert not signer.verify([b"headerabc", b"def"], mac)  # same concatenation, other framing
    assert not Signer("another-secret-of-16+").verify(frames, mac)


def test_plan_chunks_packs_small_and_slices_large_zero_copy():
    tensors = [
        ("a.small", torch.arange(10, dtype=torch.float32)),  # 40 bytes
        ("b.small", torch.arange(3, dtype=torch.int64)),  # 24 bytes
        ("c.big", torch.arange(5000, dtype=torch.float32)),  # 20000 bytes
        ("d.small", torch.ones(4, dtype=torch.bfloat16)),  # 8 bytes
    ]
    views = [byte_view(t) for _, t in tensors]
    lay = P.make_layout([(n, str(t.dtype).split(".")[1], list(t.shape)) for n, t in tensors])
    chunks = list(plan_chunks(lay, views, range(4), chunk_bytes=8192, small=1024))
    # a+b packed into one frame [0, 64 + 24); c split into 8192 + 8192 + 3616; d alone (after c)
    segs = [seg for s, _ in chunks for seg in s]
    assert segs == [[0, 88], [128, 8192], [128 + 8192, 8192], [128 + 16384, 3616], [20160, 8]]
    assert all(sum(n for _, n in s) <= 8192 for s, _ in chunks)
    # the big tensor's frames are views of its own memory, not copies
    big_frames = [f for _, frames in chunks for f in frames if isinstance(f, memoryview) and len(f) == 8192]
    assert len(big_frames) == 2
    assert np.shares_memory(np.asarray(big_frames[0]), tensors[2][1].numpy())
    # reassembling the frames at their offsets reproduces every tensor's bytes
    buf = bytearray(lay.total_bytes)
    for s, frames in chunks:
        for (off, n), f in zip(s, frames):
            buf[off : off + n] = bytes(f)
    for spec, view in zip(lay.tensors, views):
        assert bytes(buf[spec.offset : spec.offset + spec.nbytes]) == bytes(view)


def test_plan_chunks_delta_sends_only_named_tensors():
    tensors = [torch.zeros(100), torch.ones(100), torch.full((100,), 2.0)]
    views = [byte_view(t) for t in tensors]
    lay = P.make_layout([(f"t{i}", "float32", [100]) for i in range(3)])
    chunks = list(plan_chunks(lay, views, [1], chunk_bytes=1 << 20))
    assert [s for s, _ in chunks] == [[[448, 400]]]  # t1 starts at align(400) = 448
