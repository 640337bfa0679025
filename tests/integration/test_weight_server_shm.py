"""The same-host shared-memory data path over real sockets and real files: identical results to TCP
in every mix of shm and TCP clients, fallbacks that still apply, integrity, leases against
recycling, folder clean-up (also after SIGKILL), a full tmpfs, malformed messages, 8 pullers."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import zmq

from rlhf_core.config import ConfigError, WeightServerConfig
from servers import recv_with_timeout, wait_for, zmq_context
from weight_server import WeightPublisher, WeightServer, WeightSubscriber
from weight_server import protocol as P
from weight_server.client import Channel
from weight_server.shm import reserve_bytes

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]
REPO = Path(__file__).resolve().parents[2]


def _cfg(**kw) -> WeightServerConfig:
    base = dict(chunk_bytes=64 * 1024, max_inflight_chunks=4, request_timeout_s=2.0, retry_timeout_s=5.0, announce_interval_s=0.1)
    return WeightServerConfig(**{**base, **kw})


TCP = {"shm": "off"}


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(300, 200, generator=g),  # 240000 bytes
        "b": torch.arange(7, dtype=torch.int64) * seed,
        "e": torch.randn(50, generator=g).to(torch.bfloat16),
        "flag": torch.rand(9, generator=g) > 0.5,
    }


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return sorted(got) == sorted(want) and all(got[n].dtype == want[n].dtype and torch.equal(got[n], want[n]) for n in want)


def _zeros(data: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: torch.zeros_like(t) for n, t in data.items()}


def _counters(srv: WeightServer) -> dict[str, int]:
    return srv.metrics()["counters"]


class Peers:
    """Publishers and subscribers of one server, each with its own config (shm or TCP)."""

    def __init__(self, srv: WeightServer, cfg: WeightServerConfig) -> None:
        self.srv, self.cfg, self.opened = srv, cfg, []
        self.ctx = zmq_context()  # the channels'

    def pub(self, **kw) -> WeightPublisher:
        self.opened.append(WeightPublisher(self.srv.address, _cfg(**kw)))
        return self.opened[-1]

    def sub(self, worker_id: str = "w0", **kw) -> WeightSubscriber:
        self.opened.append(WeightSubscriber(self.srv.address, self.srv.pub_address, _cfg(**kw), worker_id=worker_id))
        return self.opened[-1]

    def channel(self) -> Channel:
        return Channel(self.srv.address, self.cfg, self.ctx)

    def close(self) -> None:
        try:
            for c in self.opened:
                c.close()
        finally:
            self.ctx.close()


@pytest.fixture
def peers():
    cfg = _cfg()
    with WeightServer(cfg) as srv:
        p = Peers(srv, cfg)
        try:
            yield p
        finally:
            p.close()


def _slab_file(srv: WeightServer, version: int) -> str:
    path = srv.store.get("policy", version).slab.path
    assert path is not None and path.startswith(str(srv.shm.path))
    return path


def _layout_bytes(data: dict[str, torch.Tensor]) -> int:
    from weight_server.tensors import TORCH_TO_WIRE

    return P.make_layout([(n, TORCH_TO_WIRE[t.dtype], list(t.shape)) for n, t in sorted(data.items())]).total_bytes


def test_shm_pull_is_identical_to_a_tcp_pull_and_no_byte_crosses_a_socket(peers):
    pub = peers.pub()
    data = _tensors(1)
    stats = pub.publish(1, data)
    assert (stats.via, stats.wire_bytes) == ("shm", stats.bytes)
    shm_sub, tcp_sub = peers.sub("shm"), peers.sub("tcp", **TCP)
    v1, via_shm = shm_sub.pull()
    v2, via_tcp = tcp_sub.pull()
    assert v1 == v2 == 1 and _same(via_shm, data) and _same(via_tcp, data)
    # into=None hands out tensors the caller owns, not views of the server's slab
    with open(_slab_file(peers.srv, 1), "r+b") as f:
        f.write(b"\xff" * 64)
    assert _same(via_shm, data)
    assert (shm_sub.stats["pulls_shm"], shm_sub.stats["bytes_shm"], shm_sub.stats["bytes_received"]) == (1, stats.bytes, 0)
    assert (tcp_sub.stats["pulls_tcp"], tcp_sub.stats["bytes_received"]) == (1, _layout_bytes(data))
    # only the TCP puller's bytes went out on a socket (counted by the server just after sending)
    c = wait_for(lambda: (c := _counters(peers.srv))["bytes_served"] == _layout_bytes(data) and c, 30, "bytes served")
    assert (c["publishes_shm"], c["pulls_shm"], c["pulls_tcp"], c["shm_fallbacks"]) == (1, 1, 1, 0)
    assert peers.srv.handlers.leases.held == {}  # every lease was released


def test_in_place_module_pull_and_delta_over_shm(peers):
    pub, sub = peers.pub(), peers.sub()
    torch.manual_seed(1)
    src = torch.nn.Sequential(torch.nn.Linear(16, 300), torch.nn.LayerNorm(300), torch.nn.Linear(300, 4))
    dst = torch.nn.Sequential(torch.nn.Linear(16, 300), torch.nn.LayerNorm(300), torch.nn.Linear(300, 4))
    ptrs = {n: t.data_ptr() for n, t in dst.state_dict().items()}
    pub.publish(1, src)
    assert sub.pull(into=dst) == (1, None)
    assert all(torch.equal(a, b) for a, b in zip(src.state_dict().values(), dst.state_dict().values()))
    assert {n: t.data_ptr() for n, t in dst.state_dict().items()} == ptrs
    # bf16 transfer into the fp32 model: converted on the way out of the mapping
    pub.publish(2, src, dtype=torch.bfloat16)
    assert sub.pull(into=dst) == (2, None)
    assert torch.equal(dst[0].weight, src[0].weight.to(torch.bfloat16).float())
    # delta: only the changed tensor is copied in, and only it is read back out
    with torch.no_grad():
        src[2].bias.add_(1.0)
    stats = pub.publish(3, src, dtype=torch.bfloat16, delta=True)
    assert (stats.via, stats.changed_tensors, stats.wire_bytes) == ("shm", 1, 4 * 2)
    shm_bytes = sub.stats["bytes_shm"]
    assert sub.pull(into=dst) == (3, None)
    assert sub.stats["bytes_shm"] - shm_bytes == 4 * 2
    assert torch.equal(dst[2].bias, src[2].bias.to(torch.bfloat16).float())
    assert torch.equal(dst[0].weight, src[0].weight.to(torch.bfloat16).float())  # filled from the base by the server
    # an in-place pull gives its lease back with its APPLIED report, which nothing answers
    rec = wait_for(lambda: (r := peers.srv.metrics()["versions"]["policy"][3])["applied"] and r, 30, "v3 applied")
    assert (rec["delta"], rec["wire_bytes"], rec["pulls_shm"]) == (True, 8, 1)
    assert peers.srv.handlers.leases.held == {}


def test_shm_publisher_with_tcp_worker_and_tcp_publisher_with_shm_worker(peers):
    shm_pub, tcp_pub = peers.pub(), peers.pub(**TCP)
    shm_sub, tcp_sub = peers.sub("shm"), peers.sub("tcp", **TCP)
    targets = {"shm": _zeros(_tensors(1)), "tcp": _zeros(_tensors(1))}
    assert shm_pub.publish(1, _tensors(1)).via == "shm"
    assert tcp_sub.pull(into=targets["tcp"]) == (1, None) and _same(targets["tcp"], _tensors(1))
    assert tcp_pub.publish(2, _tensors(2)).via == "tcp"
    assert shm_sub.pull(into=targets["shm"]) == (2, None) and _same(targets["shm"], _tensors(2))
    assert (tcp_sub.stats["pulls_tcp"], shm_sub.stats["pulls_shm"]) == (1, 1)
    wait_for(lambda: peers.srv.metrics()["versions"]["policy"][2]["applied"], 30, "v2 applied")  # its lease with it
    c = _counters(peers.srv)
    assert (c["publishes_shm"], c["pulls_shm"], c["pulls_tcp"]) == (1, 1, 1)


def test_token_mismatch_or_unusable_files_fall_back_to_tcp_and_still_apply(peers, caplog, tmp_path):
    """What a client on another host or in another container sees: other bytes in a file of that
    name, or no such file; and files this process must not trust (a link, another user's file)."""
    pub, sub = peers.pub(), peers.sub()
    target = _zeros(_tensors(1))
    token = Path(peers.srv.shm.token_path)
    token.write_bytes(os.urandom(P.SHM_TOKEN_BYTES))  # another server's folder of the same name
    assert pub.publish(1, _tensors(1)).via == "tcp"
    assert sub.pull(into=target) == (1, None) and _same(target, _tensors(1))
    assert sub.pull(version=1, into=None)[0] == 1
    assert sum("token mismatch" in r.getMessage() for r in caplog.records) == 2  # publisher and worker, once each
    token.unlink()  # no such file here
    assert pub.publish(2, _tensors(2)).via == "tcp"
    assert sub.pull(into=target) == (2, None) and _same(target, _tensors(2))
    (tmp_path / "token").write_bytes(peers.srv.shm.token)
    token.symlink_to(tmp_path / "token")  # the right bytes, behind a link: links are never followed
    _, got = sub.pull(version=2, into=None)
    assert _same(got, _tensors(2)) and sub.stats["shm_fallbacks"] == 4
    token.unlink()
    token.write_bytes(peers.srv.shm.token)
    if os.geteuid() == 0:  # only root can give a file to another user
        slab = _slab_file(peers.srv, 2)
        os.chown(slab, 65534, 65534)
        target = _zeros(_tensors(1))
        assert sub.pull(version=2, into=target, skip_unchanged=False) == (2, None) and _same(target, _tensors(2))
        assert sub.stats["shm_fallbacks"] == 5
        os.chown(slab, 0, 0)
    c = _counters(peers.srv)
    assert (c["pulls_shm"], c["publishes_shm"], c["shm_fallbacks"]) == (0, 0, sub.stats["shm_fallbacks"])
    assert sub.stats["pulls_tcp"] == sub.stats["shm_fallbacks"]
    assert peers.srv.handlers.leases.held == {}  # fallbacks released their leases too
    # the right token in place again: shared memory is used at once, no restart needed
    assert pub.publish(3, _tensors(3)).via == "shm"
    assert sub.pull(into=target) == (3, None) and _same(target, _tensors(3)) and sub.stats["pulls_shm"] == 1


def test_bytes_corrupted_in_a_committed_slab_are_rejected_and_the_previous_version_kept(peers):
    pub, sub = peers.pub(), peers.sub()
    target = _zeros(_tensors(1))
    pub.publish(1, _tensors(1))
    assert sub.pull(into=target) == (1, None)
    pub.publish(2, _tensors(2))
    spec = peers.srv.store.get("policy", 2).layout.tensors[-1]  # "w"
    with open(_slab_file(peers.srv, 2), "r+b") as f:  # a stray write into the committed version's file
        f.seek(spec.offset + 1000)
        f.write(b"\x00\x01\x02\x03")
    assert sub.pull(into=target) is None
    assert sub.stats["integrity_failures"] == 1 and sub.version == 1 and _same(target, _tensors(1))
    assert sub.pull(into=None) is None  # an owned copy is hashed before it is handed out, too
    assert sub.stats["integrity_failures"] == 2
    assert peers.srv.handlers.leases.held == {}


def _lease(ch: Channel, version: int) -> tuple[int, P.ShmOffer, P.Layout]:
    man = ch.request(P.MANIFEST_REQ, name="policy", version=version, pending=False, shm=True)
    assert man["kind"] == P.MANIFEST, man
    layout = P.parse_tensor_list(man, "tensors", 1000, 1 << 30)
    offer = P.parse_shm_offer(man, "shm", layout.total_bytes, leased=True)
    return offer.lease, offer, layout


def _file_holds(path: str, layout: P.Layout) -> bool:
    """Whether the slab file at ``path`` still holds exactly the bytes of ``layout``'s hashes."""
    if not os.path.exists(path):
        return False
    data = Path(path).read_bytes()
    return all(P.tensor_hash(data[t.offset : t.offset + t.nbytes]) == t.hash for t in layout.tensors)


def test_a_leased_slab_is_not_recycled_until_released(peers):
    pub, ch = peers.pub(), peers.channel()
    pub.publish(1, _tensors(1))
    lease, offer, layout = _lease(ch, 1)
    for v in range(2, 7):  # v1 is evicted at v3; its slab would be the next one reused
        pub.publish(v, _tensors(v))
        assert _file_holds(offer.path, layout), f"v1's leased slab was overwritten by v{v}"
    assert peers.srv.metrics()["held"] == {"policy": [5, 6]}
    rep = ch.request(P.SHM_RELEASE, lease=lease, via="shm")
    assert (rep["kind"], rep["lease"]) == (P.SHM_RELEASED, lease)
    reused_by = []
    for v in range(7, 10):
        pub.publish(v, _tensors(v))
        if peers.srv.store.get("policy", v).slab.path == offer.path:
            reused_by.append(v)  # checked at once: a slab taken by v7 is evicted again at v9
    assert not _file_holds(offer.path, layout)
    assert reused_by, "v1's slab was not recycled for a newer version once released"
    rep = ch.request(P.SHM_RELEASE, lease=lease, via="shm")  # twice: the server no longer knows it
    assert (rep["kind"], rep["code"]) == (P.ERROR, P.E_UNKNOWN_LEASE)
    assert "already released, expired" in rep["message"]
    assert _counters(peers.srv)["pulls_shm"] == 1


def test_an_applied_report_gives_the_lease_back_and_an_unknown_one_is_only_logged(peers, caplog):
    # What an in-place pull does after applying the slab's bytes: APPLIED carries its lease, and
    # nothing answers it. A lease the server does not know (sent twice, expired) is logged; the
    # report still counts and the server serves on.
    pub, ch = peers.pub(), peers.channel()
    pub.publish(1, _tensors(1))
    lease = _lease(ch, 1)[0]
    assert lease in peers.srv.handlers.leases.held
    ch.send(P.APPLIED, name="policy", version=1, worker="w0", apply_s=0.001, lease=lease)
    wait_for(lambda: "w0" in peers.srv.metrics()["versions"]["policy"][1]["applied"], 30, "w0's report")
    assert peers.srv.handlers.leases.held == {} and _counters(peers.srv)["pulls_shm"] == 1
    ch.send(P.APPLIED, name="policy", version=1, worker="w1", apply_s=0.001, lease=lease)
    wait_for(lambda: "w1" in peers.srv.metrics()["versions"]["policy"][1]["applied"], 30, "w1's report")
    assert f"worker w1 applied policy v1: lease {lease} is unknown" in caplog.text
    assert _counters(peers.srv)["pulls_shm"] == 1
    assert ch.request(P.MANIFEST_REQ, name="policy", version=1, pending=False, shm=True)["kind"] == P.MANIFEST


def test_an_expired_lease_taints_its_slab_which_is_dropped_not_recycled(peers, caplog, zmq_ctx):
    # lease_s = 0.3 s + bytes / 1 GB/s
    with WeightServer(_cfg(request_timeout_s=0.3)) as srv, WeightPublisher(srv.address, _cfg()) as pub:
        pub.publish(1, _tensors(1))
        ch = Channel(srv.address, _cfg(), zmq_ctx)
        lease, offer, layout = _lease(ch, 1)
        assert 0.3 <= offer.lease_s < 0.31
        wait_for(lambda: srv.metrics()["counters"]["shm_leases_expired"] == 1, 30, "the lease to expire")
        assert "not released in time" in caplog.text
        for v in range(2, 6):
            pub.publish(v, _tensors(v))
        # evicted at v3 and never reused: its file is gone, so no later version overwrites a
        # reader that outlived its lease (an existing mapping keeps the old pages)
        assert not os.path.exists(offer.path)
        assert all(srv.store.get("policy", v).slab.path != offer.path for v in (4, 5))
        rep = ch.request(P.SHM_RELEASE, lease=lease, via="shm")
        assert (rep["kind"], rep["code"]) == (P.ERROR, P.E_UNKNOWN_LEASE)


def test_malformed_shm_messages_get_errors_and_the_server_keeps_serving(peers):
    pub, sub = peers.pub(), peers.sub()
    pub.publish(1, _tensors(1))
    dealer = peers.ctx.socket(zmq.DEALER)
    dealer.connect(peers.srv.address)
    h = bytes(16)
    cases = [
        (P.encode(P.SHM_RELEASE, rid=1), P.E_MALFORMED, "missing field 'lease'"),
        (P.encode(P.SHM_RELEASE, rid=2, lease="x"), P.E_MALFORMED, "field 'lease': expected int"),
        (P.encode(P.SHM_RELEASE, rid=3, lease=-5), P.E_MALFORMED, "must be >= 0"),
        (P.encode(P.SHM_RELEASE, rid=4, lease=123456789), P.E_UNKNOWN_LEASE, "lease 123456789 is unknown"),
        (P.encode(P.SHM_RELEASE, rid=5, lease=1, via="carrier pigeon"), P.E_MALFORMED, "field 'via' must be one of"),
        (P.encode(P.MANIFEST_REQ, rid=6, name="policy", shm=1), P.E_MALFORMED, "field 'shm': expected bool"),
        (P.encode(P.PUB_COMMIT, rid=7, upload=42, shm=True), P.E_UNKNOWN_UPLOAD, "upload 42 is unknown"),
        (P.encode(P.PUB_BEGIN, rid=8, name="policy", version=2, tensors=[["t", "uint8", [1], h]], content_hash=h,
                  shm="yes"), P.E_MALFORMED, "field 'shm': expected bool"),
    ]
    try:
        for header, code, text in cases:
            dealer.send(header)
            obj = P.decode(recv_with_timeout(dealer, 3000, multipart=True)[0], P.SERVER_KINDS, 1 << 16, 1 << 20)
            assert (obj["kind"], obj["code"]) == (P.ERROR, code), (header[:60], obj)
            assert text in obj["message"], obj["message"]
        # a commit that claims shared memory for an upload that was never offered it
        lay = P.make_layout([("t", "uint8", [4])], [P.tensor_hash(b"abcd")])
        dealer.send(P.encode(P.PUB_BEGIN, rid=9, name="policy", version=2, tensors=[t.to_wire() for t in lay.tensors],
                             content_hash=lay.content_hash(), shm=False))
        ready = P.decode(recv_with_timeout(dealer, 3000, multipart=True)[0], P.SERVER_KINDS, 1 << 16, 1 << 20)
        assert ready["kind"] == P.PUB_READY and ready["shm"] is None
        dealer.send(P.encode(P.PUB_COMMIT, rid=10, upload=ready["upload"], shm=True))
        obj = P.decode(recv_with_timeout(dealer, 3000, multipart=True)[0], P.SERVER_KINDS, 1 << 16, 1 << 20)
        assert obj["code"] == P.E_MALFORMED and "was not offered shared memory" in obj["message"]
        # ...or a data-less chunk for it
        dealer.send(P.encode(P.PUB_CHUNK, upload=ready["upload"], seq=0, segments=[[0, 4]], shm=True))
        obj = P.decode(recv_with_timeout(dealer, 3000, multipart=True)[0], P.SERVER_KINDS, 1 << 16, 1 << 20)
        assert obj["code"] == P.E_MALFORMED and "send its bytes as data frames" in obj["message"]
    finally:
        dealer.close()
    # still serving, over shared memory
    pub.publish(3, _tensors(3))
    target = _zeros(_tensors(3))
    assert sub.pull(into=target) == (3, None) and _same(target, _tensors(3))
    assert sub.stats["pulls_shm"] == 1


def test_eight_workers_pulling_at_once_over_shm_end_identical(peers):
    pub = peers.pub()
    g = torch.Generator().manual_seed(0)
    data = {f"layer{i}": torch.randn(256 * 1024, generator=g) for i in range(4)}  # 4 MiB
    pub.publish(1, data)
    subs = [peers.sub(f"w{i}") for i in range(8)]
    targets = [_zeros(data) for _ in subs]
    start = threading.Barrier(8)

    def pull(sub: WeightSubscriber, target: dict[str, torch.Tensor]):
        start.wait()  # all eight map, hash and copy the same slab at once
        return sub.pull(into=target)

    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(pull, subs, targets, timeout=30)) == [(1, None)] * 8
    assert all(_same(t, data) for t in targets)

    def applied_by_all():
        rec = peers.srv.metrics()["versions"]["policy"][1]
        return rec if len(rec["applied"]) == 8 else None

    rec = wait_for(applied_by_all, 30, "8 workers to report")
    assert (rec["pulls"], rec["pulls_shm"], rec["bytes_served"]) == (8, 8, 0)
    assert peers.srv.handlers.leases.held == {}


