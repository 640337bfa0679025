"""What the engine tests (hf and vllm) share: tokenizing a prompt and the learner's view of a result."""

from __future__ import annotations

import numpy as np
import psutil
import torch

from rlhf_core.sampling import response_logprobs
from rollout_workers.engine import GenResult, SamplingParams


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text)["input_ids"]


def recompute(model, result: GenResult, params: SamplingParams) -> np.ndarray:
    """The learner's view: one plain forward over prompt + response (no cache, no padding),
    processed by rlhf_core.sampling with the request's settings."""
    full = torch.tensor(np.concatenate([result.prompt_ids, result.token_ids]), dtype=torch.long)[None]
    with torch.no_grad():
        logits = model(input_ids=full).logits[:, len(result.prompt_ids) - 1 : -1]
    tokens = torch.from_numpy(result.token_ids.astype(np.int64))[None]
    return response_logprobs(logits, tokens, params.temperature, params.top_k, params.top_p)[0].numpy()


def engine_core(pid: int) -> psutil.Process:
    """vLLM's engine-core process under process ``pid`` (it names itself VLLM::EngineCore)."""
    for child in psutil.Process(pid).children(recursive=True):
        try:
            if "EngineCor" in child.name() or "EngineCore" in " ".join(child.cmdline()):
                return child
        except psutil.Error:
            continue
    raise AssertionError(f"no vLLM engine-core process under pid {pid}")
