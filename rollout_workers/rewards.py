"""Scoring: reward functions (by dotted path, Hydra ``_target_``) and reward models, weighted.

``conf/reward/*.yaml``::

    functions:
      count_up: {_target_: rlhf_core.tasks.count_up_reward, weight: 1.0, target_len: 8}
      sim: {_target_: my_pkg.similarity}          # TRL-style: (prompts, completions, **columns)
    models:
      rm: {path: /models/my-rm, weight: 0.5}

The two signatures (per sample, and TRL's batched one, told apart by the parameter names unless
``batched: true|false`` says), how TRL's arguments are built, ``async def`` rewards and empty
responses are described in docs/rewards.md. Every other key of a function's node is passed as a
keyword argument (it wins over a data column of the same name); a ``_target_`` that names a class
is instantiated once with them and the instance is called.

Every value is kept in ``Sample.reward_components``, unweighted: a number as ``<name>``, a dict
entry as ``<name>/<key>``, a reward model as ``<name>``. The reward is the weighted sum (``weight``
per function or model, default 1; a dict's entries share their function's weight). A value is any
real number a library gives (:func:`as_number`); a reward that raises, returns anything else,
NaN/inf or (batched) a list of the wrong length makes :class:`RewardError` for the samples
concerned, which the worker dead-letters.
"""

from __future__ import annotations

import contextlib
import decimal
import inspect
import math
import numbers
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from rlhf_core.config import ConfigError, ModelConfig, RewardConfig, active_reward_functions, to_plain
from rlhf_core.errors import FailureWindow, UserError
from rlhf_core.models import load_reward_model
from rlhf_core.records import Prompt
from rollout_workers.user_code import import_reward_target
from rollout_workers.user_loop import UserLoop

_RESERVED = ("_target_", "weight", "default", "batched")
_BATCH_ARGS = ("prompts", "completions", "completion_ids")
_SECRET_WORDS = ("key", "secret", "token", "password")


class RewardFailing(UserError):
    """Scoring fails for most samples: no batch could ever form, so the worker stops the run."""


def reward_failing(window: FailureWindow) -> RewardFailing:
    return RewardFailing(
        f"{window.failures} of the last {len(window.recent)} samples could not be scored (more than "
        f"reward.max_failure_share={window.max_share:g}), the last because: {window.last_reason}. Fix the reward "
        "function (reward.functions) or its inputs; no batch can form while it fails"
    )


class RewardError(Exception):
    """A reward could not be computed for one sample (the message names the component)."""


#: the dead-letter reason of an empty response under reward.empty_response=dead_letter: the user's
#: choice, not a failing reward (the worker does not count it towards reward.max_failure_share)
EMPTY_DEAD_LETTER = ("empty response (only end-of-sequence or whitespace): dead-lettered by "
                     "reward.empty_response=dead_letter (zero scores it 0, score calls the rewards)")


@dataclass
class ScoreItem:
    """One finished response to score."""

    prompt: str  # as the policy saw it (chat template applied)
    response_text: str  # decoded without special tokens
    response_ids: Sequence[int]
    metadata: Mapping[str, Any] = field(default_factory=dict)  # the prompt's data columns
    # the prompt's chat turns when it came as turns (None: it came as text); a reward model renders
    # them through its own template, a batched function gets them as TRL's conversational prompt
    messages: list[dict[str, str]] | None = None
    # a multi-turn episode as messages (prompt, assistant turns, observations); a reward model renders it whole
    conversation: list[dict[str, Any]] | None = None
    raw_prompt: str | None = None  # the prompt's own text, before any chat template (None: ``prompt``)

    @classmethod
    def of(cls, prompt: Prompt, rendered: str, response_text: str, response_ids: Sequence[int]) -> ScoreItem:
        """A response to ``prompt``, which the policy saw as ``rendered``."""
        return cls(rendered, response_text, list(response_ids), prompt.metadata, prompt.messages or None,
                   raw_prompt=prompt.text)

    @property
    def turns(self) -> list[dict[str, str]]:
        """The prompt as chat turns: its own, or its text as the one user turn."""
        return list(self.messages or [{"role": "user", "content": self.prompt if self.raw_prompt is None else self.raw_prompt}])

    def trl_prompt(self) -> str | list[dict[str, str]]:
        """What TRL passes a batched reward as this prompt: its turns, or its raw text."""
        return self.turns if self.messages else (self.prompt if self.raw_prompt is None else self.raw_prompt)

    def trl_completion(self) -> str | list[dict[str, str]]:
        """What TRL passes a batched reward as this response: one assistant turn after a chat prompt, else the text."""
        return [{"role": "assistant", "content": self.response_text}] if self.messages else self.response_text


