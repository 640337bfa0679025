"""The benchmarks' own arithmetic (bench/*.py are scripts; their pure functions import as modules)."""

from __future__ import annotations

import math
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


def test_vs_trl_summary_without_the_sync_run():
    # --no-sync: rows of TRL and async only. async / trl per seed = 250 / 100, 300 / 200 = 2.5, 1.5 -> median 2.0;
    # no sync figure is made up (the summary has no sync keys at all).
    rows = [_row("trl", 0, 100), _row("async", 0, 250), _row("trl", 1, 200), _row("async", 1, 300)]
    s = vs_trl.summarise(rows)
    assert s["async_over_trl"] == pytest.approx(2.0)
    assert not any(k.startswith("sync") for k in s)


def test_vs_trl_reward_is_compared_with_twice_the_standard_error_over_seeds():
    # last-quarter reward per seed:  seed 0   seed 1   seed 2   mean   sample variance
    #   trl                           0.20     0.24     0.22    0.22   (0.02^2 + 0.02^2 + 0) / 2 = 0.0004
    #   async                         0.18     0.20     0.19    0.19   (0.01^2 + 0.01^2 + 0) / 2 = 0.0001
    #   sync                          0.21     0.23     0.22    0.22   0.0001
    # SE of a difference: sqrt(0.0004 / 3 + 0.0001 / 3) = 0.0129099, twice that 0.0258199.
    # async - trl = -0.03 < -0.0258: lower; sync - trl = 0 >= -0.0258: equal or better.
    rewards = {"trl": (0.20, 0.24, 0.22), "async": (0.18, 0.20, 0.19), "sync": (0.21, 0.23, 0.22)}
    rows = [dict(_row(system, seed, 100.0), reward_last_quarter=r[seed]) for seed in range(3) for system, r in rewards.items()]
    s = vs_trl.summarise(rows)
    margin = 2 * math.sqrt(0.0005 / 3)
    assert s["async_reward_vs_trl"] == pytest.approx({"diff": -0.03, "margin_2se": margin, "equal_or_better": False})
    assert s["sync_reward_vs_trl"] == pytest.approx({"diff": 0.0, "margin_2se": margin, "equal_or_better": True}, abs=1e-12)
    # one seed: a difference, but no standard error and so no verdict
    one = vs_trl.summarise([r for r in rows if r["seed"] == 0])
    assert one["async_reward_vs_trl"] == pytest.approx({"diff": -0.02, "margin_2se": None, "equal_or_better": None})


def test_vs_trl_speed_window_leaves_out_the_first_updates():
    # Six updates of batch 10, ending at (seconds, any origin):
    #   update    1     2     3     4     5     6
    #   ends at  12.0  12.5  13.0  14.0  15.0  16.0      (the first one compiled: 12 s)
    #   trained  10    20    30    40    50    60        (cumulative samples)
    # A warm-up of 3: the window runs from the end of update 3 (13.0) to the end of update 6 (16.0),
    # 3.0 s, holding updates 4, 5, 6: 3 x 10 = 60 - 30 = 30 samples, 30 / 3.0 = 10 samples/s.
    # First to last (warm-up 1) would count updates 2-6 over 16.0 - 12.0 = 4.0 s: 50 / 4.0 = 12.5 samples/s,
    # updates 2 and 3 the fast ones a head start made (0.5 s each).
    times, trained = [12.0, 12.5, 13.0, 14.0, 15.0, 16.0], [10, 20, 30, 40, 50, 60]
    w = vs_trl.steady_window(times, trained, 3)
    assert w == {"warmup_updates": 3, "window_updates": 3, "training_window_s": 3.0, "samples": 30,
                 "trained_samples_per_s": 10.0}
    first = vs_trl.steady_window(times, trained, 1)
    assert (first["window_updates"], first["training_window_s"], first["samples"]) == (5, 4.0, 50)
    assert first["trained_samples_per_s"] == 12.5
    # a short batch counts what it trained: update 6 trained 4 samples (56 in all) -> (56 - 30) / 3.0
    assert vs_trl.steady_window(times, [10, 20, 30, 40, 50, 56], 3)["trained_samples_per_s"] == pytest.approx(26 / 3)
    # no update after the warm-up: no window
    with pytest.raises(ValueError):
        vs_trl.steady_window(times[:3], trained[:3], 3)


def test_vs_trl_refuses_updates_not_larger_than_the_warm_up():
    # every mode's warm-up uses up the async run's head start (its lookahead + 1 = 3 updates)
    assert all(m["warmup_updates"] >= vs_trl.ASYNC_LOOKAHEAD + 1 == 3 for m in vs_trl.MODES.values())
    assert vs_trl.MODES["gpu-check"]["updates"] >= vs_trl.MODES["gpu-check"]["warmup_updates"] + 2
    spec = dict(vs_trl.MODES["gpu"], updates=3)
    with pytest.raises(SystemExit, match="--updates 3: must be larger than this mode's warm-up of 3"):
        vs_trl.check_updates(spec)
    vs_trl.check_updates(dict(spec, updates=4))  # one update in the window: allowed


def test_vs_trl_cpu_window_opens_at_the_end_of_the_warm_up():
    # TRL's steps end at 1, 2, 3, 4, 5 s; CPU seconds sampled every 0.5 s, 0.1 s of CPU per 0.5 s.
    # A warm-up of 2: from the first sample at or after the end of step 2 (t=2.0, cpu 0.4) to the last
    # at or before the end of step 5 (t=5.0, cpu 1.0): 0.6 s of CPU over the steps ending in it after
    # the first (3, 4, 5: 3 updates) -> 200 ms per update.
    samples = [(0.5 * i, 0.1 * i) for i in range(12)]
    assert vs_trl.trl_cpu_per_update(samples, [1.0, 2.0, 3.0, 4.0, 5.0], warmup=2) == pytest.approx(
        {"trl": 200.0, "total": 200.0})


def test_distill_tenths_of_a_runs_metrics():
    import distill

    # 20 updates with reverse KL 20, 19, ..., 1 (one row without it): a tenth is 2 rows;
    # first tenth (20 + 19) / 2 = 19.5, last (2 + 1) / 2 = 1.5, the ratio 1.5 / 19.5 = 0.0769: halved
    rows = [{"distill/reverse_kl": float(20 - i)} for i in range(20)] + [{"reward/mean": 0.1}]
    assert distill.tenth(rows, "distill/reverse_kl", last=False) == 19.5
    assert distill.tenth(rows, "distill/reverse_kl", last=True) == 1.5
    assert distill.tenth(rows, "missing", last=True) is None
    # fewer than 10 rows: a "tenth" is the one row at that end
    assert distill.tenth(rows[:5], "distill/reverse_kl", last=True) == 16.0
