"""Scoring: reward functions (by dotted path, Hydra ``_target_``) and reward models, weighted.

``conf/reward/*.yaml``::

    functions:
      count_up: {_target_: rlhf_core.tasks.count_up_reward, weight: 1.0, target_len: 8}
    models:
      rm: {path: /models/my-rm, weight: 0.5}

A function is called as ``fn(prompt, response_text, response_ids, metadata, **kwargs)`` where
``prompt`` is the prompt text as the model saw it (chat template applied), ``response_ids`` a
list of ints and ``metadata`` the prompt's metadata (e.g. the reference answer); every other key
of its config node is passed as a keyword argument. A ``_target_`` that names a class is
instantiated once with those keyword arguments and the instance is called per sample (for
functions that load something expensive once). It returns a number or a dict of named numbers.

Every value is kept in ``Sample.reward_components``, unweighted: a number as ``<name>``, a dict
entry as ``<name>/<key>``, a reward model as ``<name>``. The reward is the weighted sum
(``weight`` per function or model, default 1; a dict's entries share their function's weight).

A function that raises, returns something that is not a number, or returns NaN/inf, and a
reward model that fails or scores NaN, raise :class:`RewardError` naming the culprit; the
worker dead-letters that one sample with the message and keeps going.
"""

from __future__ import annotations

import inspect
import math
import numbers
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from rlhf_core.config import ConfigError, ModelConfig, RewardConfig, active_reward_functions, import_reward_target
from rlhf_core.errors import FailureWindow, UserError
from rlhf_core.models import load_reward_model

_RESERVED = ("_target_", "weight", "default")


class RewardFailing(UserError):
    """Scoring fails for most samples (a reward function that always raises or returns NaN):
    no batch could ever form, so the worker stops the run with the reward's own error."""


def reward_failing(window: FailureWindow) -> RewardFailing:
    return RewardFailing(
        f"{window.failures} of the last {len(window.recent)} samples could not be scored (more than "
        f"reward.max_failure_share={window.max_share:g}), the last because: {window.last_reason}. Fix the reward "
        "function (reward.functions) or its inputs; no batch can form while it fails"
    )


class RewardError(Exception):
    """A reward could not be computed for one sample (the message names the component)."""


@dataclass
class _RewardFn:
    name: str
    fn: Callable[..., Any]
    weight: float
    kwargs: dict[str, Any]


@dataclass
class _RewardModel:
    name: str
    model: torch.nn.Module
    tokenizer: Any
    weight: float
    max_length: int


def _plain(node: Any) -> Any:
    """A Hydra DictConfig/ListConfig as plain containers (kwargs reach user code as dict/list)."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if isinstance(node, (DictConfig, ListConfig)):
        return OmegaConf.to_container(node, resolve=True)
    return node


def _weight(section: str, name: str, spec: Mapping[str, Any]) -> float:
    value = spec.get("weight", 1.0)
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        raise ConfigError(f"reward.{section}.{name}.weight must be a finite number, got {value!r}")
    return float(value)


def _as_number(label: str, value: Any) -> float:
    """A reward value as a finite float, or RewardError saying what it was."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if not isinstance(value, numbers.Real):  # bool is a Real (1.0/0.0), a string is not
        raise RewardError(f"reward {label!r} returned {value!r} ({type(value).__name__}), not a number")
    value = float(value)
    if not math.isfinite(value):
        raise RewardError(f"reward {label!r} is not finite ({value})")
    return value