def _worker_at_v1(peers: Peers) -> tuple[WeightSubscriber, Channel, dict[str, torch.Tensor]]:
    """v1 published and applied by a worker; a raw channel for a hand-made upload."""
    sub, ch, target = peers.sub(), peers.channel(), _zeros(_tensors(1))
    peers.pub().publish(1, _tensors(1))
    assert sub.pull(into=target) == (1, None)
    return sub, ch, target


def _begin_shm_upload(ch: Channel, version: int, data: dict[str, torch.Tensor]):
    """A publisher by hand: PUB_BEGIN asking for shared memory; returns (PUB_READY, offer, layout,
    the tensors' bytes) so a test can write the slab file and report or commit as it likes."""
    from weight_server.tensors import TORCH_TO_WIRE

    names = sorted(data)
    views = [data[n].reshape(-1).view(torch.uint8).numpy() for n in names]
    lay = P.make_layout([(n, TORCH_TO_WIRE[data[n].dtype], list(data[n].shape)) for n in names], [P.tensor_hash(v) for v in views])
    ready = ch.request(P.PUB_BEGIN, name="policy", version=version, tensors=[t.to_wire() for t in lay.tensors],
                       content_hash=lay.content_hash(), shm=True)
    return ready, P.parse_shm_offer(ready, "shm", lay.total_bytes, leased=False), lay, views