def is_empty_response(text: str) -> bool:
    """Nothing but end-of-sequence (decoded to ``''``) or whitespace."""
    return not text.strip()


class CallWatch:
    """What one scoring thread is calling now (read by the timeout watchdog on another thread)
    and how many reward calls it made."""

    def __init__(self) -> None:
        self.current: tuple[str, float] | None = None  # (what, monotonic start); one assignment, read whole
        self.calls = 0

    def begin(self, what: str) -> None:
        self.calls += 1
        self.current = (what, time.monotonic())

    def end(self) -> None:
        self.current = None


@contextlib.contextmanager
def _user_code(failed: str) -> Iterator[None]:
    """Runs a user's reward (or reads what it returned): anything the block raises but
    ``KeyboardInterrupt`` becomes a RewardError ``"<failed> <exception>"`` for the samples concerned
    (``asyncio.CancelledError`` and ``SystemExit`` too: they must not end the worker's thread)."""
    try:
        yield
    except KeyboardInterrupt:
        raise
    except BaseException as exc:
        raise RewardError(f"{failed} {_describe(exc)}") from None


_LOOP = UserLoop("reward-asyncio")  # where async rewards run, one loop for every call (as TRL's GRPOTrainer)


def _awaited(value: Any) -> Any:
    """``value``, or what it resolves to when it is awaitable, awaited on the rewards' one event loop
    (a client a reward keeps stays on its loop)."""
    return _LOOP.submit(value).result() if inspect.isawaitable(value) else value


def _describe(exc: BaseException) -> str:
    """``Type: message`` (the type alone without a message), even if the message itself raises."""
    try:
        text = str(exc)
    except Exception:  # noqa: BLE001 - a broken __str__ must not hide the failure it describes
        text = "(its message cannot be shown)"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def as_number(label: str, value: Any) -> float:
    """A reward value as a finite float, or RewardError naming what it was."""
    try:
        return _as_number(label, value)
    except (KeyboardInterrupt, RewardError):
        raise
    except BaseException as exc:  # a value whose float() or item() raises
        raise RewardError(f"reading the value of reward {label!r} ({type(value).__name__}) raised {_describe(exc)}") from None


def _as_number(label: str, value: Any) -> float:
    if isinstance(value, (torch.Tensor, np.ndarray, np.generic)):
        kind = f"{type(value).__module__.split('.')[0]}.{type(value).__name__}"  # numpy.float32, torch.Tensor
        if not isinstance(value, np.generic):
            kind += f" of {value.dtype}"
        if value.dtype == (torch.bool if isinstance(value, torch.Tensor) else np.bool_):
            raise RewardError(f"reward {label!r} returned {_show(value)} ({kind}), not a number: booleans are not "
                              "rewards (return 1.0 / 0.0 if that is what you mean)")
        size = value.numel() if isinstance(value, torch.Tensor) else value.size
        if size != 1:
            raise RewardError(f"reward {label!r} returned a {kind} of shape {tuple(value.shape)}, not one number")
        value = value.item()
    if isinstance(value, bool):
        raise RewardError(f"reward {label!r} returned {value!r} (bool), not a number: booleans are not rewards "
                          "(return 1.0 / 0.0 if that is what you mean)")
    if not isinstance(value, (numbers.Real, decimal.Decimal)):
        raise RewardError(f"reward {label!r} returned {_show(value)} ({type(value).__name__}), not a number")
    try:
        value = float(value)
    except (ValueError, OverflowError):  # Decimal('sNaN')
        value = float("nan")
    if not math.isfinite(value):
        raise RewardError(f"reward {label!r} is not finite ({value})")
    return value


