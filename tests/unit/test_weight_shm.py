"""Shared-memory bookkeeping without sockets: leases, the slab pool's recycling rules for file
slabs, the private folder and its token, offers a client must refuse."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from servers import wait_for
from weight_server import protocol as P
from weight_server.shm import Leases, ShmDir, remove_stale
from weight_server.shm_map import ShmMaps, ShmUnavailable, check_token
from weight_server.slabs import Slab, SlabPool


@pytest.fixture
def shm(tmp_path):
    d = ShmDir(str(tmp_path))
    yield d
    d.close()


def test_folder_token_and_file_slabs(shm, tmp_path):
    assert shm.path.parent == tmp_path and shm.path.name.startswith(f"rlhf-ws-{os.getpid()}-")
    assert Path(shm.token_path).read_bytes() == shm.token and len(shm.token) == 32
    slab = shm.new_slab(1000)
    assert slab.capacity == 1000 and os.path.getsize(slab.path) == 1000
    slab.array[:4] = [1, 2, 3, 4]
    assert Path(slab.path).read_bytes()[:4] == b"\x01\x02\x03\x04"  # the array is the file
    offer = shm.offer(slab, 900)
    assert (offer.path, offer.size, offer.token) == (slab.path, 900, shm.token)
    assert shm.offer(Slab(10), 10) is None  # anonymous memory cannot be offered
    shm.close()
    assert not shm.path.exists() and shm.new_slab(10) is None


def test_no_room_gives_anonymous_slabs_and_counts_them(tmp_path):
    d = ShmDir(str(tmp_path), free_space=lambda path: 0)
    try:
        assert d.new_slab(10) is None
        pool = SlabPool(factory=d.new_slab)
        assert pool.take(10).path is None and pool.take(10).path is None
        assert pool.anonymous == 2
    finally:
        d.close()


def test_a_spare_slab_is_made_off_the_calling_thread_and_used_next(shm):
    pool = SlabPool(factory=shm.new_slab)
    pool.prepare(1000)
    wait_for(lambda: pool.collect() or pool.free, 5, "the spare slab")
    [spare] = pool.free
    assert spare.path is not None and spare.capacity == 1000
    pool.prepare(1000)  # one that fits is free already: nothing more is made
    assert pool.take(900) is spare and not pool._making


def test_a_spare_slab_that_fails_to_be_made_lets_the_next_upload_try_again():
    # an exception out of the slab factory (anything but what it handles itself) must not leave
    # the pool marked "making" for good, or no spare slab is made again
    calls, done = [], threading.Event()

    def factory(nbytes):
        calls.append(nbytes)
        done.set()
        if len(calls) == 1:
            raise RuntimeError("the tmpfs went away")
        return Slab(nbytes)

    pool = SlabPool(factory=factory)
    pool.prepare(64)
    assert done.wait(10)
    deadline = time.monotonic() + 10
    while pool._making and time.monotonic() < deadline:  # the thread's finally, just after the factory
        time.sleep(0.01)
    done.clear()
    pool.prepare(64)
    assert done.wait(10) and calls == [64, 64]


def test_pool_prefers_file_slabs_and_never_recycles_tainted_ones(shm):
    pool = SlabPool(max_free=2, factory=shm.new_slab)
    a = pool.take(100)
    assert a.path is not None
    pool.give(a)
    assert pool.take(100) is a  # recycled: same file
    a.pin()
    pool.give(a)
    b = pool.take(100)
    assert b is not a and b.path != a.path  # pinned (leased): not reused
    a.tainted = True
    a.unpin()
    pool.collect()
    assert a not in pool.free and not os.path.exists(a.path)  # an expired lease's slab: dropped, file removed
    anon = SlabPool(factory=lambda n: None).take(100)
    assert anon.path is None  # no room: anonymous memory


def test_pool_drops_files_beyond_max_free(shm):
    pool = SlabPool(max_free=1, factory=shm.new_slab)
    slabs = [pool.take(100) for _ in range(3)]
    for s in slabs:
        pool.give(s)
    assert pool.free == [slabs[2]]
    assert [os.path.exists(s.path) for s in slabs] == [False, False, True]


def test_leases_pin_expire_renew_and_cap():
    leases = Leases(limit=2)
    slab = Slab(10)
    a = leases.take(slab, 1.0, "policy", 1, now=0.0)
    b = leases.take(slab, 1.0, "policy", 1, now=0.0)
    assert leases.take(slab, 1.0, "policy", 1, now=0.0) is None  # capped: that pull goes over TCP
    assert not slab.idle()
    leases.renew(slab, 5.0, now=0.5)
    assert leases.expire(now=2.0) == []  # renewed to 5.5
    assert leases.release(a).version == 1 and leases.release(a) is None
    [gone] = leases.expire(now=6.0)
    assert gone.slab is slab and slab.tainted and slab.idle()
    assert leases.release(b) is None


def test_remove_stale_leaves_what_is_not_a_dead_servers_folder(tmp_path):
    live = tmp_path / f"rlhf-ws-{os.getpid()}-aa"  # this process is alive
    other = tmp_path / "rlhf-ws-notapid-aa"
    plain = tmp_path / "something-else"
    for d in (live, other, plain):
        d.mkdir()
    (live / "lock").touch()
    assert remove_stale(str(tmp_path)) == []
    assert all(d.exists() for d in (live, other, plain))


def test_client_refuses_a_token_it_cannot_prove(shm, tmp_path):
    slab = shm.new_slab(64)
    offer = shm.offer(slab, 64, lease=1, lease_s=1.0)
    maps = ShmMaps()
    view = maps.open(offer, writable=False)
    slab.array[:3] = [7, 8, 9]
    assert list(view[:3]) == [7, 8, 9] and not view.flags.writeable
    with pytest.raises(ShmUnavailable, match="token mismatch"):
        check_token(P.ShmOffer(offer.path, 0, 64, offer.token_path, bytes(32), 1, 1.0))
    with pytest.raises(ShmUnavailable, match="holds 64 bytes, fewer than the offered 65"):
        maps.open(P.ShmOffer(offer.path, 1, 64, offer.token_path, offer.token, 1, 1.0), writable=False)
    writable = maps.open(offer, writable=True)
    writable[:2] = np.array([5, 6], dtype=np.uint8)
    assert list(slab.array[:2]) == [5, 6]


def test_an_offer_outside_a_weight_server_folder_is_refused_before_anything_is_opened():
    good = {"path": "/dev/shm/rlhf-ws-1-ab/slab-1", "offset": 0, "size": 128, "token_path": "/dev/shm/rlhf-ws-1-ab/token",
            "token": bytes(32), "lease": 5, "lease_s": 1.0}
    assert P.parse_shm_offer({"shm": good}, "shm", 128, leased=True).lease == 5
    bad = [
        ({"path": "/etc/passwd"}, "is not a slab file beside the token"),
        ({"path": "/dev/shm/rlhf-ws-1-ab/../x/slab-1"}, "normalised absolute path"),
        ({"token_path": "/tmp/rlhf-ws-1-ab/token"}, "is not a slab file beside the token"),
        ({"size": 64}, "does not match the version's 128 bytes"),
        ({"token": b"short"}, "token must be 32 bytes"),
        ({"lease": None}, "must carry a lease"),
    ]
    for change, message in bad:
        with pytest.raises(P.WireError, match=message):
            P.parse_shm_offer({"shm": {**good, **change}}, "shm", 128, leased=True)


def test_a_subscriber_with_shm_off_takes_an_offer_it_did_not_ask_for_over_tcp(tmp_path):
    from rlhf_core.config import WeightServerConfig
    from weight_server import WeightSubscriber

    offer = P.ShmOffer(str(tmp_path / "slab"), 0, 8, str(tmp_path / "token"), b"\0" * P.SHM_TOKEN_BYTES, lease=1)
    with WeightSubscriber("tcp://127.0.0.1:9", "tcp://127.0.0.1:9", WeightServerConfig(shm="off")) as sub:
        assert sub._map(offer) is None and sub.stats["shm_fallbacks"] == 0
