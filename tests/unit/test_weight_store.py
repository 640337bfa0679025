"""Weight-server store: visibility only after verified commit, version ordering, eviction, delta,
streaming watermark, slab recycling and safetensors persistence (no sockets)."""

from __future__ import annotations

import numpy as np
import pytest

from weight_server import protocol as P
from weight_server.persist import path_for, read_version, write_version
from weight_server.store import Refused, VersionStore


def _data(seed: int, sizes=(100, 3000, 7)) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 255, n, dtype=np.uint8) for n in sizes]


def _layout(arrays) -> P.Layout:
    entries = [(f"t{i}", "uint8", [len(a)]) for i, a in enumerate(arrays)]
    return P.make_layout(entries, [P.tensor_hash(a) for a in arrays])


def _upload(store: VersionStore, version: int, arrays, name="policy", corrupt=False, skip=None, **kw):
    lay = _layout(arrays)
    up = store.begin(name, version, lay, lay.content_hash(), **kw)
    if not hasattr(up, "slab") or not hasattr(up, "segments"):
        return up, lay
    indices = kw.get("changed") if kw.get("delta_base") is not None else range(len(arrays))
    for i in indices:
        if i == skip:
            continue
        spec = lay.tensors[i]
        [view] = store.chunk_targets(up.id, [(spec.offset, spec.nbytes)])
        view[:] = arrays[i].tobytes()
        if corrupt and i == 1:
            view[5] ^= 0xFF
        store.received(up.id, [(spec.offset, spec.nbytes)])
    return up, lay


def _bytes_of(ver, i) -> bytes:
    t = ver.layout.tensors[i]
    return bytes(ver.slab.view[t.offset : t.offset + t.nbytes])


def test_version_visible_only_after_commit_and_ordering():
    store = VersionStore(keep=2)
    a1 = _data(1)
    up, _ = _upload(store, 1, a1)
    assert store.newest("policy") is None  # all bytes in, but not committed
    ver, evicted = store.commit(up.id)
    assert (ver.version, evicted) == (1, [])
    assert store.newest("policy").version == 1
    assert _bytes_of(ver, 1) == a1[1].tobytes()
    for v in (2, 3):
        up, _ = _upload(store, v, _data(v))
        ver, evicted = store.commit(up.id)
    assert [e.version for e in evicted] == [1]
    assert store.held() == {"policy": [2, 3]}


def test_stale_and_equal_versions_refused_but_identical_retry_accepted():
    store = VersionStore(keep=2)
    up, lay = _upload(store, 5, _data(5))
    store.commit(up.id)
    with pytest.raises(Refused, match="version 4 of 'policy' is not newer than the newest held version 5") as exc:
        _upload(store, 4, _data(4))
    assert exc.value.code == P.E_STALE
    with pytest.raises(Refused, match="publish 6 or above"):
        _upload(store, 5, _data(99))  # same number, other content
    same = store.begin("policy", 5, lay, lay.content_hash())  # a retry whose reply was lost
    assert same is store.newest("policy")
    assert store.uploads == {}


def test_corrupted_bytes_rejected_and_previous_kept():
    store = VersionStore(keep=2)
    up, _ = _upload(store, 1, _data(1))
    store.commit(up.id)
    up, _ = _upload(store, 2, _data(2), corrupt=True)
    with pytest.raises(Refused, match=r"1 tensor\(s\) do not match their hash \(e.g. 't1'\)") as exc:
        store.commit(up.id)
    assert exc.value.code == P.E_HASH
    assert store.newest("policy").version == 1
    assert [u.version for u in store.take_aborted()] == [2]


def test_missing_bytes_rejected():
    store = VersionStore(keep=2)
    up, _ = _upload(store, 1, _data(1), skip=2)
    with pytest.raises(Refused, match="bytes of tensor 't2' never arrived") as exc:
        store.commit(up.id)
    assert exc.value.code == P.E_INCOMPLETE
    assert store.newest("policy") is None


def test_content_hash_must_match_tensor_hashes():
    store = VersionStore(keep=2)
    lay = _layout(_data(1))
    with pytest.raises(Refused, match="does not match its tensor hashes"):
        store.begin("policy", 1, lay, bytes(16))


def test_delta_copies_unchanged_tensors_from_base():
    store = VersionStore(keep=2)
    a1 = _data(1)
    up, _ = _upload(store, 1, a1)
    store.commit(up.id)
    a2 = [a1[0], _data(7)[1], a1[2]]  # only t1 changed
    up, _ = _upload(store, 2, a2, delta_base=1, changed=[1])
    assert up.wire_bytes == 3000
    ver, _ = store.commit(up.id)
    assert [_bytes_of(ver, i) for i in range(3)] == [a.tobytes() for a in a2]
    with pytest.raises(Refused, match="delta base policy v9 is not held"):
        _upload(store, 3, a2, delta_base=9, changed=[1])
    with pytest.raises(Refused, match="'t0' is marked unchanged but its hash differs"):
        _upload(store, 3, [_data(8)[0], a2[1], a2[2]], delta_base=2, changed=[1])


def test_streaming_watermark_and_early_hashes():
    store = VersionStore(keep=2)
    arrays = _data(1)
    lay = _layout(arrays)
    up = store.begin("policy", 1, lay, lay.content_hash())
    t0, t1, t2 = lay.tensors  # [0, 100), [128, 3128), [3136, 3143)
    assert up.streamable and not up.has(100)
    store.chunk_targets(up.id, [(0, 100)])[0][:] = arrays[0].tobytes()
    store.received(up.id, [(0, 100)])
    assert up.has(128) and not up.has(129)  # [100, 128) is alignment padding
    assert up.hashed == 1 and up.computed == [t0.hash]
    store.chunk_targets(up.id, [(128, 1000)])[0][:] = arrays[1][:1000].tobytes()
    store.received(up.id, [(128, 1000)])
    assert up.watermark == 1128 and up.has(1128) and not up.has(1129)
    # a segment behind the watermark (a resend) turns streaming off: the commit re-hashes all
    store.chunk_targets(up.id, [(0, 100)])[0][:] = arrays[0].tobytes()
    store.received(up.id, [(0, 100)])
    assert not up.streamable and not up.has(10)


