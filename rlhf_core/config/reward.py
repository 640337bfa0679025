"""``reward``: the reward functions and models a worker scores with, and how it batches them."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from rlhf_core.choices import EmptyResponse
from rlhf_core.errors import ConfigError
from rlhf_core.metric_names import REWARD_STATS

#: an episode's reward component holding what its environment's steps returned (``rollout.env``)
ENV_COMPONENT = "env"


@dataclass
class RewardConfig:
    # name -> {_target_: dotted.path, weight: float, ...kwargs}; called per sample
    functions: dict[str, Any] = field(default_factory=dict)
    # name -> {path: local HF dir of an AutoModelForSequenceClassification, weight: float}; no
    # function's name (each value is kept under its name in the sample's reward components)
    models: dict[str, Any] = field(default_factory=dict)
    # a worker whose last `failure_window` samples failed to score more often than this share stops
    # the run with the reward's error (single failures are dead-lettered and the run goes on)
    max_failure_share: float = 0.5
    failure_window: int = 64
    # Finished responses are scored in batches of whole groups, up to batch_size samples per call
    # (a larger group is split), sent to a free scoring thread once batch_size samples wait, the
    # oldest has waited max_wait_ms, or generation is idle. batch_size=1 scores one sample per call.
    batch_size: int = 32
    max_wait_ms: float = 10.0
    # Scoring threads: batches scored at once (reward models and HTTP judges release the GIL). The
    # torch intra-op threads of a worker, reward models included, are OMP_NUM_THREADS (rlhf-run
    # gives each child cores // (workers + 1) unless it is set).
    num_threads: int = 1
    # A reward call running longer than this is abandoned: a per-sample function's call on one sample
    # (the clock starts again at each sample), a batched function's or a reward model's on one batch.
    # Its batch's samples are dead-lettered, and a worker whose rewards keep timing out stops
    # (max_failure_share). The call's thread cannot be killed and finishes in the background. null: no limit.
    timeout_s: float | None = 120.0
    # A response with no text (only end-of-sequence, or whitespace): zero = reward 0 without calling
    # the rewards; dead_letter = not trained on (a dead letter, not a reward failure for
    # max_failure_share); score = scored like any other response.
    empty_response: EmptyResponse = EmptyResponse.zero

    def check(self) -> None:
        """Failure window, batching, the time limit, and the rewards' names."""
        if not 0 < self.max_failure_share <= 1 or self.failure_window < 1:
            raise ConfigError(f"reward.max_failure_share must be in (0, 1] (1: never stop) and reward.failure_window >= 1, "
                              f"got {self.max_failure_share}, {self.failure_window}")
        if self.batch_size < 1 or self.num_threads < 1:
            raise ConfigError(f"reward.batch_size and reward.num_threads must be >= 1 (batch_size=1 scores one sample "
                              f"per call), got {self.batch_size}, {self.num_threads}")
        if not (0 <= self.max_wait_ms < math.inf):
            raise ConfigError(f"reward.max_wait_ms must be a number of milliseconds >= 0 (how long finished samples may "
                              f"wait for more to fill a batch), got {self.max_wait_ms}")
        if self.timeout_s is not None and not (0 < self.timeout_s < math.inf):
            raise ConfigError(f"reward.timeout_s must be a number of seconds > 0, or null for no limit, got {self.timeout_s}")
        names = reward_names(self)
        both = sorted(set(active_models(self)) & set(active_reward_functions(self)))
        if both:
            raise ConfigError(f"reward.functions and reward.models both name {', '.join(map(repr, both))}: a sample keeps "
                              "each reward's value under its name (reward_components), so one would hide the other; rename one")
        taken = sorted(names & REWARD_STATS)
        if taken:
            raise ConfigError(f"a reward is named {', '.join(map(repr, taken))}, which the learner's own reward/<stat> "
                              "metrics use (each reward's value is the metric reward/<its name>); rename the reward")


def to_plain(node: Any) -> Any:
    """A Hydra DictConfig/ListConfig as plain containers (kwargs reach user code as dict/list)."""
    if isinstance(node, (DictConfig, ListConfig)):
        return OmegaConf.to_container(node, resolve=True)
    return node


def active_models(reward: Any) -> dict[str, Any]:
    """The reward models a run scores with, ``name -> spec`` (``null`` switches one off)."""
    return {n: s for n, s in (to_plain(reward.models) or {}).items() if s is not None}


def active_reward_functions(reward: Any, drop_defaults: bool = False) -> dict[str, Any]:
    """The reward functions a run scores with, ``name -> spec`` (plain containers).

    A function marked ``default: true`` (the built-in task's, ``conf/reward/count_up.yaml``)
    steps aside as soon as the user configures a reward of their own (another function or a
    reward model): ``+reward.functions.mine._target_=...`` means "score with mine", not "add mine
    to count_up". ``reward.functions.<name>.default=false`` keeps a default in the sum. ``null``
    switches a function off. ``drop_defaults``: they step aside anyway (a run with an environment,
    whose episodes the built-in task's reward does not score).
    """
    functions = {n: s for n, s in (to_plain(reward.functions) or {}).items() if s is not None}
    is_default = {n: isinstance(s, Mapping) and s.get("default") is True for n, s in functions.items()}
    if drop_defaults or active_models(reward) or not all(is_default.values()):
        functions = {n: s for n, s in functions.items() if not is_default[n]}
    return functions


def reward_names(reward: Any) -> set[str]:
    """The names the run's rewards keep their values under (``reward_components``)."""
    return set(active_models(reward)) | set(active_reward_functions(reward))
