"""Built-in tasks: prompts generated from a seed and their programmatic rewards.

The default task, ``count_up``, is designed so that a random-initialised tiny model visibly
learns it on a CPU in minutes: the prompt is a digit, and the response should count up from it
(``"7:"`` -> ``"890123..."``, wrapping after 9). A random policy scores about 0.01; a policy
that has learned the successor bigram conditioned on the prompt scores 1.0.

A reward function takes ``(prompt, response_text, response_ids, metadata)`` and returns a float
or a dict of named components whose weighted sum is the reward (see ``conf/reward``).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from rlhf_core.records import Prompt

TASKS: dict[str, Callable[..., Iterator[Prompt]]] = {}


def _task(fn: Callable[..., Iterator[Prompt]]) -> Callable[..., Iterator[Prompt]]:
    TASKS[fn.__name__.removesuffix("_prompts")] = fn
    return fn


@_task
def count_up_prompts(num_prompts: int, seed: int, epoch: int) -> Iterator[Prompt]:
    """``num_prompts`` prompts of the form ``"<d>:"``, shuffled per epoch."""
    rng = random.Random(seed * 1_000_003 + epoch)
    order = list(range(num_prompts))
    rng.shuffle(order)
    for i in order:
        start = (seed + i) % 10
        yield Prompt(prompt_id=f"count_up-{i}", text=f"{start}:", metadata={"start": start}, epoch=epoch, index=i)


def count_up_reward(prompt: str, response_text: str, response_ids: Sequence[int], metadata: dict[str, Any],
                    target_len: int = 6) -> float:
    """Fraction of the first ``target_len`` positions that hold the right digit of the count:
    position i should hold ``(start + 1 + i) % 10`` (``"7:"`` -> ``"8901"`` scores 4/6). Per-position
    credit is a dense signal, and anchored to the prompt (``"898989..."`` earns little)."""
    start = int(metadata.get("start", int(prompt[0]) if prompt[:1].isdigit() else 0))
    text = response_text[:target_len]
    correct = sum(ch == str((start + 1 + i) % 10) for i, ch in enumerate(text))
    return correct / target_len


def builtin_prompts(data: Any, epoch: int) -> Iterator[Prompt]:
    """The prompts of epoch ``epoch`` of the built-in task that ``data`` (a DataConfig) names."""
    try:
        fn = TASKS[data.task]
    except KeyError:
        from rlhf_core.config import ConfigError

        raise ConfigError(f"data.task={data.task!r} is not a built-in task; choose one of {sorted(TASKS)}") from None
    return fn(num_prompts=data.num_prompts, seed=data.seed, epoch=epoch)