def test_slab_of_evicted_version_is_recycled():
    store = VersionStore(keep=1)
    up, _ = _upload(store, 1, _data(1))
    v1, _ = store.commit(up.id)
    up, _ = _upload(store, 2, _data(2))
    store.commit(up.id)  # evicts v1: its slab goes back to the pool
    up, _ = _upload(store, 3, _data(3))
    assert up.slab is v1.slab


def test_busy_slab_not_recycled_until_sends_finish():
    class Tracker:
        done = False

    store = VersionStore(keep=1)
    up, _ = _upload(store, 1, _data(1))
    v1, _ = store.commit(up.id)
    tracker = Tracker()
    v1.slab.track(tracker)  # a zero-copy send still reading v1
    up, _ = _upload(store, 2, _data(2))
    store.commit(up.id)
    up3, _ = _upload(store, 3, _data(3))
    assert up3.slab is not v1.slab
    store.abort(up3.id)
    tracker.done = True
    up4, _ = _upload(store, 4, _data(4))
    assert up4.slab in (v1.slab, up3.slab)


def test_expire_drops_idle_uploads():
    store = VersionStore(keep=1)
    up = store.begin("policy", 1, _layout(_data(1)), _layout(_data(1)).content_hash(), now=100.0)
    assert store.expire(30.0, now=120.0) == []
    assert [u.id for u in store.expire(30.0, now=131.0)] == [up.id]
    assert store.uploads == {}


def test_before_any_version_is_held_uploads_together_hold_at_most_one_version_of_bytes():
    # Once: with nothing held there was no byte cap, so before the learner's first publish anyone
    # could start max_uploads uploads of max_version_bytes each and pin their memory.
    store = VersionStore(keep=1, max_version_bytes=5000)
    up1, _ = _upload(store, 1, _data(1), skip=0)  # 3.2 KB, unfinished
    with pytest.raises(Refused, match="nothing is held yet, weight_server.max_version_bytes") as exc:
        _upload(store, 1, _data(2), name="critic")
    assert exc.value.code == P.E_BUSY and store.upload_byte_cap() == 5000
    # a retry and a newer version supersede the unfinished upload of their name: they fit
    up1, _ = _upload(store, 1, _data(1), skip=0)
    up2, _ = _upload(store, 2, _data(2))
    assert list(store.uploads) == [up2.id]
    store.commit(up2.id)
    # once a version is held the cap is twice the largest held (at least 1 GiB): the other name fits
    assert store.upload_byte_cap() == 1 << 30
    _upload(store, 1, _data(3), name="critic")


def test_persist_roundtrip_readable_by_safetensors(tmp_path):
    import torch
    from safetensors.torch import load_file

    tensors = {"a.weight": torch.randn(3, 5), "b.bias": torch.arange(4, dtype=torch.int64),
               "c.emb": torch.randn(7).to(torch.bfloat16)}
    from weight_server.tensors import byte_view

    names = sorted(tensors)
    arrays = [np.frombuffer(bytes(byte_view(tensors[n])), dtype=np.uint8) for n in names]
    dtypes = {"a.weight": "float32", "b.bias": "int64", "c.emb": "bfloat16"}
    lay = P.make_layout([(n, dtypes[n], list(tensors[n].shape)) for n in names], [P.tensor_hash(a) for a in arrays])
    store = VersionStore(keep=1)
    up = store.begin("policy", 7, lay, lay.content_hash())
    for spec, arr in zip(lay.tensors, arrays):
        store.chunk_targets(up.id, [(spec.offset, spec.nbytes)])[0][:] = arr.tobytes()
    ver, _ = store.commit(up.id)
    path = write_version(tmp_path, ver)
    assert path == path_for(tmp_path, "policy")
    loaded = load_file(str(path))
    for n in names:
        assert torch.equal(loaded[n], tensors[n])
    back = read_version(path, max_tensors=10, max_version_bytes=1 << 20)
    assert (back.name, back.version, back.content_hash) == ("policy", 7, ver.content_hash)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # flip a byte of the last tensor
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="content hash does not match"):
        read_version(path, max_tensors=10, max_version_bytes=1 << 20)


def test_upload_bytes_may_be_read_while_the_server_thread_starts_an_upload():
    """WeightServer.metrics() runs on the caller's thread (the launcher's progress thread) and sums
    the uploads in progress while the server's loop thread begins and ends them. Here the loop's
    begin() lands exactly while the sum is under way (the first upload's layout starts it)."""
    store = VersionStore(keep=2)
    up, lay = _upload(store, 1, _data(1), skip=0)  # in progress
    started = []

    class Interleaved:  # the first upload's layout, whose size read lets the other thread run
        def __getattr__(self, name):
            if name == "total_bytes" and not started:
                started.append(None)  # once (begin() sums the uploads too)
                started[0] = _upload(store, 1, _data(2), name="reference", skip=0)[0]
            return getattr(lay, name)

    up.layout = Interleaved()
    assert store.upload_bytes() in (lay.total_bytes, lay.total_bytes + started[0].layout.total_bytes)
    assert len(store.uploads) == 2
