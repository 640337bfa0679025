"""The `vllm` engine. Without vLLM (every CPU machine) only the "missing package" error is tested;
the rest needs a CUDA GPU with ``pip install rlhf-service[gpu]`` and skips cleanly otherwise."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from rlhf_core.config import Config
from rlhf_core.models import load_policy, load_tokenizer, model_dir
from rlhf_core.sampling import response_logprobs
from rollout_workers.engine import EngineError, GenRequest, SamplingParams
from rollout_workers.engine_factory import make_engine

HAS_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed here")
def test_missing_vllm_is_a_clear_user_error(tiny_model_cfg):
    cfg = Config()
    cfg.model = tiny_model_cfg
    cfg.rollout.engine = "vllm"
    with pytest.raises(EngineError, match=r"pip install 'rlhf-service\[gpu\]'.*rollout.engine=hf"):
        make_engine(cfg)


@pytest.fixture(scope="module")
def vllm_engine(tiny_model_cfg):
    pytest.importorskip("vllm")
    if not torch.cuda.is_available():
        pytest.skip("vLLM needs a CUDA GPU")
    from rollout_workers.vllm_engine import VLLMEngine

    tokenizer = load_tokenizer(tiny_model_cfg)
    engine = VLLMEngine(str(model_dir(tiny_model_cfg)), tokenizer, slots=4, seed=0, dtype="float32",
                        gpu_memory_utilization=0.2)
    return engine, tokenizer


def run(engine):
    results = {}
    for _ in range(1000):
        if not engine.has_work():
            break
        for r in engine.step():
            results[r.request_id] = r
    return results


@pytest.mark.gpu
def test_vllm_behaviour_logprobs_match_a_plain_forward(vllm_engine, tiny_model_cfg):
    engine, tokenizer = vllm_engine
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_new_tokens=16, ignore_eos=True)
    for i, text in enumerate(["h", "hello world", "the quick brown fox"]):
        engine.add(GenRequest(f"p{i}", tokenizer(text)["input_ids"], params))
    results = run(engine)
    policy = load_policy(tiny_model_cfg).eval()
    for r in results.values():
        assert r.num_tokens == 16 and r.finish_reason == "length" and (r.versions == 0).all()
        full = torch.tensor(np.concatenate([r.prompt_ids, r.token_ids]), dtype=torch.long)[None]
        with torch.no_grad():
            logits = policy(input_ids=full).logits[:, len(r.prompt_ids) - 1 : -1]
        ref = response_logprobs(logits, torch.from_numpy(r.token_ids.astype(np.int64))[None], 0.8, 20, 0.9)[0]
        # different kernels (paged attention vs. sdpa): a looser bound than the hf engine's 1e-4
        np.testing.assert_allclose(r.logprobs, ref.numpy(), rtol=0, atol=2e-3)


@pytest.mark.gpu
def test_vllm_versions_change_after_update_and_abort(vllm_engine, tiny_model_cfg):
    engine, tokenizer = vllm_engine
    engine.add(GenRequest("long", tokenizer("abc")["input_ids"], SamplingParams(max_new_tokens=40, ignore_eos=True)))
    engine.add(GenRequest("gone", tokenizer("xyz")["input_ids"], SamplingParams(max_new_tokens=40, ignore_eos=True)))
    for _ in range(5):
        engine.step()
    aborted = engine.abort("gone")
    assert aborted.finish_reason == "abort" and engine.abort("gone") is None
    policy = load_policy(tiny_model_cfg)
    engine.update_weights({n: p.detach() * 0.5 for n, p in policy.named_parameters()}, version=engine.version + 1)
    r = run(engine)["long"]
    versions = r.versions.tolist()
    switch = versions.index(engine.version)
    assert r.num_tokens == 40 and 0 < switch < 40
    assert versions == [engine.version - 1] * switch + [engine.version] * (40 - switch)