def test_a_follower_hashes_from_shared_memory_while_the_upload_arrives_and_applies_after_commit(peers):
    sub, ch, target = _worker_at_v1(peers)
    data = _tensors(2)
    ready, offer, lay, views = _begin_shm_upload(ch, 2, data)
    with open(offer.path, "r+b") as f:  # the publisher's copy, by hand, reported piece by piece
        for seq, (t, v) in enumerate(zip(lay.tensors, views)):
            f.seek(t.offset)
            f.write(v.tobytes())
            f.flush()
            ch.send(P.PUB_CHUNK, upload=ready["upload"], seq=seq, segments=[[t.offset, t.nbytes]], shm=True)
    result = {}
    follower = threading.Thread(target=lambda: result.update(res=sub.pull(into=target, follow=True)))
    follower.start()
    # It was told every chunk is in and hashed them all: it now waits for the commit alone...
    up = peers.srv.store.upload_of("policy", 2)
    wait_for(lambda: len(up.waiters) == 1, 30, "the follower to wait for the commit")
    assert up.hashed == len(lay.tensors)  # ...and so did the server: the commit has nothing left to hash
    assert follower.is_alive() and _same(target, _tensors(1))  # nothing applied before the commit
    assert ch.request(P.PUB_COMMIT, upload=ready["upload"], shm=True)["kind"] == P.PUB_DONE
    follower.join(5)
    assert result["res"] == (2, None) and _same(target, data) and sub.stats["pulls_shm"] == 2
    wait_for(lambda: peers.srv.metrics()["versions"]["policy"][2]["applied"], 30, "v2 applied")  # its lease with it
    assert peers.srv.handlers.leases.held == {}


