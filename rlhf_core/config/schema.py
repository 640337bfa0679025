"""The whole config tree, registered in Hydra's ConfigStore, and its conversion to the dataclasses."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf

from rlhf_core.choices import Launcher
from rlhf_core.config.algo import AlgoConfig
from rlhf_core.config.buffer import BufferConfig
from rlhf_core.config.data import DataConfig, EvalConfig
from rlhf_core.config.distill import DistillConfig
from rlhf_core.config.learner import LearnerConfig
from rlhf_core.config.model import ModelConfig
from rlhf_core.config.reward import RewardConfig
from rlhf_core.config.rollout import RolloutConfig
from rlhf_core.config.run import GatewayConfig, RayConfig, RunConfig
from rlhf_core.config.sandbox import SandboxConfig
from rlhf_core.config.weight_server import WeightServerConfig
from rlhf_core.errors import ConfigError

#: the settings that hold a secret (a URL's password aside): what leaves the run, as the config an
#: experiment tracker is given, shows them as "***"
SECRET_FIELDS = frozenset({"weight_server.secret", "weight_server.curve_server_secret",
                           "weight_server.curve_client_secret", "gateway.api_keys"})


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    buffer: BufferConfig = field(default_factory=BufferConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    weight_server: WeightServerConfig = field(default_factory=WeightServerConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    data: DataConfig = field(default_factory=DataConfig)
    run: RunConfig = field(default_factory=RunConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)  # on-policy distillation from a teacher
    launcher: Launcher = Launcher.local  # rlhf-run: child processes on this machine, or Ray actors on a cluster
    ray: RayConfig = field(default_factory=RayConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)  # where a policy's programs run (sandbox=none: unisolated)
    # rlhf-run resume=<output folder>: continue that run (its saved config, run id, Redis data, checkpoint)
    resume: str | None = None


@dataclass
class MonitorConfig:
    url: str = MISSING  # redis:// URL of the run's Redis
    run_id: str = "default"
    once: bool = False
    json: bool = False
    refresh_s: float = 1.0
    prometheus_port: int | None = None  # serve the run's Prometheus target while watching it live
    workers: int | None = None  # set the number of worker actors of a launcher=ray run, then exit


def register_configs() -> None:
    """Register the schemas so YAML files can extend them (idempotent)."""
    from hydra.core.config_store import ConfigStore

    if not OmegaConf.has_resolver("resume_or"):
        # hydra.run.dir of rlhf-run: a resumed run logs into its own folder, not a new one
        OmegaConf.register_new_resolver("resume_or", lambda resume, default: resume or default)
    if not OmegaConf.has_resolver("hydra_subdir"):
        # hydra.output_subdir of rlhf-run: `.hydra/` keeps the first launch's config and overrides;
        # each resume writes its own under `.hydra/resume-<time>/`
        OmegaConf.register_new_resolver("hydra_subdir", lambda resume, stamp: f".hydra/resume-{stamp}" if resume else ".hydra")
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    cs.store(name="base_monitor", node=MonitorConfig)


def to_object(cfg: DictConfig | ListConfig) -> Any:
    """Resolve a composed config into the dataclasses; a required value left as ??? and a key that
    is no setting (added with ``+``, which Hydra suggests for a misspelt one) are ConfigErrors."""
    from omegaconf.errors import MissingMandatoryValue

    try:
        obj = OmegaConf.to_object(cfg)
    except MissingMandatoryValue as exc:
        key = getattr(exc, "full_key", "") or str(exc)
        raise ConfigError(f"required setting {key} has no value: pass {key}=... on the command line") from None
    unknown = unknown_settings(obj)
    if unknown:
        raise ConfigError(f"{'; '.join(unknown)}; `--help` lists every setting")
    return obj


def unknown_settings(obj: Any, prefix: str = "") -> list[str]:
    """The keys of ``obj``'s dataclasses that are not their fields (OmegaConf keeps a key added with
    ``+`` as an attribute, and nothing reads it), each with the nearest field's name. The free-form
    dicts (``reward.functions``, ``rollout.env``, ...) take any key."""
    import difflib

    if not dataclasses.is_dataclass(obj):
        return []
    names = [f.name for f in dataclasses.fields(obj)]
    found = []
    for key in vars(obj):
        if key not in names:
            near = difflib.get_close_matches(key, names, n=1)
            found.append(f"{prefix}{key} is not a setting" + (f" (did you mean {prefix}{near[0]}?)" if near else ""))
    for name in names:
        found += unknown_settings(getattr(obj, name), f"{prefix}{name}.")
    return found
