"""Built-in tasks: prompts generated from a seed and their programmatic rewards.

The default task, ``count_up``, is designed so that a random-initialised tiny model visibly
learns it on a CPU in minutes: the prompt is a digit, and the response should count up from it
(``"7:"`` -> ``"890123..."``, wrapping after 9). A random policy over the ~100-token character
vocabulary scores about 0.01; a policy that has learned the successor bigram scores 1.0.
Learning needs the model to condition on the prompt and on its own previous token.

A reward function takes ``(prompt, response_text, response_ids, metadata)`` and returns a float
or a dict of named components whose weighted sum is the reward (see ``conf/reward``).
"""

from __future__ import annotations

import random
from typing import Any, Callable, Iterator, Sequence

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
                    target_len: int = 8) -> dict[str, float]:
    """Fraction of the first ``target_len`` characters that continue the count correctly.

    ``"7:"`` -> ``"8901"`` scores 4/8 = 0.5 (a short answer earns only what it says);
    ``"89x1"`` scores 1/8: counting stops at the first wrong character.
    Components: ``count`` (that score) and ``digits`` (fraction of the first ``target_len``
    characters that are digits, a shaping term that is easy to learn first).
    """
    start = int(metadata.get("start", int(prompt[0]) if prompt[:1].isdigit() else 0))
    text = response_text[:target_len]
    correct = 0
    expected = (start + 1) % 10
    for ch in text:
        if ch != str(expected):
            break
        correct += 1
        expected = (expected + 1) % 10
    digits = sum(ch.isdigit() for ch in text)
    return {"count": correct / target_len, "digits": 0.1 * digits / target_len}


def builtin_prompts(task: str, num_prompts: int, seed: int, epoch: int) -> Iterator[Prompt]:
    try:
        fn = TASKS[task]
    except KeyError:
        from rlhf_core.config import ConfigError

        raise ConfigError(f"data.task={task!r} is not a built-in task; choose one of {sorted(TASKS)}") from None
    return fn(num_prompts=num_prompts, seed=seed, epoch=epoch)