def _wait_until_following(srv: WeightServer, version: int) -> None:
    """Until a follower of the pending ``version`` waits at the server (for bytes or for the commit)."""
    up = srv.store.upload_of("policy", version)
    wait_for(lambda: up.parked or up.waiters, 30, f"a follower of the upload of v{version}")


def test_a_follower_waits_for_the_commit_then_reads_shared_memory(peers):
    sub, ch, target = _worker_at_v1(peers)
    data = _tensors(2)
    ready, offer, lay, views = _begin_shm_upload(ch, 2, data)
    result = {}
    follower = threading.Thread(target=lambda: result.update(res=sub.pull(into=target, follow=True)))
    follower.start()
    _wait_until_following(peers.srv, 2)
    assert follower.is_alive() and _same(target, _tensors(1))  # nothing applied before the commit
    with open(offer.path, "r+b") as f:  # the publisher's copy, by hand
        for t, v in zip(lay.tensors, views):
            f.seek(t.offset)
            f.write(v.tobytes())
    assert ch.request(P.PUB_COMMIT, upload=ready["upload"], shm=True)["kind"] == P.PUB_DONE
    follower.join(5)
    assert result["res"] == (2, None) and _same(target, data) and sub.stats["pulls_shm"] == 2
    # an upload that never commits: the follower keeps its weights and gives its lease back
    ready = _begin_shm_upload(ch, 3, data)[0]
    follower = threading.Thread(target=lambda: result.update(res=sub.pull(into=target, follow=True)))
    follower.start()
    _wait_until_following(peers.srv, 3)
    rep = ch.request(P.PUB_COMMIT, upload=ready["upload"], shm=True)  # nothing was written: hashes fail
    assert rep["code"] == P.E_HASH
    follower.join(5)
    assert result["res"] is None and _same(target, data) and sub.version == 2  # nothing applied
    assert peers.srv.handlers.leases.held == {}


