"""The delta codec: exact round trips for every float dtype and odd sizes, worked byte layouts,
and refusals of deltas that do not fit their base."""

from __future__ import annotations

import struct
import zlib

import pytest
import torch

from weight_server import delta as D
from weight_server.tensors import byte_view


def _bytes(t: torch.Tensor) -> bytes:
    return bytes(byte_view(t.contiguous()))


def test_xor_worked_case_bf16():
    # bf16 bits: 1.0 = 0x3F80, 1.0078125 = 0x3F81 (next value up), 2.0 = 0x4000.
    # old [1.0, 2.0], new [1.0078125, 2.0]: xor per element [0x0001, 0x0000].
    # Little-endian bytes of the xor: 01 00 | 00 00; byte planes (byte 0 of each element, then
    # byte 1): [01 00] [00 00] -> the payload is zlib of 01 00 00 00, after the tag byte 2.
    old = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
    new = torch.tensor([1.0078125, 2.0], dtype=torch.bfloat16)
    blob = D.encode(_bytes(old), _bytes(new), 2)
    assert blob[0] == 2 and D.codec_of(blob) == D.DeltaCodec.xor
    assert zlib.decompress(blob[1:]) == bytes([0x01, 0x00, 0x00, 0x00])
    assert bytes(D.decode(_bytes(old), blob, 2)) == _bytes(new)


def test_sparse_worked_case_fp32():
    # old [0, 0, 0, 0, 0], new [0, 5, 0, 0, 7] (float32): changed indices 1 and 4, gaps [1, 3],
    # values the float32 bits of 5.0 and 7.0. Header: 5 elements, 2 changed, then the compressed
    # gap stream's length (12 header bytes after the tag).
    old = torch.zeros(5)
    new = torch.tensor([0.0, 5.0, 0.0, 0.0, 7.0])
    blob = D.encode(_bytes(old), _bytes(new), 4, D.DeltaCodec.sparse)
    assert blob[0] == 1
    numel, count, gap_len = struct.unpack_from("<III", blob, 1)
    assert (numel, count) == (5, 2)
    gaps = zlib.decompress(blob[13 : 13 + gap_len])
    assert struct.unpack("<II", gaps) == (1, 3)
    assert zlib.decompress(blob[13 + gap_len :]) == struct.pack("<ff", 5.0, 7.0)
    assert bytes(D.decode(_bytes(old), blob, 4)) == _bytes(new)
    assert D.changed_count(_bytes(old), _bytes(new), 4) == 2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("numel", [0, 1, 7, 1023, 4099])
@pytest.mark.parametrize("codec", [D.DeltaCodec.sparse, D.DeltaCodec.xor, D.DeltaCodec.whole])
def test_round_trip_is_bit_exact(dtype, numel, codec):
    g = torch.Generator().manual_seed(numel)
    old = torch.randn(numel, generator=g).to(dtype)
    new = old.clone()
    if numel:
        # a few elements nudged, one NaN and one -0.0 (bit patterns, not values, must come back)
        k = torch.randint(0, numel, (max(1, numel // 20),), generator=g)
        new[k] = (new[k].float() * 1.001 + 1e-3).to(dtype)
        new[0] = float("nan")
        new[-1] = -0.0
    blob = D.encode(_bytes(old), _bytes(new), old.element_size(), codec)
    assert bytes(D.decode(_bytes(old), blob, old.element_size())) == _bytes(new)


def test_unchanged_tensor_compresses_to_little():
    # 1 MiB of bf16 with nothing changed: the xor is all zero bytes, which zlib level 1 shrinks
    # about 230x (4.6 KB)
    old = torch.randn(512 * 1024).to(torch.bfloat16)
    blob = D.encode(_bytes(old), _bytes(old), 2)
    assert len(blob) < 8192
    assert bytes(D.decode(_bytes(old), blob, 2)) == _bytes(old)


@pytest.mark.parametrize("codec", [D.DeltaCodec.sparse, D.DeltaCodec.xor])
def test_delta_against_a_base_of_another_size_is_refused(codec):
    old, new = torch.randn(8), torch.randn(8)
    blob = D.encode(_bytes(old), _bytes(new), 4, codec)
    with pytest.raises(D.DeltaError):
        D.decode(_bytes(torch.randn(9)), blob, 4)
    with pytest.raises(D.DeltaError):
        D.encode(_bytes(old), _bytes(torch.randn(9)), 4, codec)


def test_corrupt_or_unknown_deltas_are_refused():
    old, new = torch.randn(64), torch.randn(64)
    blob = bytearray(D.encode(_bytes(old), _bytes(new), 4))
    with pytest.raises(D.DeltaError, match="codec tag"):
        D.decode(_bytes(old), b"\x09" + bytes(blob[1:]), 4)
    with pytest.raises(D.DeltaError, match="codec tag"):
        D.decode(_bytes(old), b"", 4)
    with pytest.raises(D.DeltaError, match="decompress"):
        D.decode(_bytes(old), bytes(blob[:-5]), 4)
    sparse = bytearray(D.encode(_bytes(old), _bytes(new), 4, D.DeltaCodec.sparse))
    sparse[5] ^= 0xFF  # the changed count no longer matches the indices carried
    with pytest.raises(D.DeltaError):
        D.decode(_bytes(old), bytes(sparse), 4)


def test_odd_byte_counts_are_refused():
    with pytest.raises(D.DeltaError, match="whole number"):
        D.changed_count(b"\x00\x00\x00", b"\x00\x00\x00", 2)


@pytest.mark.parametrize("numel", [0, 3, 100])
def test_entries_same_xor_or_whole(numel):
    # equal bits -> `same` (the tag byte alone); a delta when asked and smaller; else `whole`
    old = torch.zeros(numel, dtype=torch.float16)
    assert D.encode_entry(_bytes(old), _bytes(old), 2, try_delta=True) == b"\x00"
    if not numel:
        return
    new = old.clone()
    new[0] = 1.0
    blob = D.encode_entry(_bytes(old), _bytes(new), 2, try_delta=True)
    assert D.codec_of(blob) == (D.DeltaCodec.xor if numel == 100 else D.DeltaCodec.whole)
    assert D.codec_of(D.encode_entry(_bytes(old), _bytes(new), 2, try_delta=False)) == D.DeltaCodec.whole
    assert bytes(D.decode(_bytes(old), blob, 2)) == _bytes(new)
