"""The training engine a run's config names (``learner.engine``: torch or deepspeed).

Apart from :mod:`learner.engines` because the DeepSpeed engine imports that module's optimizer
and schedule helpers: the factory imports both engines, so it sits above them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from learner.engines import TorchEngine, TrainEngine
from rlhf_core.choices import LearnerEngine
from rlhf_core.config import ConfigError, LearnerConfig

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def build_engine(module: PreTrainedModel, cfg: LearnerConfig, lr: float | None = None) -> TrainEngine:
    """The engine ``cfg.engine`` names, wrapping ``module`` (already on its device)."""
    if cfg.engine == "torch":
        return TorchEngine(module, cfg, lr)
    if cfg.engine == "deepspeed":
        from learner.engine_deepspeed import DeepSpeedEngine

        return DeepSpeedEngine(module, cfg, lr)
    raise ConfigError(f"learner.engine='{cfg.engine}' is not one of {', '.join(LearnerEngine)}")


def make_engine(cfg: Any, module: PreTrainedModel, role: str | None = None) -> TrainEngine:
    """:func:`build_engine` from the whole run config. ``role``: "policy" or "critic" (the
    critic trains at ``learner.critic_lr``); None guesses from the model (a one-label
    token-classification head is a critic)."""
    if role is None:
        arch = " ".join(getattr(getattr(module, "config", None), "architectures", None) or [type(module).__name__])
        role = "critic" if "TokenClassification" in arch or "TokenClassification" in type(module).__name__ else "policy"
    if role not in ("policy", "critic"):
        raise ValueError(f"role must be policy or critic, got {role!r}")
    lcfg = cfg.learner
    lr = lcfg.critic_lr if role == "critic" and lcfg.critic_lr is not None else lcfg.lr
    return build_engine(module, lcfg, lr)