def _folders(shm_dir: Path) -> list[str]:
    return sorted(p.name for p in shm_dir.iterdir() if p.name.startswith(P.SHM_DIR_PREFIX))


def test_stop_removes_the_folder_and_persisted_weights_come_back_in_shared_memory(tmp_path):
    cfg = _cfg(shm_dir=str(tmp_path / "shm"), persist_dir=str(tmp_path / "weights"))
    (tmp_path / "shm").mkdir()
    srv = WeightServer(cfg).start()
    folder = srv.shm.path
    assert oct(folder.stat().st_mode & 0o777) == "0o700" and oct(Path(srv.shm.token_path).stat().st_mode & 0o777) == "0o600"
    with WeightPublisher(srv.address, cfg) as pub:
        pub.publish(1, _tensors(1))
    assert oct(Path(_slab_file(srv, 1)).stat().st_mode & 0o777) == "0o600"
    wait_for(lambda: srv.persister.written.get("policy") == 1, 30, "v1 to be persisted")
    srv.stop()
    assert not folder.exists() and _folders(tmp_path / "shm") == []
    srv = WeightServer(cfg).start()  # restart: v1 restored from disk into a shared-memory slab
    try:
        assert _slab_file(srv, 1)
        with WeightSubscriber(srv.address, srv.pub_address, cfg) as sub:
            version, got = sub.pull()
            assert version == 1 and _same(got, _tensors(1)) and sub.stats["pulls_shm"] == 1
    finally:
        srv.stop()
    assert _folders(tmp_path / "shm") == []


