"""The plots a run leaves behind: ``reward.png``, ``kl.png``, ``staleness.png`` and
``throughput.png``, from the learner's updates and the buffer's snapshots.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from rlhf_core import metric_names as M

#: the span the live view's (``rlhf-monitor``) and ``throughput.png``'s rates are measured over
#: (the gateway appends a group at once: over one refresh the rate jumps with every group)
RATE_WINDOW_S = 10.0


def time_origin(rows: list[dict[str, Any]], timeline: list[dict[str, Any]]) -> float:
    """The plots' 0 s: the first snapshot of the run, or the start of the learner's first update
    when that is earlier (a resumed run's rows are older than this launch's snapshots)."""
    first_update = rows[0].get(M.TIME, 0.0) - rows[0].get(M.TIME_COMPUTE_S, 0.0) if rows else math.inf
    return min(first_update, timeline[0]["time"] if timeline else math.inf)


def throughput_series(rows: list[dict[str, Any]], timeline: list[dict[str, Any]]) -> dict[str, tuple[list, list]]:
    """The curves of ``throughput.png``, label -> (seconds since :func:`time_origin`, samples/s):
    the buffer's appends and the learner's trained samples over the last :data:`RATE_WINDOW_S` of
    snapshots (both counted as they happen, unlike the workers' tokens and the learner's rate)."""
    t0 = time_origin(rows, timeline)
    snaps = [s for s in timeline if "time" in s]
    counts = {"generated (workers)": [int(s.get("counters", {}).get("samples_appended", 0)) for s in snaps],
              "trained (learner)": [int((s.get("stats") or {}).get(M.LEARNER_STATS, {}).get(M.SAMPLES_TRAINED) or 0)
                                    for s in snaps]}
    series: dict[str, tuple[list, list]] = {}
    for label, n in counts.items():
        ts, rates, j = [], [], 0
        for i in range(1, len(snaps)):
            while snaps[j + 1]["time"] <= snaps[i]["time"] - RATE_WINDOW_S:
                j += 1
            ts.append(snaps[i]["time"] - t0)
            rates.append(max(0, n[i] - n[j]) / max(snaps[i]["time"] - snaps[j]["time"], 1e-9))
        series[label] = (ts, rates)
    return series


def plot(output_dir: Path, rows: list[dict[str, Any]], timeline: list[dict[str, Any]]) -> list[Path]:
    """PNG plots with labelled axes. Returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written: list[Path] = []
    if not rows:
        return written
    t0 = time_origin(rows, timeline)
    wall = [r.get(M.TIME, 0.0) - t0 for r in rows]
    samples = [r.get(M.SAMPLES_TRAINED, 0) for r in rows]
    reward = [r.get(M.REWARD_MEAN, float("nan")) for r in rows]

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    axes[0].plot(wall, reward)
    axes[0].set_xlabel("wall-clock time (s)")
    axes[0].set_ylabel("mean reward of the batch")
    axes[1].plot(samples, reward)
    axes[1].set_xlabel("samples trained")
    axes[1].set_ylabel("mean reward of the batch")
    fig.suptitle("Reward")
    written.append(_save(fig, output_dir / "reward.png"))

    kl_key = next((k for k in M.KL_KEYS if k in rows[-1]), None)
    if kl_key:
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot([r.get(M.VERSION, i) for i, r in enumerate(rows)], [r.get(kl_key, float("nan")) for r in rows])
        ax.set_xlabel("learner version")
        ax.set_ylabel(kl_key)
        ax.set_title("KL")
        written.append(_save(fig, output_dir / "kl.png"))

    hists = [r.get(M.STALENESS_HIST) for r in rows]
    if any(hists):
        width = 1 + max(len(h) for h in hists if h)
        import numpy as np

        grid = np.zeros((width, len(rows)))
        for j, h in enumerate(hists):
            for lag, count in enumerate(h or []):
                grid[lag, j] = count
        fig, ax = plt.subplots(figsize=(7, 3.5))
        im = ax.imshow(grid, aspect="auto", origin="lower", cmap="viridis", interpolation="nearest")
        ax.set_xlabel("learner update")
        ax.set_ylabel("staleness (versions)")
        ax.set_title("Staleness of trained samples over time")
        fig.colorbar(im, ax=ax, label="samples")
        written.append(_save(fig, output_dir / "staleness.png"))

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, (ts, values) in throughput_series(rows, timeline).items():
        ax.plot(ts, values, label=label)
    ax.set_xlabel("wall-clock time (s)")
    ax.set_ylabel(f"samples/s (over the last {RATE_WINDOW_S:.0f} s)")
    ax.set_title("Throughput per stage")
    ax.legend()
    written.append(_save(fig, output_dir / "throughput.png"))
    return written


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