def _show(value: Any) -> str:
    try:
        text = repr(value)
    except Exception as exc:  # noqa: BLE001 - the message must not fail where the value did
        text = f"<a {type(value).__name__} whose repr raised {type(exc).__name__}>"
    return text if len(text) <= 80 else text[:77] + "..."


class _PerSampleFn:
    def __init__(self, name: str, fn: Callable[..., Any], weight: float, kwargs: dict[str, Any]) -> None:
        self.name, self.fn, self.weight, self.kwargs = name, fn, weight, kwargs

    def run(self, items: list[ScoreItem], watch: CallWatch) -> list[list[tuple[str, Any]] | RewardError]:
        out: list[list[tuple[str, Any]] | RewardError] = []
        for it in items:
            watch.begin(f"reward function {self.name!r}")
            try:
                with _user_code(f"reward function {self.name!r} raised"):  # any failure is this sample's
                    value = _awaited(self.fn(it.prompt, it.response_text, [int(t) for t in it.response_ids],
                                             dict(it.metadata), **self.kwargs))
                    parts = ([(f"{self.name}/{k}", v) for k, v in value.items()] if isinstance(value, Mapping)
                             else [(self.name, value)])
                out.append(parts or RewardError(f"reward function {self.name!r} returned an empty dict"))
            except RewardError as exc:
                out.append(exc)
            finally:
                watch.end()
        return out


class _BatchedFn:
    """TRL's reward-function signature: one call per batch, data columns as keyword lists."""

    def __init__(self, name: str, fn: Callable[..., Any], weight: float, kwargs: dict[str, Any]) -> None:
        self.name, self.fn, self.weight, self.kwargs = name, fn, weight, kwargs
        params: Mapping[str, inspect.Parameter]
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):  # a builtin or C callable: pass everything
            params = {}
        self.takes_all = not params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        self.names = set(params)
        # the columns it cannot go without get None for each completion even when no prompt has them
        keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        self.required = [k for k, p in params.items() if p.kind in keyword and p.default is p.empty and k not in _BATCH_ARGS]

    def run(self, items: list[ScoreItem], watch: CallWatch) -> list[list[tuple[str, Any]] | RewardError]:
        n = len(items)
        columns = dict.fromkeys([*self.required, *(k for it in items for k in it.metadata)])
        args: dict[str, Any] = {key: [it.metadata.get(key) for it in items] for key in columns if key not in _BATCH_ARGS}
        args.update(prompts=[it.trl_prompt() for it in items], completions=[it.trl_completion() for it in items],
                    completion_ids=[[int(t) for t in it.response_ids] for it in items])
        args.update(self.kwargs)
        if not self.takes_all:  # pass only what the function names, so it need not take **kwargs
            args = {k: v for k, v in args.items() if k in self.names}
        watch.begin(f"reward function {self.name!r}")
        try:
            with _user_code(f"reward function {self.name!r} raised"):
                result = _awaited(self.fn(**args))
        except RewardError as exc:
            return [exc] * n
        finally:
            watch.end()
        if isinstance(result, (torch.Tensor, np.ndarray)) and result.ndim == 1:
            result = list(result)
        if not isinstance(result, (list, tuple)):
            return [RewardError(f"reward function {self.name!r} (batched: prompts, completions, ...) returned "
                                f"{_show(result)} ({type(result).__name__}); it must return a list with one number per "
                                f"completion ({n} here)")] * n
        if len(result) != n:
            return [RewardError(f"reward function {self.name!r} returned {len(result)} value(s) for {n} "
                                "completion(s); a batched reward returns exactly one number per completion")] * n
        return [RewardError(f"reward function {self.name!r} failed for this completion: {_describe(v)}")
                if isinstance(v, BaseException) else [] if v is None else [(self.name, v)] for v in result]


