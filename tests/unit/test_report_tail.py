"""The live line reads the learner's metrics file incrementally: each poll parses only what was
appended (a long run's file grows to tens of MB, and re-reading it every second once took 1.7 s)."""

from __future__ import annotations

import json

from rlhf_run.report import MetricsTail


def test_each_poll_reads_only_the_appended_bytes_and_waits_for_whole_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tail = MetricsTail(path)
    assert tail.poll() == {}  # no file yet
    rows = [json.dumps({"version": v, "reward": v / 10}) + "\n" for v in range(1, 4)]
    path.write_text("".join(rows))
    assert tail.poll() == {"version": 3, "reward": 0.3}
    assert tail.offset == path.stat().st_size
    with path.open("a") as f:
        f.write('{"version": 4, "rew')  # a line the learner is still writing
    assert tail.poll() == {"version": 3, "reward": 0.3}
    with path.open("a") as f:
        f.write('ard": 0.4}\n')
    assert tail.poll() == {"version": 4, "reward": 0.4}
    before = tail.offset
    assert tail.poll() == {"version": 4, "reward": 0.4} and tail.offset == before  # nothing new: nothing read
