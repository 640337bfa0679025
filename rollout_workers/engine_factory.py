"""The engine a run's config names (``rollout.engine``); apart from :mod:`rollout_workers.engine`,
whose records both engines import, because it imports the engines."""

from __future__ import annotations

from typing import Any

from rlhf_core.choices import RolloutEngine
from rlhf_core.config import ConfigError, response_budget
from rollout_workers.engine import GenerationEngine


def make_engine(cfg: Any, model: Any = None, tokenizer: Any = None) -> GenerationEngine:
    """The engine named by ``cfg.rollout.engine`` (the full run config). ``model`` (hf only; vllm
    loads its own) and ``tokenizer`` are loaded from ``cfg.model`` when None."""
    from rlhf_core.models import load_tokenizer

    name, r = cfg.rollout.engine, cfg.rollout
    max_len = int(r.max_prompt_tokens) + response_budget(r)
    if name == "hf":
        from rlhf_core.models import load_policy
        from rollout_workers.hf_engine import HFEngine

        model = load_policy(cfg.model) if model is None else model
        tokenizer = load_tokenizer(cfg.model) if tokenizer is None else tokenizer
        return HFEngine(model, tokenizer, slots=int(r.slots), seed=int(r.seed), max_model_len=max_len,
                        prefill_chunk=int(r.prefill_chunk_tokens), cuda_graphs=bool(r.cuda_graphs))
    if name == "vllm":
        from rlhf_core.models import model_dir
        from rollout_workers.vllm_engine import VLLMEngine, import_vllm

        import_vllm()  # fail with the install hint before building anything
        tokenizer = load_tokenizer(cfg.model) if tokenizer is None else tokenizer
        return VLLMEngine(str(model_dir(cfg.model)), tokenizer, slots=int(r.slots), seed=int(r.seed),
                          dtype=str(cfg.model.dtype), gpu_memory_utilization=float(r.gpu_memory_utilization),
                          tensor_parallel_size=int(r.tensor_parallel_size), trust_remote_code=bool(cfg.model.trust_remote_code),
                          max_model_len=max_len, cpu_kv_cache_gb=int(r.cpu_kv_cache_gb), lora=cfg.model.lora,
                          enforce_eager=bool(r.enforce_eager))
    raise ConfigError(f"rollout.engine='{name}' is not one of {', '.join(RolloutEngine)}")
