"""The weight server's paced log: one INFO line per recurring event and key every few seconds."""

from __future__ import annotations

import logging

from weight_server.metrics import PacedLog, ServerMetrics


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def info_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]


def test_first_event_at_once_then_one_line_per_interval_saying_what_came_between(caplog):
    clock = Clock()
    paced = PacedLog(logging.getLogger("test_paced"), every_s=10.0, clock=clock)
    caplog.set_level(logging.DEBUG, logger="test_paced")
    for v in range(1, 26):  # a version a second, each taking v ms
        paced.event("policy", v / 1000, "published v%d", v)
        clock.now += 1.0
    # v1 at t=100; v2..v10 within 10 s of it (to DEBUG); v11 at t=110 is the next line: 9 came
    # between (v2..v10), the slowest of them v10's 0.010 s; v21 at t=120 likewise.
    assert info_lines(caplog) == [
        "published v1",
        "published v11 (9 more since the line before, the slowest 0.010 s)",
        "published v21 (9 more since the line before, the slowest 0.020 s)",
    ]
    # The others are at DEBUG.
    assert sum(r.levelno == logging.DEBUG for r in caplog.records) == 25 - 3
    caplog.clear()
    paced.flush()  # v22..v25 since v21: the last (v25) is written, with the 3 between (v22..v24)
    assert info_lines(caplog) == ["published v25 (3 more since the line before, the slowest 0.024 s)"]
    caplog.clear()
    paced.flush()  # nothing held any more
    assert info_lines(caplog) == []


def test_keys_are_paced_separately(caplog):
    clock = Clock()
    paced = PacedLog(logging.getLogger("test_paced"), every_s=10.0, clock=clock)
    caplog.set_level(logging.INFO, logger="test_paced")
    for worker in ("w0", "w1"):
        paced.event(worker, 0.002, "worker %s applied v1", worker)
    clock.now += 1.0
    paced.event("w0", 0.003, "worker %s applied v2", "w0")  # held: w0 had a line a second ago
    assert info_lines(caplog) == ["worker w0 applied v1", "worker w1 applied v1"]
    caplog.clear()
    paced.flush()  # w0's v2 (nothing between it and v1); w1 holds nothing
    assert info_lines(caplog) == ["worker w0 applied v2"]


def test_server_metrics_log_applies_per_worker(caplog):
    metrics = ServerMetrics(log_every_s=3600.0)
    caplog.set_level(logging.INFO, logger="weight_server")
    for v in (1, 2, 3):
        metrics.published("policy", v, 8, 8, 8, 1, 1, False, 0.0, 0.001, 0.0)
        for worker in ("w0", "w1"):
            assert metrics.applied("policy", v, worker, 0.0, now_mono=0.5 * v) == 0.5 * v
    assert metrics.applied("policy", 3, "w0", 0.0, now_mono=9.0) is None  # a repeated report: not counted
    lines = info_lines(caplog)
    assert lines == ["worker w0 applied policy v1 0.500 s after publish began",
                     "worker w1 applied policy v1 0.500 s after publish began"]
    caplog.clear()
    metrics.log.flush()
    assert info_lines(caplog) == [
        f"worker {w} applied policy v3 1.500 s after publish began (1 more since the line before, the slowest 1.000 s)"
        for w in ("w0", "w1")
    ]
