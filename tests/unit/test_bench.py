"""The benchmarks' own arithmetic (bench/*.py are scripts; their pure functions import as modules)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import vs_trl  # noqa: E402


def _row(system: str, seed: int, rate: float) -> dict:
    return {"system": system, "seed": seed, "trained_samples_per_s": rate, "reward_last_quarter": 0.2, "wall_s": 1.0,
            "cpu_ms_per_update": {"total": 10.0}}


def test_vs_trl_ratios_are_taken_per_seed_side_by_side():
    # trained samples/s per seed:   seed 0   seed 1   seed 2
    #   trl                            100      200      300
    #   async                          250      300      700
    #   sync                           120      180      330
    # per seed, async / trl = 2.5, 1.5, 2.333 -> median 2.333; sync / trl = 1.2, 0.9, 1.1 -> median 1.1.
    # The ratio of the medians pairs seeds that did not run side by side: 300 / 200 = 1.5 and 180 / 200 = 0.9.
    rates = {"trl": (100, 200, 300), "async": (250, 300, 700), "sync": (120, 180, 330)}
    rows = [_row(system, seed, r[seed]) for seed in range(3) for system, r in rates.items()]
    s = vs_trl.summarise(rows)
    assert s["async_over_trl_per_seed"] == pytest.approx([2.5, 1.5, 700 / 300])
    assert s["async_over_trl"] == pytest.approx(700 / 300)
    assert s["sync_over_trl_per_seed"] == pytest.approx([1.2, 0.9, 1.1])
    assert s["sync_over_trl"] == pytest.approx(1.1)
    assert s["trl"]["trained_samples_per_s"] == 200  # each system's own median stays
