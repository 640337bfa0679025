"""The share of failed scorings over a window, and when it stops a worker."""

from __future__ import annotations

import pytest

from rollout_workers.rewards import FailureWindow, RewardFailing


def test_failures_now_and_then_stay_under_the_share():
    w = FailureWindow(window=4, max_share=0.5)
    for failed in [True, False, True, False] * 5:  # 2 of every 4: exactly the share, not more
        w.record(failed, "sometimes")
    assert w.failures == 2


def test_more_than_the_share_of_a_full_window_stops_with_the_last_reason():
    w = FailureWindow(window=4, max_share=0.5)
    w.record(True, "early")
    w.record(True, "early")
    w.record(False)  # [T, T, F]: 2 failures, and the window is not full yet
    with pytest.raises(RewardFailing, match=r"3 of the last 4 samples could not be scored .* the last because: late"):
        w.record(True, "late")  # [T, T, F, T]: 3 of 4 > 0.5 * 4


def test_the_window_slides():
    # window 4, share 0.5: [T, T, F, F] holds 2 failures; the next F pushes the oldest T out (1 left)
    w = FailureWindow(window=4, max_share=0.5)
    for failed in [True, True, False, False, False]:
        w.record(failed, "x")
    assert list(w.recent) == [True, False, False, False] and w.failures == 1
    w.record(True, "y")  # [F, F, F, T]
    w.record(True, "y")  # [F, F, T, T]: 2 of 4, not more than half
    with pytest.raises(RewardFailing):
        w.record(True, "z")  # [F, T, T, T]: 3 of 4
