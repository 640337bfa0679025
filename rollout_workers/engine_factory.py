"""The engine a run's config names (``rollout.engine``).

Apart from :mod:`rollout_workers.engine` because both engines import that module's records:
the factory imports the engines, so it sits above them.
"""

from __future__ import annotations

from typing import Any

from rlhf_core.choices import RolloutEngine
from rlhf_core.config import ConfigError, response_budget
from rollout_workers.engine import GenerationEngine


def make_engine(cfg: Any, model: Any = None, tokenizer: Any = None) -> GenerationEngine:
    """The engine named by ``cfg.rollout.engine``.

    Args:
        cfg: the full run config (:class:`rlhf_core.config.Config` or its DictConfig); reads
            ``cfg.rollout`` (engine, slots, seed, vllm settings) and ``cfg.model``.
        model: hf only: the loaded policy (``rlhf_core.models.load_policy``); loaded from
            ``cfg.model`` when None. vllm loads its own copy from ``cfg.model`` and ignores it.
        tokenizer: the policy's tokenizer; loaded from ``cfg.model`` when None.
    """
    name = cfg.rollout.engine
    if name == "hf":
        from rlhf_core.models import load_policy, load_tokenizer
        from rollout_workers.hf_engine import HFEngine

        model = load_policy(cfg.model) if model is None else model
        tokenizer = load_tokenizer(cfg.model) if tokenizer is None else tokenizer
        r = cfg.rollout
        return HFEngine(model, tokenizer, slots=int(r.slots), seed=int(r.seed),
                        max_model_len=int(r.max_prompt_tokens) + response_budget(r),
                        prefill_chunk=int(r.prefill_chunk_tokens), cuda_graphs=bool(r.cuda_graphs))
    if name == "vllm":
        from rollout_workers.vllm_engine import VLLMEngine

        return VLLMEngine.from_config(cfg, tokenizer=tokenizer)
    raise ConfigError(f"rollout.engine='{name}' is not one of {', '.join(RolloutEngine)}")
