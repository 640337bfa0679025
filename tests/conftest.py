"""Fixtures shared by the unit and integration suites."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import pytest

# Quiet and offline before anything imports transformers.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

sys.path.insert(0, str(Path(__file__).parent))

from servers import RedisServer, zmq_context  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """`gpu` tests skip cleanly without CUDA."""
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def redis_server(tmp_path):
    """A private redis-server (random port, AOF on) in this test's temp dir; stopped by PID."""
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server) -> str:
    return redis_server.url


@pytest.fixture
def zmq_ctx():
    """A context for sockets made by the test: all closed (linger 0) at teardown, whatever the outcome."""
    ctx = zmq_context()
    yield ctx
    ctx.close()


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory) -> Path:
    """One cache dir for tiny models per test session (built once, loaded via from_pretrained)."""
    cache = os.environ.get("RLHF_TEST_CACHE")
    return Path(cache) if cache else tmp_path_factory.mktemp("model-cache")


@pytest.fixture(scope="session")
def tiny_model_cfg(model_cache):
    from rlhf_core.config import ModelConfig

    return ModelConfig(cache_dir=str(model_cache))


@pytest.fixture(scope="session")
def tiny_vllm_cfg(model_cache):
    """The tiny model in conf/model/tiny_vllm.yaml's shape (head_dim 64, which vLLM's CPU attention runs)."""
    from rlhf_core.config import ModelConfig, TinyModelConfig

    return ModelConfig(cache_dir=str(model_cache), tiny=TinyModelConfig(hidden_size=128, num_heads=2, intermediate_size=256))


@pytest.fixture
def weight_server():
    """A real weight server in a thread of this process (loopback, random ports)."""
    from rlhf_core.config import WeightServerConfig
    from weight_server import WeightServer

    server = WeightServer(WeightServerConfig()).start()
    yield server
    server.stop()



@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """torch on one thread in the test processes (what a worker process does): the tiny model is
    overhead-bound, and on a shared 2-core machine (two xdist workers, their children) extra
    OpenMP threads only spin against the other processes (20x slower steps measured; a 3 s
    learner test took 29 s in a full run). Child processes set their own (OMP_NUM_THREADS)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def run(redis_url, weight_server, tiny_model_cfg, request):
    """``run(**settings) -> (cfg, learner)``: a fresh run id per test on the shared servers, the
    test playing the learner (:class:`worker_helpers.FakeLearner`). Worker threads started through
    ``learner.thread(...)`` are stopped before the servers go."""
    from worker_helpers import FakeLearner, compose, overrides

    made = []

    def make(**settings):
        cfg = compose(overrides(redis_url, request.node.name, weight_server, tiny_model_cfg, **settings))
        learner = FakeLearner(cfg)
        made.append(learner)
        return cfg, learner

    with contextlib.ExitStack() as stack:  # every step runs, whatever the test or an earlier step raised
        yield make
        for learner in made:
            stack.callback(learner.close)  # after its worker threads (callbacks run last-in, first-out)
            for wt in learner.threads:
                stack.callback(wt.halt)
