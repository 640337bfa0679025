"""LoRA across the weight server, with a real worker (in a thread), Redis and weight server: a
version holds the adapter tensors alone, a worker that joins late applies the newest one to its
own copy of the base model, and its samples carry the learner's log-probs; a worker without the
learner's ``model.lora`` is refused with the setting named."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from learner.engine_factory import make_engine
from learner.engines import full_parameters
from rlhf_core import lora
from rlhf_core.models import load_policy
from weight_server import TensorMismatchError
from worker_helpers import FakeLearner, compose, overrides, recompute

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

LORA = ["model.lora.r=4", "model.lora.alpha=8", "model.lora.target_modules=[all-linear,lm_head]"]


def learner_at(cfg, seed: int):
    """A learner's engine whose adapters are drawn from ``seed`` (as after some training)."""
    model = load_policy(cfg.model).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lora.adapter_parameters(model).values():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return make_engine(cfg, model)


@pytest.fixture
def fake(redis_url, weight_server, tiny_model_cfg):
    cfg = compose(overrides(redis_url, "lora", weight_server, tiny_model_cfg, extra=LORA))
    learner = FakeLearner(cfg)
    try:
        yield learner
    finally:
        for wt in learner.threads:
            wt.halt()
        learner.close()


def test_a_late_worker_applies_the_newest_adapters_on_its_base_model(fake, weight_server, tiny_model_cfg):
    cfg = fake.cfg
    engines = {v: learner_at(cfg, seed=10 + v) for v in range(3)}
    for v, engine in engines.items():  # what Publishing.publish sends with model.lora: the trainable tensors
        fake.publisher.publish(v, engine.named_trainable_parameters())
    fake.buffer.learner.set_learner_version(2)
    adapters = dict(engines[2].named_trainable_parameters())
    adapter_bytes = sum(t.numel() * t.element_size() for t in adapters.values())
    full_bytes = sum(t.numel() * t.element_size() for _, t in full_parameters(load_policy(tiny_model_cfg), None))
    versions = weight_server.metrics()["versions"]["policy"]
    assert [versions[v]["bytes"] for v in range(3)] == [adapter_bytes] * 3
    assert [versions[v]["tensors"] for v in range(3)] == [len(adapters)] * 3  # 15 layers x (A, B)
    assert adapter_bytes < 0.11 * full_bytes  # r=4 on the 64-wide tiny model; bench/lora.py has r=16 on bigger ones

    prompts = fake.enqueue(6)
    worker = fake.thread(cfg, "late", max_prompts=6).start()  # joins after v0..v2: only v2 is pulled
    groups = fake.read_groups(6, learner_version=2)
    worker.join(60)
    assert worker.worker.engine.version == 2 and worker.worker.stats.weight_updates == 1
    base = load_policy(tiny_model_cfg).eval()
    model = engines[2].module.eval()
    worst, base_diff = 0.0, 0.0
    for group in groups:
        for s in group:
            assert s.versions == [[2, s.num_response_tokens]]
            r = cfg.rollout
            worst = max(worst, float(np.abs(recompute(model, s, r.temperature, r.top_k, r.top_p) - s.behaviour_logprobs).max()))
            base_diff = max(base_diff, float(np.abs(recompute(base, s, r.temperature, r.top_k, r.top_p) - s.behaviour_logprobs).max()))
    assert sum(len(g) for g in groups) == 6 * cfg.algo.group_size and {g[0].prompt_id for g in groups} == {p.prompt_id for p in prompts}
    assert worst < 1e-4, f"the worker's behaviour log-probs differ from the learner's v2 by {worst}"
    assert base_diff > 0.05  # it generated with the adapters, not the base model
    assert "late" in weight_server.metrics()["versions"]["policy"][2]["applied"]


def test_a_worker_without_the_learners_lora_is_told_which_setting_differs(fake):
    fake.publisher.publish(0, learner_at(fake.cfg, seed=1).named_trainable_parameters())
    plain = dataclasses.replace(fake.cfg, model=dataclasses.replace(fake.cfg.model, lora=dataclasses.replace(
        fake.cfg.model.lora, r=0)))
    worker = fake.thread(plain, "plain", max_prompts=1).start()
    with pytest.raises(TensorMismatchError, match=r"model\.lora\.r=0 .*same model and model\.lora settings"):
        worker.join(60)
