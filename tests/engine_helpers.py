"""What the engine tests (hf and vllm) share: tokenizing a prompt and the learner's view of a result."""

from __future__ import annotations

import numpy as np
import psutil
import torch

from rlhf_core.sampling import response_logprobs
from rollout_workers.engine import GenResult, SamplingParams


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text)["input_ids"]


def recompute(model, result: GenResult, params: SamplingParams,
              update: tuple[torch.nn.Module, int] | None = None) -> np.ndarray:
    """The learner's view: one plain forward over prompt + response (no cache, no padding),
    processed by rlhf_core.sampling with the request's settings.

    ``update``: ``(old, a)``, an in-flight update that makes the response's token ``a`` the first
    one sampled by ``model``: every position fed before it (the prompt and the first ``a - 1``
    response tokens) ran ``old``, whose K/V stays in the cache, and ``model`` runs the rest on top
    of that cache. The exact reference for the behaviour log-probs of a request the update met."""
    full = torch.tensor(np.concatenate([result.prompt_ids, result.token_ids]), dtype=torch.long)[None]
    with torch.no_grad():
        if update is None:
            logits = model(input_ids=full).logits
        else:
            old, a = update
            head = old(input_ids=full[:, : len(result.prompt_ids) + a - 1], use_cache=True)
            tail = model(input_ids=full[:, head.logits.shape[1] :], past_key_values=head.past_key_values).logits
            logits = torch.cat([head.logits, tail], dim=1)
        logits = logits[:, len(result.prompt_ids) - 1 : -1]
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
