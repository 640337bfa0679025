"""The user's code a run's config names: reward functions (``reward.functions.<name>._target_``)
and the environment class (``rollout.env._target_``). The user's own config, trusted (never from
the wire). Imported before any model is loaded (by ``rlhf-run`` before anything starts, and by
every worker), so a typo stops the run with one line naming the setting. Light on purpose: the
launcher imports this module without loading torch."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rlhf_core.config import ConfigError, active_reward_functions, env_target


def import_reward_target(name: str, path: str) -> Any:
    """The function or class ``reward.functions.<name>._target_`` names; :class:`ConfigError` when
    it cannot be imported."""
    from hydra.utils import get_method

    try:
        return get_method(path)
    except Exception as exc:  # hydra wraps ImportError/AttributeError in its own types
        raise ConfigError(
            f"reward.functions.{name}._target_={path!r} cannot be imported ({exc}); give the dotted path of a "
            "function in an importable module (on PYTHONPATH or installed)"
        ) from None


def check_reward_targets(reward: Any) -> None:
    """Import every reward function the run will use, so a typo stops ``rlhf-run`` before any
    process starts (the workers would otherwise exit on it one after the other), and run the
    start-up check of those that have one (:func:`check_at_start`)."""
    for name, spec in active_reward_functions(reward).items():
        if isinstance(spec, Mapping) and isinstance(spec.get("_target_"), str):
            check_at_start(import_reward_target(name, spec["_target_"]), spec)


def check_at_start(target: Any, spec: Mapping[str, Any]) -> None:
    """A reward or environment class may say, before any process starts, that the run cannot work
    here: its ``check_at_start(spec)`` (a static method, given its config node) raises
    :class:`ConfigError` with one line (the sandbox cannot start; math-verify is not installed)."""
    check = getattr(target, "check_at_start", None)
    if callable(check):
        check(spec)


def import_env_target(rollout: Any) -> Any | None:
    """The environment class ``rollout.env._target_`` names (None without one), checked: it imports
    and has ``reset`` and ``step`` methods. :class:`ConfigError` naming the path otherwise."""
    import inspect

    from hydra.utils import get_object

    path = env_target(rollout)
    if path is None:
        return None
    try:
        obj = get_object(path)
    except Exception as exc:  # hydra wraps ImportError/AttributeError in its own types
        raise ConfigError(
            f"rollout.env._target_={path!r} cannot be imported ({exc}); give the dotted path of an environment class "
            "in an importable module (on PYTHONPATH or installed), e.g. rollout_workers.envs.calculator.Calculator"
        ) from None
    if not inspect.isclass(obj):
        raise ConfigError(f"rollout.env._target_={path!r} is a {type(obj).__name__}, not a class: name an environment "
                          "class with reset(prompt) and step(turn) methods (one instance is made per episode)")
    missing = [m for m in ("reset", "step") if not callable(getattr(obj, m, None))]
    if missing:
        raise ConfigError(f"rollout.env._target_={path!r}: the class {obj.__name__} has no {' and no '.join(missing)} "
                          "method; an environment needs reset(prompt) -> first observation and step(turn) -> "
                          "StepResult (docs/multi_turn.md)")
    env = rollout.env
    check_at_start(obj, env if isinstance(env, Mapping) else {})
    return obj
