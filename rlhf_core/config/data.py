"""``data`` (the prompts trained on) and ``eval`` (periodic evaluation on held-out prompts)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from rlhf_core.choices import DataSource
from rlhf_core.errors import ConfigError

#: where a row's prompt is when ``data.text_field`` is the default ``prompt`` and the row has none:
#: GSM8K's ``question`` (with ``answer``), MATH's ``problem`` (with ``solution``)
TEXT_FIELD_FALLBACKS = ("question", "problem")


@dataclass
class DataConfig:
    source: DataSource = DataSource.builtin
    path: str | None = None
    task: str = "count_up"  # builtin task name
    num_prompts: int = 256  # builtin only
    text_field: str = "prompt"  # the default also reads TEXT_FIELD_FALLBACKS when a row has no `prompt`
    messages_field: str | None = "messages"  # chat turns, used when a row has them (null: never)
    # passes over the prompts, each in another shuffled order; the run ends once every prompt of the
    # last one is trained on (or earlier, at learner.max_updates / run.max_seconds)
    epochs: int = 1000
    seed: int = 0

    def check(self, key: str = "data") -> None:
        """A prompt file source needs its path (``data=jsonl`` and the others leave it as ??? for the
        user), at least one epoch and a seed numpy's shuffle takes. ``key``: where it sits."""
        if self.source not in (DataSource.builtin, DataSource.none) and not self.path:
            hint = "data=builtin, the default task" if key == "data" else f"{key}.source=builtin"
            raise ConfigError(f"{key}.source={self.source} needs {key}.path=/path/to/prompts (a local file or folder); "
                              f"or use {hint}")
        if self.epochs < 1:
            raise ConfigError(f"{key}.epochs must be >= 1 (passes over the prompts; the run ends once the last is "
                              f"trained on), got {self.epochs}")
        if self.seed < 0:  # it seeds numpy's shuffle of each epoch (buffer.datasets), which takes no negative seed
            raise ConfigError(f"{key}.seed must be >= 0 (it seeds the shuffle of each epoch), got {self.seed}")


@dataclass
class EvalConfig:
    """Periodic evaluation on held-out prompts (``rlhf-run eval.every=N``): the evaluator samples
    ``n`` responses to each prompt with the policy of version 0 and of every N-th version after,
    scores them with the run's rewards, and reports the mean reward and pass@k."""

    every: int = 0  # learner versions between evaluations (version 0 too); 0 = off
    n: int = 4  # samples per prompt
    k: list[int] = field(default_factory=lambda: [1, 4])  # pass@k for each k (each <= n)
    pass_threshold: float = 1.0  # a sample passes when its reward is >= this
    num_prompts: int | None = 64  # the first N prompts of eval.data (null: all)
    temperature: float | None = None  # null: rollout.temperature
    seed: int = 0  # the evaluator's sampling seed
    # held-out prompts; the built-in task in another order by default (a held-out file: eval.data.source=jsonl
    # eval.data.path=...); loaded like data (same fields)
    data: DataConfig = field(default_factory=lambda: DataConfig(seed=1))

    def check(self) -> None:
        """Cadence, samples and pass@k, and the held-out data (checked only when evaluation is on)."""
        if self.data.source == DataSource.none:
            raise ConfigError(f"eval.data.source='{self.data.source}' is not one of "
                              f"{', '.join(s for s in DataSource if s != DataSource.none)}")
        if self.every < 0:
            raise ConfigError(f"eval.every must be >= 0 learner versions (0: no evaluation), got {self.every}")
        if not self.every:
            return
        if self.n < 1 or not self.k or any(not 1 <= k <= self.n for k in self.k):
            raise ConfigError(f"eval.k={list(self.k)} needs each k between 1 and eval.n={self.n} (pass@k estimates, from n "
                              "samples per prompt, the chance that one of k passes); raise eval.n or drop the larger k")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise ConfigError(f"eval.num_prompts must be >= 1 or null (all of eval.data), got {self.num_prompts}")
        if self.temperature is not None and not 0 < self.temperature < math.inf:
            raise ConfigError(f"eval.temperature must be > 0 and finite (pass@k needs sampling) or null "
                              f"(rollout.temperature), got {self.temperature}")
        self.data.check("eval.data")
