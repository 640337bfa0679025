"""The share of failures over a window (rlhf_core.errors.FailureWindow), and the reward's stop."""

from __future__ import annotations

from rlhf_core.errors import FailureWindow
from rollout_workers.rewards import RewardFailing, reward_failing


def test_failures_now_and_then_stay_under_the_share():
    w = FailureWindow(window=4, max_share=0.5)
    trips = [w.record(failed, "sometimes") for failed in [True, False, True, False] * 5]  # 2 of every 4: not more
    assert not any(trips) and w.failures == 2


def test_more_than_the_share_of_a_full_window_trips_and_names_the_last_reason():
    w = FailureWindow(window=4, max_share=0.5)
    assert [w.record(True, "early"), w.record(True, "early"), w.record(False)] == [False] * 3  # window not full
    assert w.record(True, "late")  # [T, T, F, T]: 3 of 4 > 0.5 * 4
    err = reward_failing(w)
    assert isinstance(err, RewardFailing)
    assert "3 of the last 4 samples could not be scored" in str(err) and "the last because: late" in str(err)


def test_the_window_slides():
    # window 4, share 0.5: [T, T, F, F] holds 2 failures; the next F pushes the oldest T out (1 left)
    w = FailureWindow(window=4, max_share=0.5)
    for failed in [True, True, False, False, False]:
        w.record(failed, "x")
    assert list(w.recent) == [True, False, False, False] and w.failures == 1
    assert not w.record(True, "y")  # [F, F, F, T]
    assert not w.record(True, "y")  # [F, F, T, T]: 2 of 4, not more than half
    assert w.record(True, "z")  # [F, T, T, T]: 3 of 4


def test_a_minimum_count_trips_before_the_window_is_full():
    # min_count 2: two failures out of two already say "most fail" in a window of 64
    w = FailureWindow(window=64, max_share=0.5, min_count=2)
    assert not w.record(True) and w.record(True)
