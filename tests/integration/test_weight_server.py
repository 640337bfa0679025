"""Weight server over real ZeroMQ sockets: publish/pull, ordering, late join, in-place pulls,
delta, 8 concurrent pullers, metrics."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

from rlhf_core.config import WeightServerConfig
from servers import wait_for
from weight_server import StaleVersionError, TensorMismatchError, WeightPublisher, WeightServer, WeightSubscriber
from weight_server import protocol as P

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


@pytest.fixture
def cfg() -> WeightServerConfig:
    # The TCP data path (chunks, flow control, bytes served): shared memory is off, or every client
    # here would move its bytes through the server's shm files. test_weight_server_shm.py covers that.
    return WeightServerConfig(
        chunk_bytes=64 * 1024, max_inflight_chunks=4, request_timeout_s=3.0, retry_timeout_s=5.0, announce_interval_s=0.1,
        shm="off",
    )


@pytest.fixture
def server(cfg):
    srv = WeightServer(cfg).start()
    yield srv
    srv.stop()


@pytest.fixture
def clients(server, cfg):
    opened = []

    class Clients:
        def pub(self) -> WeightPublisher:
            opened.append(WeightPublisher(server.address, cfg))
            return opened[-1]

        def sub(self, worker_id: str = "w0") -> WeightSubscriber:
            opened.append(WeightSubscriber(server.address, server.pub_address, cfg, worker_id=worker_id))
            return opened[-1]

    try:
        yield Clients()
    finally:
        for c in opened:
            c.close()


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(300, 200, generator=g),  # 240000 bytes: several 64 KiB chunks
        "b": torch.arange(7, dtype=torch.int64) * seed,
        "e": torch.randn(50, generator=g).to(torch.bfloat16),
        "flag": torch.rand(9, generator=g) > 0.5,
    }


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype, name
        assert torch.equal(got[name], t), name


def _layout_bytes(tensors: dict[str, torch.Tensor]) -> int:
    from weight_server.tensors import TORCH_TO_WIRE

    return P.make_layout([(n, TORCH_TO_WIRE[t.dtype], list(t.shape)) for n, t in sorted(tensors.items())]).total_bytes


def _applied_by(server: WeightServer, workers: int, version: int = 1) -> dict | None:
    """The metrics record of ``version`` once ``workers`` workers reported applying it."""
    rec = server.metrics()["versions"]["policy"][version]
    return rec if len(rec["applied"]) == workers else None


def test_publish_then_pull_exact_values_and_metrics(server, clients):
    pub, sub = clients.pub(), clients.sub("w0")
    data = _tensors(1)
    stats = pub.publish(1, data)
    assert (stats.version, stats.tensors, stats.retries, stats.duplicate) == (1, 4, 0, False)
    assert stats.bytes == 240000 + 56 + 100 + 9
    version, got = sub.pull()
    assert version == 1
    _assert_same(got, data)
    sub.report_applied(1, apply_s=0.5)
    rec = wait_for(lambda: _applied_by(server, 1), 30, "the worker's applied report")
    assert rec["bytes"] == stats.bytes
    assert rec["tensors"] == 4
    assert rec["pulls"] == 1
    assert rec["bytes_served"] == _layout_bytes(data)
    assert rec["applied"]["w0"]["apply_s"] == 0.5
    assert 0 < rec["applied"]["w0"]["latency_s"] < 10
    assert rec["publish_duration_s"] > 0
    assert server.metrics()["counters"]["published"] == 1


def test_versions_only_grow_and_stale_pushes_are_refused(server, clients):
    pub, sub = clients.pub(), clients.sub()
    assert pub.latest_version() is None
    pub.publish(1, _tensors(1))
    pub.publish(2, _tensors(2))
    with pytest.raises(StaleVersionError, match="version 2 of 'policy' is not newer than the newest held version 2"):
        pub.publish(2, _tensors(3))
    with pytest.raises(StaleVersionError, match="publish 3 or above"):
        pub.publish(1, _tensors(3))
    assert pub.latest_version() == 2
    assert server.metrics()["counters"]["stale_refused"] == 2
    version, got = sub.pull()
    assert version == 2
    _assert_same(got, _tensors(2))
    # an identical retry of the newest version is answered without a transfer
    again = pub.publish(2, _tensors(2))
    assert again.duplicate and again.wire_bytes == 0


def test_keeps_newest_k_versions_and_pulls_a_named_one(server, clients):
    pub, sub = clients.pub(), clients.sub()
    for v in (1, 2, 3):
        pub.publish(v, _tensors(v))
    assert server.metrics()["held"] == {"policy": [2, 3]}
    version, got = sub.pull(version=2)
    assert version == 2
    _assert_same(got, _tensors(2))
    assert sub.pull(version=1) is None  # evicted: nothing applied


def test_asking_for_the_newest_before_any_is_published_is_no_warning(server, clients, caplog):
    # every run's workers ask before the learner's first publication: logged at INFO; a named
    # version the server does not hold is a fault worth a WARNING
    caplog.set_level(logging.INFO, logger="weight_server")
    sub = clients.sub()
    assert sub.pull() is None
    assert sub.pull(version=7) is None
    refusals = [(r.levelno, r.getMessage()) for r in caplog.records if r.getMessage().startswith("refused")]
    assert (logging.INFO, "refused ws.manifest_req: no version of 'policy' is held yet") in refusals
    assert (logging.WARNING, "refused ws.manifest_req: version 7 of 'policy' is not held (held: [])") in refusals


def test_late_joining_worker_receives_newest(server, clients):
    pub = clients.pub()
    for v in (1, 2, 3):
        pub.publish(v, _tensors(v))
    sub = clients.sub("late")  # joins after three versions
    assert wait_for(lambda: sub.poll_announcement(timeout_ms=50), 30, "a re-announcement") == 3  # periodic re-announcement
    version, got = sub.pull()
    assert version == 3
    _assert_same(got, _tensors(3))


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(16, 300), torch.nn.LayerNorm(300), torch.nn.Linear(300, 4))
    m.register_buffer("step", torch.tensor(seed, dtype=torch.int64))
    return m


def test_pull_into_module_in_place(server, clients):
    pub, sub = clients.pub(), clients.sub()
    src, dst = _model(1), _model(2)
    ptrs = {n: t.data_ptr() for n, t in dst.state_dict().items()}
    pub.publish(1, src)
    assert sub.pull(into=dst) == (1, None)
    for (n, a), b in zip(src.state_dict().items(), dst.state_dict().values()):
        assert torch.equal(a, b), n
    assert {n: t.data_ptr() for n, t in dst.state_dict().items()} == ptrs  # copy_ in place, no new storage
    assert dst.step.item() == 1
    # bf16 transfer into the fp32 model: values are the bf16-rounded ones
    with torch.no_grad():
        src[0].weight.mul_(3.0)
    pub.publish(2, src, dtype=torch.bfloat16)
    assert sub.pull(into=dst) == (2, None)
    assert torch.equal(dst[0].weight, src[0].weight.to(torch.bfloat16).float())
    assert dst[0].weight.dtype == torch.float32 and dst.step.item() == 1
    # pulling the version already applied transfers nothing
    received = sub.stats["bytes_received"]
    assert sub.pull(into=dst) == (2, None)
    assert sub.stats["bytes_received"] == received


def test_pull_into_model_with_other_names_is_a_clear_error(server, clients):
    pub, sub = clients.pub(), clients.sub()
    pub.publish(1, _model(1))
    other = torch.nn.Sequential(torch.nn.Linear(16, 300))
    with pytest.raises(TensorMismatchError, match=r"missing from the target \(e.g. \['1.bias', '1.weight', '2.bias'\]\)"):
        sub.pull(into=other)


def test_delta_publish_sends_and_pulls_only_changed_tensors(server, clients):
    pub, sub = clients.pub(), clients.sub()
    data = _tensors(1)
    target = {n: torch.zeros_like(t) for n, t in data.items()}
    pub.publish(1, data)
    assert sub.pull(into=target) == (1, None)
    before = sub.stats["bytes_received"]
    data["b"] = data["b"] + 100  # only the small int64 tensor changes
    stats = pub.publish(2, data, delta=True)
    assert (stats.changed_tensors, stats.wire_bytes) == (1, 56)
    assert sub.pull(into=target) == (2, None)
    _assert_same(target, data)
    assert sub.stats["bytes_received"] - before == 64 * 1024  # the one chunk holding "b"
    rec = server.metrics()["versions"]["policy"][2]
    assert (rec["delta"], rec["wire_bytes"], rec["changed_tensors"]) == (True, 56, 1)


def test_eight_workers_pulling_at_once_end_identical(server, clients, cfg):
    pub = clients.pub()
    g = torch.Generator().manual_seed(0)
    data = {f"layer{i}": torch.randn(256 * 1024, generator=g) for i in range(4)}  # 4 MiB: 64 chunks each pull
    pub.publish(1, data)
    subs = [clients.sub(f"w{i}") for i in range(8)]
    targets = [{n: torch.zeros_like(t) for n, t in data.items()} for _ in subs]
    results: list = [None] * 8
    barrier = threading.Barrier(8)

    def pull(i: int) -> None:
        barrier.wait()
        results[i] = subs[i].pull(into=targets[i])

    threads = [threading.Thread(target=pull, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results == [(1, None)] * 8
    for target in targets:
        _assert_same(target, data)
    total = _layout_bytes(data)
    rec = wait_for(lambda: _applied_by(server, 8), 30, "8 workers' applied reports")
    assert (rec["pulls"], rec["bytes_served"]) == (8, 8 * total)
    assert server.metrics()["counters"]["dropped_replies"] == 0


def test_metrics_are_served_over_the_wire(server, clients, cfg, zmq_ctx):
    from weight_server.client import Channel

    stats = clients.pub().publish(4, _tensors(4))
    rep = Channel(server.address, cfg, zmq_ctx).request(P.METRICS_REQ)
    assert rep["kind"] == P.METRICS
    metrics = rep["metrics"]
    assert metrics["held"] == {"policy": [4]}
    assert metrics["versions"]["policy"]["4"]["bytes"] == stats.bytes  # version keys are strings on the wire
    assert metrics["counters"]["published"] == 1
