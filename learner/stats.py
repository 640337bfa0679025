"""An update's statistics: the per-update metric accumulator, the batch's own statistics,
running statistics (reward normalisation) and the FLOP count.

Both are plain Python floats so that a checkpoint stores them exactly (JSON round-trips a
float bit for bit) and every data-parallel rank, fed the same batch, holds the same values.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from learner.algorithms.core import masked_mean
from rlhf_core import metric_names as M

if TYPE_CHECKING:
    from learner.batch import TrainBatch


class RunningMoments:
    """Mean and variance of everything seen so far (Chan et al.'s parallel merge of batches).

    ``normalize`` uses the statistics *including* the batch being normalised (as OpenRLHF's
    reward normalisation does), so the first batch is already centred.
    """

    def __init__(self) -> None:
        self.count = 0
        self.mean = 0.0
        self.m2 = 0.0  # sum of squared deviations from the mean

    @property
    def var(self) -> float:
        """Unbiased variance (0 with fewer than 2 values)."""
        return self.m2 / (self.count - 1) if self.count > 1 else 0.0

    @property
    def std(self) -> float:
        return math.sqrt(self.var)

    def update(self, x: torch.Tensor) -> None:
        """Merge a batch of values (any shape)."""
        x = x.detach().double().flatten()
        n = int(x.numel())
        if n == 0:
            return
        b_mean = float(x.mean())
        b_m2 = float(((x - b_mean) ** 2).sum())
        total = self.count + n
        delta = b_mean - self.mean
        self.mean += delta * n / total
        self.m2 += b_m2 + delta * delta * self.count * n / total
        self.count = total

    def normalize(self, x: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
        return (x - self.mean) / (self.std + eps)

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count = int(state["count"])
        self.mean = float(state["mean"])
        self.m2 = float(state["m2"])


class MetricSums:
    """Weighted means and maxima gathered over micro-batches, reducible across ranks.

    ``add(key, value, weight)`` accumulates ``value * weight`` and ``weight``; ``result()``
    gives ``sum / weight``. ``add_max`` keeps the maximum, ``add_total`` the sum (a count over
    micro-batches and ranks). ``set`` stores a value as is (e.g. batch statistics every rank
    computed identically).

    Values and weights may be 0-d tensors. One on a GPU is not read when it is recorded: it and
    everything recorded after it wait, in order, until ``reduce`` or ``result`` reads them all
    (one device-to-host copy per device), so recording a micro-batch's statistics never makes
    the host wait for the device inside a training loop. A recorded tensor must not be changed
    in place before then. Floats and CPU tensors are folded in at once, as there is nothing to wait for.
    """

    def __init__(self) -> None:
        self._sum: dict[str, float] = {}
        self._weight: dict[str, float] = {}
        self._max: dict[str, float] = {}
        self._total: dict[str, float] = {}
        self._set: dict[str, float] = {}
        self._pending: list[tuple[str, str, Any, Any]] = []  # (kind, key, value, weight) not read yet

    def add(self, key: str, value: float | torch.Tensor, weight: float | torch.Tensor = 1.0) -> None:
        self._record("add", key, value, weight)

    def add_max(self, key: str, value: float | torch.Tensor) -> None:
        self._record("max", key, value, 1.0)

    def add_total(self, key: str, value: float | torch.Tensor) -> None:
        self._record("total", key, value, 1.0)

    def set(self, key: str, value: float | torch.Tensor) -> None:
        self._record("set", key, value, 1.0)

    def _record(self, kind: str, key: str, value: Any, weight: Any) -> None:
        if self._pending or _on_device(value) or _on_device(weight):
            self._pending.append((kind, key, value, weight))
        else:
            self._fold(kind, key, float(value), float(weight))

    def _fold(self, kind: str, key: str, v: float, w: float) -> None:
        if kind == "add":
            self._sum[key] = self._sum.get(key, 0.0) + v * w
            self._weight[key] = self._weight.get(key, 0.0) + w
        elif kind == "max":
            self._max[key] = max(self._max.get(key, -math.inf), v)
        elif kind == "total":
            self._total[key] = self._total.get(key, 0.0) + v
        else:
            self._set[key] = v

    def _settle(self) -> None:
        """Read the waiting values (one copy per device) and fold them in, in recording order."""
        pending, self._pending = self._pending, []
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for _, _, value, weight in pending:
            for x in (value, weight):
                if _on_device(x):
                    by_device.setdefault(x.device, []).append(x)
        read: dict[int, float] = {}  # id(tensor) -> its value (the tensors live in ``pending``)
        for ts in by_device.values():
            read.update(zip(map(id, ts), torch.cat([t.detach().reshape(1).double() for t in ts]).tolist()))
        for kind, key, value, weight in pending:
            self._fold(kind, key, read[id(value)] if _on_device(value) else float(value),
                       read[id(weight)] if _on_device(weight) else float(weight))

    def reduce(self, all_reduce_sum: Callable[[torch.Tensor], Any], all_reduce_max: Callable[[torch.Tensor], Any]) -> None:
        """Sum the weighted sums, weights and totals, and max the maxima, over data-parallel ranks
        (every rank must have added the same keys, which the same code path guarantees)."""
        self._settle()
        keys, tkeys = sorted(self._sum), sorted(self._total)
        if keys or tkeys:
            t = torch.tensor([self._sum[k] for k in keys] + [self._weight[k] for k in keys]
                             + [self._total[k] for k in tkeys], dtype=torch.float64)
            all_reduce_sum(t)
            for i, k in enumerate(keys):
                self._sum[k], self._weight[k] = float(t[i]), float(t[len(keys) + i])
            for i, k in enumerate(tkeys):
                self._total[k] = float(t[2 * len(keys) + i])
        mkeys = sorted(self._max)
        if mkeys:
            t = torch.tensor([self._max[k] for k in mkeys], dtype=torch.float64)
            all_reduce_max(t)
            for i, k in enumerate(mkeys):
                self._max[k] = float(t[i])

    def result(self) -> dict[str, float]:
        self._settle()
        out = {k: self._sum[k] / self._weight[k] if self._weight[k] else 0.0 for k in self._sum}
        out.update(self._max)
        out.update(self._total)
        out.update(self._set)
        return out


def batch_metrics(batch: TrainBatch, version: int, group_size: int, m: MetricSums) -> None:
    """Statistics of the whole batch (rewards, lengths, staleness against ``version``, groups);
    every rank computes them identically."""
    r = batch.rewards.double()
    m.set(M.REWARD_MEAN, r.mean())
    m.set("reward/std", r.std(unbiased=False))
    m.set("reward/min", r.min())
    m.set("reward/max", r.max())
    for k, vals in sorted(batch.reward_components.items()):
        m.set(f"reward/{k}", sum(vals) / len(vals))
    m.set(M.PROMPT_LEN_MEAN, batch.response_start.double().mean())
    m.set("reward/response_len_mean", batch.response_lengths.double().mean())
    m.set("reward/truncated_frac", batch.truncated.double().mean())
    if batch.turns is not None:  # multi-turn episodes
        m.set("reward/policy_len_mean", batch.policy_lengths.double().mean())
        m.set("learner/policy_token_frac", batch.policy_mask.sum().double() / batch.response_mask.sum().clamp(min=1))
        m.set("reward/turns_mean", batch.turns.mean())
    stale = (version - batch.oldest_version).double()
    m.set("staleness/min", stale.min())
    m.set(M.STALENESS_MEAN, stale.mean())
    m.set(M.STALENESS_MAX, stale.max())
    tok = (version - batch.token_versions).double()
    m.set("staleness/token_mean", masked_mean(tok, batch.policy_mask))
    m.set(M.NUM_SAMPLES, batch.num_rows)
    m.set(M.NUM_TOKENS, batch.policy_mask.sum())
    m.set("learner/num_groups", batch.num_groups)
    m.set("learner/partial_groups", (batch.group_sizes < group_size).sum())


def _on_device(x: Any) -> bool:
    """A tensor whose reading would wait for a device (a GPU's queue)."""
    return isinstance(x, torch.Tensor) and not x.is_cpu


#: Dense bf16 peak TFLOPS by device name: NVIDIA's datasheets, the figure without sparsity (half
#: the "with sparsity" one). The longest key contained in ``torch.cuda.get_device_name()`` wins
#: (case aside), so a variant's own figure beats its family's: "H100 PCIe" before "H100", "L40S"
#: and "L40" before "L4".
PEAK_TFLOPS = {
    "H200": 989.0,  # H200 SXM (GH200's figure too)
    "H200 NVL": 835.0,
    "H100": 989.0,  # H100 SXM ("H100 80GB HBM3")
    "H100 PCIe": 756.0,
    "H100 NVL": 835.0,
    "A100": 312.0,  # SXM and PCIe alike
    "L40S": 362.0,
    "L40": 181.0,
    "L4": 121.0,
    "A10G": 70.0,  # AWS's A10G
    "4090": 165.0,  # GeForce RTX 4090, bf16 with fp32 accumulation
}


def peak_tflops_by_name(name: str) -> float | None:
    """The dense bf16 peak of the GPU ``name`` (``torch.cuda.get_device_name()``) from
    :data:`PEAK_TFLOPS`: the longest key the name contains; None for a GPU not listed."""
    keys = [key for key in PEAK_TFLOPS if key.lower() in name.lower()]
    return PEAK_TFLOPS[max(keys, key=len)] if keys else None


def peak_flops(device: torch.device, override_tflops: float | None) -> float | None:
    """The device's peak in FLOP/s for MFU: ``learner.peak_tflops`` when set, else by GPU name;
    None when unknown (a CPU, an unlisted GPU), and then MFU is not reported."""
    if override_tflops:
        return float(override_tflops) * 1e12
    if device.type != "cuda":
        return None
    tflops = peak_tflops_by_name(torch.cuda.get_device_name(device))
    return None if tflops is None else tflops * 1e12


def flops_metrics(params: int, tokens: float, seconds: float, peak: float | None,
                  trainable: int | None = None) -> dict[str, float]:
    """Training FLOP/s as ``6 * params * tokens / seconds`` (forward 2, backward 4 per parameter
    and token; recomputation passes and attention are not counted) and MFU against ``peak``.
    ``tokens``: those trained, each as often as it was (once per epoch of an update).
    ``trainable`` (default: all ``params``): the parameters that get gradients; frozen ones
    (LoRA's base weights) cost the forward 2 and the backward to the activations 2, not the
    weight gradient 2: ``(4 * params + 2 * trainable) * tokens``.

    E.g. 1e6 params, 1e4 tokens in 0.5 s: 6e10 / 0.5 = 1.2e11 FLOP/s = 0.12 TFLOPS; against a
    1e12 peak, MFU 0.12.
    """
    if seconds <= 0:
        return {}
    trainable = params if trainable is None else trainable
    achieved = (4.0 * params + 2.0 * trainable) * tokens / seconds
    out = {M.TRAIN_TFLOPS: achieved / 1e12}
    if peak:
        out[M.MFU] = achieved / peak
    return out