class Scorer:
    """Weighted reward functions and reward models (see the module docstring).

    Built once per worker; :meth:`score` runs on the worker's scoring thread, one sample at a
    time. Configuration errors (missing ``_target_``, unimportable path, no reward at all, a
    reward-model directory that is not one) raise :class:`ConfigError` here, before any
    generation starts.
    """

    def __init__(self, cfg: RewardConfig, model_cfg: ModelConfig) -> None:
        self.functions: list[_RewardFn] = []
        self.models: list[_RewardModel] = []
        for name, spec in active_reward_functions(cfg).items():
            if not isinstance(spec, Mapping):
                raise ConfigError(f"reward.functions.{name} must be a mapping with _target_: dotted.path, got {spec!r}")
            target = spec.get("_target_")
            if not target or not isinstance(target, str):
                raise ConfigError(f"reward.functions.{name} needs a _target_: dotted.path.to.function")
            kwargs = {k: v for k, v in spec.items() if k not in _RESERVED}
            obj = import_reward_target(name, target)
            if inspect.isclass(obj):
                try:
                    obj = obj(**kwargs)
                except Exception as exc:
                    raise ConfigError(f"reward.functions.{name}: {target}(**{kwargs}) failed: {type(exc).__name__}: {exc}") from exc
                kwargs = {}
            self.functions.append(_RewardFn(name, obj, _weight("functions", name, spec), kwargs))
        for name, spec in (_plain(cfg.models) or {}).items():
            if spec is None:
                continue
            if not isinstance(spec, Mapping) or not spec.get("path"):
                raise ConfigError(f"reward.models.{name} needs path: a local HF reward-model directory")
            weight = _weight("models", name, spec)
            model, tok = load_reward_model(spec["path"], model_cfg)
            # The score is read at the final token, so an over-long text loses its beginning, never its end.
            tok.truncation_side = "left"
            limit = int(getattr(model.config, "max_position_embeddings", 0) or 0)
            tok_limit = int(getattr(tok, "model_max_length", 0) or 0)
            max_length = min(x for x in (limit, tok_limit, 1 << 30) if x > 0)
            self.models.append(_RewardModel(name, model, tok, weight, max_length))
        if not self.functions and not self.models:
            raise ConfigError("no reward configured: set reward.functions or reward.models (see conf/reward/)")

    @property
    def names(self) -> list[str]:
        return [f.name for f in self.functions] + [m.name for m in self.models]

    def score(self, prompt: str, response_text: str, response_ids: Sequence[int],
              metadata: Mapping[str, Any]) -> tuple[float, dict[str, float]]:
        """Return ``(total reward, {component: value})``. Raises RewardError for this sample."""
        components: dict[str, float] = {}
        total = 0.0
        ids = [int(t) for t in response_ids]
        for rf in self.functions:
            try:
                out = rf.fn(prompt, response_text, list(ids), dict(metadata), **rf.kwargs)
            except Exception as exc:  # a user's function: any failure is this sample's failure
                raise RewardError(f"reward function {rf.name!r} raised {type(exc).__name__}: {exc}") from exc
            if isinstance(out, Mapping):
                if not out:
                    raise RewardError(f"reward function {rf.name!r} returned an empty dict")
                parts = [(f"{rf.name}/{key}", value) for key, value in out.items()]
            else:
                parts = [(rf.name, out)]
            for label, value in parts:
                value = _as_number(label, value)
                components[label] = value
                total += rf.weight * value
        for rm in self.models:
            try:
                value = self._model_reward(rm, prompt + response_text)
            except Exception as exc:
                raise RewardError(f"reward model {rm.name!r} failed: {type(exc).__name__}: {exc}") from exc
            if not math.isfinite(value):
                raise RewardError(f"reward model {rm.name!r} gave a non-finite score ({value})")
            components[rm.name] = value
            total += rm.weight * value
        if not math.isfinite(total):  # finite parts can still overflow when weighted
            raise RewardError(f"the weighted reward is not finite ({total}); components {components}")
        return total, components

    @torch.no_grad()
    def _model_reward(self, rm: _RewardModel, text: str) -> float:
        # One unpadded sequence: the classification head reads the last token's score.
        enc = rm.tokenizer(text, return_tensors="pt", truncation=True, max_length=rm.max_length)
        device = next(rm.model.parameters()).device
        logits = rm.model(**{k: v.to(device) for k, v in enc.items()}).logits
        return float(logits[0, 0])