def test_the_folder_of_a_sigkilled_server_is_removed_by_the_next_start_but_live_ones_are_kept(tmp_path):
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    args = [
        sys.executable, "-m", "weight_server", f"hydra.run.dir={tmp_path / 'run'}", "hydra.output_subdir=null",
        "hydra/job_logging=none", "hydra/hydra_logging=none", f"weight_server.shm_dir={shm_dir}",
    ]
    child = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = wait_for(lambda: (ln := child.stdout.readline()).startswith("weight server listening") and ln, 30, "the child server")
        assert f"shm {shm_dir}/{P.SHM_DIR_PREFIX}{child.pid}-" in line
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    [dead] = _folders(shm_dir)  # SIGKILL: nothing removed it
    # A folder whose pid is not running here but whose lock is held: a live server in another PID
    # namespace sharing this /dev/shm. It must survive.
    other = shm_dir / f"{P.SHM_DIR_PREFIX}{child.pid}-abcdef"
    other.mkdir(mode=0o700)
    lock_fd = os.open(other / "lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(lock_fd, fcntl.LOCK_EX)
    try:
        srv = WeightServer(_cfg(shm_dir=str(shm_dir)))
        try:
            assert sorted(_folders(shm_dir)) == sorted([srv.shm.path.name, other.name]) and dead not in _folders(shm_dir)
        finally:
            srv.stop()
    finally:
        os.close(lock_fd)
    assert _folders(shm_dir) == [other.name]
    WeightServer(_cfg(shm_dir=str(shm_dir))).stop()  # its lock is free now: removed like any dead server's
    assert _folders(shm_dir) == []


def test_a_full_shm_filesystem_gives_anonymous_slabs_served_over_tcp(caplog, zmq_ctx):
    """Docker's 64 MB /dev/shm: the free-space check is injected so that 1 MB fits and more does not."""
    room = lambda path: reserve_bytes(path) + 1_000_000  # noqa: E731
    cfg = _cfg()
    srv = WeightServer(cfg, shm_free_space=room).start()
    try:
        with WeightPublisher(srv.address, cfg) as pub, WeightSubscriber(srv.address, srv.pub_address, cfg) as sub:
            big = {"w": torch.randn(600_000)}  # 2.4 MB: no room
            assert pub.publish(1, big).via == "tcp"
            assert srv.store.get("policy", 1).slab.path is None
            assert _same(sub.pull()[1], big) and sub.stats["pulls_tcp"] == 1
            assert pub.publish(2, _tensors(2)).via == "shm"  # 240 KB fits
            assert _same(sub.pull()[1], _tensors(2)) and sub.stats["pulls_shm"] == 1
            assert pub.publish(3, {"w": big["w"] + 1}).via == "tcp"
            ch = Channel(srv.address, cfg, zmq_ctx)  # a follower's notice fetch of a version not in shared memory
            rep = ch.request(P.FETCH, name="policy", version=3, chunk=0, shm=True)
            assert rep["code"] == P.E_MALFORMED and "is not in shared memory" in rep["message"]
        c = srv.metrics()["counters"]
        assert (c["anonymous_slabs"], c["publishes_shm"], c["pulls_tcp"], c["pulls_shm"]) == (2, 1, 1, 1)
        assert sum("cannot hold a slab" in r.getMessage() for r in caplog.records) == 1  # logged once
        assert "--shm-size" in caplog.text
    finally:
        srv.stop()


def test_shm_settings_are_validated_and_an_unusable_shm_dir_means_tcp(tmp_path, caplog):
    with pytest.raises(ConfigError, match="weight_server.shm must be one of auto, off, got 'on'"):
        WeightServer(_cfg(shm="on"))
    with pytest.raises(ConfigError, match="weight_server.shm_dir must be an absolute path"):
        WeightSubscriber("tcp://127.0.0.1:1", "tcp://127.0.0.1:2", _cfg(shm_dir="shm"))
    cfg = _cfg(shm_dir=str(tmp_path / "missing"))
    srv = WeightServer(cfg).start()
    try:
        assert srv.shm is None and "every byte goes over TCP" in caplog.text
        with WeightPublisher(srv.address, cfg) as pub, WeightSubscriber(srv.address, srv.pub_address, cfg) as sub:
            assert pub.publish(1, _tensors(1)).via == "tcp"
            assert _same(sub.pull()[1], _tensors(1)) and sub.stats["pulls_tcp"] == 1
    finally:
        srv.stop()


def test_stale_refusal_duplicates_and_a_retry_across_a_server_restart_over_shm(tmp_path, caplog):
    """A restarted server has a new folder and token: the publisher's retry and the worker's next
    pull find them by themselves."""
    from servers import free_port
    from weight_server import StaleVersionError

    cfg = _cfg(port=free_port(), pub_port=free_port(), request_timeout_s=0.5, retry_timeout_s=20.0)
    srv = WeightServer(cfg).start()
    pub = WeightPublisher(srv.address, cfg)
    sub = WeightSubscriber(srv.address, srv.pub_address, cfg)
    target = _zeros(_tensors(1))
    try:
        assert pub.publish(1, _tensors(1)).via == "shm"
        with pytest.raises(StaleVersionError, match="not newer than the newest held version 1"):
            pub.publish(1, _tensors(9))
        assert pub.publish(1, _tensors(1)).duplicate
        assert sub.pull(into=target) == (1, None)
        old_folder = srv.shm.path
        srv.stop()
        result = {}
        publisher = threading.Thread(target=lambda: result.update(stats=pub.publish(2, _tensors(2))))
        publisher.start()
        wait_for(lambda: "publishing 'policy' v2" in caplog.text and "retrying in" in caplog.text, 30,
                 "the publisher to find the server down and back off")
        srv = WeightServer(cfg).start()  # same ports, a new shm folder and token
        publisher.join(20)
        assert not old_folder.exists() and srv.shm.path != old_folder
        assert (result["stats"].version, result["stats"].via) == (2, "shm") and result["stats"].retries >= 1
        assert sub.pull(into=target) == (2, None) and _same(target, _tensors(2))
        assert sub.stats["pulls_shm"] == 2 and sub.stats["shm_fallbacks"] == 0
    finally:
        pub.close()
        sub.close()
        srv.stop()
