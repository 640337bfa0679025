"""The GPU target: a 1 GB bf16 version (a 0.5B model) applied into a GPU model in under 1 s,
publish -> applied, over TCP and over same-host shared memory. Skipped without CUDA."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from rlhf_core.config import WeightServerConfig
from weight_server import WeightPublisher, WeightServer, WeightSubscriber

pytestmark = [pytest.mark.integration, pytest.mark.gpu, pytest.mark.slow, pytest.mark.timeout(180)]


@pytest.mark.parametrize("shm", ["off", "auto"])
def test_one_gb_bf16_version_applied_into_a_gpu_model_under_one_second(shm):
    cfg = WeightServerConfig(
        chunk_bytes=8 * 1024 * 1024, max_inflight_chunks=8, request_timeout_s=10.0, announce_interval_s=0.1, shm=shm,
    )
    data = {f"layers.{i:02d}.weight": torch.empty(8192, 4096, dtype=torch.bfloat16).normal_() for i in range(16)}  # 1 GiB
    target = {n: torch.zeros_like(t, device="cuda") for n, t in data.items()}
    server = WeightServer(cfg).start()
    pub = WeightPublisher(server.address, cfg)
    sub = WeightSubscriber(server.address, server.pub_address, cfg, worker_id="gpu0")
    try:
        # Warm-up to the steady state of a training run: server slabs and the pinned staging buffer
        # get allocated once. Slabs take turns, three of them with keep_versions=2 (two held, one
        # being uploaded); a fresh shared-memory slab's pages are reserved and mapped once by the
        # server, the publisher and the worker.
        for v in (1, 2, 3):
            pub.publish(v, data)
            assert sub.pull(into=target) == (v, None)
        for t in data.values():
            t[0, 0] += 1  # every tensor changes
        result = {}

        def follow():
            while (sub.poll_announcement(timeout_ms=1, pending=True) or 0) < 4:
                pass
            result["res"] = sub.pull(into=target, follow=True)
            result["t"] = time.monotonic()

        worker = threading.Thread(target=follow)
        worker.start()
        t0 = time.monotonic()
        pub.publish(4, data)
        worker.join(60)
        elapsed = result["t"] - t0
        assert result["res"] == (4, None)
        assert all(torch.equal(target[n].cpu(), data[n]) for n in data)
        assert sub.stats["pulls_shm" if shm == "auto" else "pulls_tcp"] == 4
        print(f"shm={shm}: publish -> applied on the GPU in {elapsed:.3f} s")
        assert elapsed < 1.0, f"publish -> applied on the GPU took {elapsed:.2f} s"
    finally:
        sub.close()
        pub.close()
        server.stop()


def test_shm_pull_into_gpu_tensors_converts_dtypes_and_rejects_corrupted_bytes():
    cfg = WeightServerConfig(request_timeout_s=5.0, announce_interval_s=0.1)
    g = torch.Generator().manual_seed(0)
    data = {"a": torch.randn(1000, 300, generator=g), "b": torch.arange(10)}
    target = {"a": torch.zeros(1000, 300, device="cuda"), "b": torch.zeros(10, dtype=torch.int64, device="cuda")}
    server = WeightServer(cfg).start()
    pub = WeightPublisher(server.address, cfg)
    sub = WeightSubscriber(server.address, server.pub_address, cfg, worker_id="gpu0")
    try:
        assert pub.publish(1, data, dtype=torch.bfloat16).via == "shm"
        assert sub.pull(into=target) == (1, None)
        assert torch.equal(target["a"].cpu(), data["a"].to(torch.bfloat16).float()) and torch.equal(target["b"].cpu(), data["b"])
        pub.publish(2, {"a": data["a"] * 2, "b": data["b"]}, dtype=torch.bfloat16)
        with open(server.store.get("policy", 2).slab.path, "r+b") as f:
            f.write(b"\x00" * 8)  # tensor "a" starts at byte 0
        assert sub.pull(into=target) is None and sub.stats["integrity_failures"] == 1
        assert torch.equal(target["a"].cpu(), data["a"].to(torch.bfloat16).float())  # v1 kept
        assert sub.stats["pulls_shm"] == 1
    finally:
        sub.close()
        pub.close()
        server.stop()