class _RewardModel:
    """An AutoModelForSequenceClassification with one label, scored a batch per forward pass."""

    def __init__(self, name: str, spec: Mapping[str, Any], model_cfg: ModelConfig) -> None:
        self.name, self.weight = name, _weight("models", name, spec)
        self.model, self.tokenizer = load_reward_model(spec["path"], model_cfg)
        if spec.get("device"):  # a reward model on a device of its own
            try:
                # transformers wraps PreTrainedModel.to with functools.wraps, which mypy does not bind to self
                self.model.to(torch.device(spec["device"]))  # type: ignore[arg-type]
            except (RuntimeError, TypeError, AssertionError) as exc:
                raise ConfigError(f"reward.models.{name}.device={spec['device']!r} cannot hold the model ({exc}); give "
                                  "cpu, cuda or cuda:<index> of a GPU this worker sees") from None
        self.device = next(self.model.parameters()).device
        # The score is read at the final token, so an over-long text loses its beginning, never its end.
        self.tokenizer.truncation_side = "left"
        self.tokenizer.padding_side = "right"
        limit = int(getattr(self.model.config, "max_position_embeddings", 0) or 0)
        tok_limit = int(getattr(self.tokenizer, "model_max_length", 0) or 0)
        self.max_length = min(x for x in (limit, tok_limit, 1 << 30) if x > 0)
        self.chat_template = bool(getattr(self.tokenizer, "chat_template", None))
        # A fast tokenizer cannot be called from two threads at once; the forward passes run side by side.
        self._tokenizer_lock = threading.Lock()

    def text(self, it: ScoreItem) -> str:
        if not self.chat_template:
            return it.prompt + it.response_text
        if it.conversation:  # an episode: the whole conversation, through the reward model's template
            return self.tokenizer.apply_chat_template(list(it.conversation), tokenize=False)
        # the reward model's own template over [user turns, assistant: response]
        return self.tokenizer.apply_chat_template(it.turns + [{"role": "assistant", "content": it.response_text}],
                                                  tokenize=False)

    @torch.no_grad()
    def run(self, items: list[ScoreItem], watch: CallWatch) -> list[list[tuple[str, Any]] | RewardError]:
        watch.begin(f"reward model {self.name!r}")
        try:
            with _user_code(f"reward model {self.name!r} failed:"):  # its template and forward can be anyone's code
                with self._tokenizer_lock:
                    enc = self.tokenizer([self.text(it) for it in items], return_tensors="pt", padding=True,
                                         truncation=True, max_length=self.max_length,
                                         add_special_tokens=not self.chat_template)
                # the classification head reads each row's last non-padding token
                scores = self.model(**{k: v.to(self.device) for k, v in enc.items()}).logits[:, 0].float().cpu().tolist()
        except RewardError as exc:
            return [exc] * len(items)
        finally:
            watch.end()
        return [RewardError(f"reward model {self.name!r} gave a non-finite score ({s})") if not math.isfinite(s)
                else [(self.name, s)] for s in scores]


def _weight(section: str, name: str, spec: Mapping[str, Any]) -> float:
    value = spec.get("weight", 1.0)
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        raise ConfigError(f"reward.{section}.{name}.weight must be a finite number, got {value!r}")
    return float(value)


