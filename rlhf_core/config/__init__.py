"""The run's config: typed schemas registered in Hydra's ConfigStore, and their checks.

The YAML groups under ``conf/`` fill these dataclasses, so a misspelt key, a wrong type or a
choice that is not one of its Enum's values (``rlhf_core/choices.py``) fails at composition.
Each section is a module with its dataclass and ``check()``, the rules within that section
(``model``, ``algo``, ``buffer``, ``rollout``, ``learner``, ``weight_server``, ``reward``,
``data`` with ``eval``, ``distill``, ``run`` with ``ray`` and ``gateway``, ``sandbox``); ``schema`` is the whole tree; ``rules``
holds the rules between sections and :func:`validate`, which runs them all once at start-up,
before any model is built, with errors that name the numbers.
"""

from rlhf_core.config.algo import AlgoConfig, ISConfig, check_clip, check_gamma_lam, check_penalties
from rlhf_core.config.buffer import BufferConfig, replay_mode
from rlhf_core.config.data import DataConfig, EvalConfig
from rlhf_core.config.distill import DistillConfig, TeacherConfig
from rlhf_core.config.learner import LearnerConfig
from rlhf_core.config.model import VLLM_LORA_RANKS, LoraConfig, ModelConfig, TinyModelConfig
from rlhf_core.config.reward import ENV_COMPONENT, RewardConfig, active_reward_functions, to_plain
from rlhf_core.config.rollout import RolloutConfig, env_target, response_budget
from rlhf_core.config.rules import validate
from rlhf_core.config.run import RayRoleConfig
from rlhf_core.config.schema import SECRET_FIELDS, Config, register_configs, to_object
from rlhf_core.config.weight_server import LOOPBACK_HOSTS, WeightServerConfig
from rlhf_core.errors import ConfigError

__all__ = ["AlgoConfig", "BufferConfig", "Config", "ConfigError", "DataConfig", "DistillConfig", "ENV_COMPONENT", "EvalConfig", "ISConfig",
           "LOOPBACK_HOSTS", "LearnerConfig", "LoraConfig", "ModelConfig", "RayRoleConfig", "RewardConfig", "RolloutConfig",
           "SECRET_FIELDS", "TeacherConfig", "TinyModelConfig", "VLLM_LORA_RANKS", "WeightServerConfig", "active_reward_functions",
           "check_clip", "check_gamma_lam", "check_penalties", "env_target", "register_configs", "replay_mode", "response_budget",
           "to_object", "to_plain", "validate"]