def _redacted(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """Keyword arguments fit for an error message: secrets (an API key) shown as ***."""
    return {k: "***" if any(w in k.lower() for w in _SECRET_WORDS) and v else v for k, v in kwargs.items()}


def is_batched(name: str, fn: Callable[..., Any], declared: Any = None) -> bool:
    """TRL-style when ``batched: true`` is declared, or the signature names ``prompts``,
    ``completions`` or ``completion_ids``."""
    if declared is not None:
        if not isinstance(declared, bool):
            raise ConfigError(f"reward.functions.{name}.batched must be true or false (or left out: then a function "
                              f"with a `prompts`, `completions` or `completion_ids` parameter is batched), got {declared!r}")
        return declared
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return any(arg in params for arg in _BATCH_ARGS)


class Scorer:
    """Weighted reward functions and reward models (see the module docstring). Built once per
    worker, so configuration errors raise :class:`ConfigError` before any generation starts;
    :meth:`score_batch` runs on the worker's scoring threads, several at once when
    ``reward.num_threads`` > 1."""

    def __init__(self, cfg: RewardConfig, model_cfg: ModelConfig, environment: bool = False) -> None:
        self.empty_response = cfg.empty_response
        self.functions: list[_PerSampleFn | _BatchedFn] = []
        self.models: list[_RewardModel] = []
        # environment: episodes get the environment's reward (the built-in task's default reward steps aside)
        for name, spec in active_reward_functions(cfg, drop_defaults=environment).items():
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
                    raise ConfigError(f"reward.functions.{name}: {target}(**{_redacted(kwargs)}) failed: "
                                      f"{type(exc).__name__}: {exc}") from exc
                kwargs = {}
            kind = _BatchedFn if is_batched(name, obj, spec.get("batched")) else _PerSampleFn
            self.functions.append(kind(name, obj, _weight("functions", name, spec), kwargs))
        for name, spec in (to_plain(cfg.models) or {}).items():
            if spec is None:
                continue
            if not isinstance(spec, Mapping) or not spec.get("path"):
                raise ConfigError(f"reward.models.{name} needs path: a local HF reward-model directory")
            self.models.append(_RewardModel(name, spec, model_cfg))
        if not self.functions and not self.models and not environment:
            raise ConfigError("no reward configured: set reward.functions or reward.models (see conf/reward/)")

    @property
    def names(self) -> list[str]:
        return [f.name for f in self.functions] + [m.name for m in self.models]

    def describe(self) -> str:
        """For the worker's start-up line: each reward and how it is called."""
        kinds = [f"{f.name} ({'batched' if isinstance(f, _BatchedFn) else 'per sample'})" for f in self.functions]
        return ", ".join(kinds + [f"{m.name} (reward model on {m.device})" for m in self.models])

    def counters(self) -> dict[str, int]:
        """``{"<reward>/<reason>": count}`` of the rewards that count why they scored what they did
        (a ``counters()`` method: :mod:`rollout_workers.reward_tools`), for the heartbeat."""
        out: dict[str, int] = {}
        for f in self.functions:
            count = getattr(f.fn, "counters", None)
            if callable(count):
                out.update({f"{f.name}/{reason}": n for reason, n in count().items()})
        return out

    def score_batch(self, items: Sequence[ScoreItem], watch: CallWatch | None = None
                    ) -> list[tuple[float, dict[str, float]] | RewardError]:
        """Per item ``(total reward, {component: value})`` or the RewardError that fails it.
        ``watch`` is told which reward is being called (the worker's timeout watchdog reads it)."""
        watch = watch or CallWatch()
        scores: list[dict[str, float]] = [{} for _ in items]
        errors: dict[int, RewardError] = {}  # item -> why it has no reward
        todo: list[int] = []
        for i, it in enumerate(items):
            if not is_empty_response(it.response_text) or self.empty_response == "score":
                todo.append(i)
            elif self.empty_response == "dead_letter":
                errors[i] = RewardError(EMPTY_DEAD_LETTER)
        totals = [0.0] * len(items)
        called = list(todo)
        for component in [*self.functions, *self.models]:
            todo = [i for i in todo if i not in errors]
            if not todo:
                break
            for i, parts in zip(todo, component.run([items[i] for i in todo], watch)):
                try:
                    if isinstance(parts, RewardError):
                        raise parts
                    for label, value in parts:
                        value = as_number(label, value)
                        scores[i][label] = value
                        totals[i] += component.weight * value
                except RewardError as exc:
                    errors[i] = exc
        for i in called:
            if i not in errors and not scores[i]:  # every function returned None for it, and there is no model
                errors[i] = RewardError("no reward applies to this sample: every reward function returned None for it "
                                        "(TRL's 'does not apply') and no reward model is configured")
        out: list[tuple[float, dict[str, float]] | RewardError] = []
        for i, (total, scored) in enumerate(zip(totals, scores)):
            if i not in errors and not math.isfinite(total):  # finite parts can overflow when weighted
                errors[i] = RewardError(f"the weighted reward is not finite ({total}); components {scored}")
            out.append(errors[i] if i in errors else (total, scored))
        return out

    def score(self, prompt: str, response_text: str, response_ids: Sequence[int],
              metadata: Mapping[str, Any]) -> tuple[float, dict[str, float]]:
        """One sample: ``(total reward, {component: value})``. Raises RewardError for it."""
        (result,) = self.score_batch([ScoreItem(prompt, response_text, list(response_ids), metadata)])
        if isinstance(result, RewardError):
            raise result
        return result
