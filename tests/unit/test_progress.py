"""The live view's files: timeline.jsonl thinned as a run goes on (and the summary read from it), the
learner's metrics file read incrementally (a long run's grows to tens of MB, and re-reading it every
second once took 1.7 s), the eta. No Redis, fake times."""

from __future__ import annotations

import json
import math

import pytest

from rlhf_core.config import Config
from rlhf_run.progress import MetricsTail, Timeline, read_timeline
from rlhf_run.summary import summarize


def _snap(t: float, **fields) -> dict:
    return {"time": t, **fields}


def test_a_snapshot_is_written_once_max_1s_and_a_thousandth_of_the_elapsed_time_passed(tmp_path):
    path = tmp_path / "timeline.jsonl"
    tl = Timeline(path, started=1000.0)
    # the first second: every snapshot once a second (the sampler's period); 0.4 s after one, not yet
    assert [tl.add(_snap(1000.0 + t)) for t in (0.0, 1.0, 1.4, 2.0, 3.0)] == [True, True, False, True, True]
    # 5,000 s in, a thousandth of the elapsed time is 5 s: the snapshots of the 4 s between are held
    assert tl.add(_snap(6000.0))
    assert [tl.add(_snap(6000.0 + t)) for t in (1.0, 2.0, 3.0, 4.0, 5.0)] == [False, False, False, False, True]
    # the newest held one is written at close (the run's end is in the file)
    assert not tl.add(_snap(6006.0))
    tl.close()
    times = [json.loads(line)["time"] for line in path.read_text().splitlines()]
    assert times == [1000.0, 1001.0, 1002.0, 1003.0, 6000.0, 6005.0, 6006.0]


def test_a_day_long_run_writes_about_5500_lines(tmp_path):
    path = tmp_path / "timeline.jsonl"
    tl = Timeline(path, started=0.0)
    day = 86_400
    for t in range(day + 1):
        tl.add(_snap(float(t)))
    tl.close()
    lines = path.read_text().splitlines()
    expected = 1000 * (1 + math.log(day / 1000))  # 5,459 (the spacing rounded to the sampler's seconds: 5,536)
    assert abs(len(lines) - expected) < 0.02 * expected, len(lines)
    assert json.loads(lines[-1])["time"] == day  # the last snapshot, held back, written at close
    # a resumed run appends to the same file
    resumed = Timeline(path, started=day + 100.0)
    resumed.add(_snap(day + 100.0))
    resumed.close()
    assert len(path.read_text().splitlines()) == len(lines) + 1


def test_the_reader_keeps_an_evenly_thinned_bounded_list_with_the_first_and_the_last(tmp_path):
    path = tmp_path / "timeline.jsonl"
    path.write_text("".join(json.dumps(_snap(float(i))) + "\n" for i in range(10_002)) + '{"time": 10002.0, "cut')
    rows = read_timeline(path, max_points=1000)
    times = [r["time"] for r in rows]
    # the first, every 16th line (10,003 lines: 1,000 at most at every 8th would be 1,251), and the
    # last whole one (a crash cut the very last)
    assert times == [16.0 * i for i in range(626)] + [10_001.0]
    # a short file: every line, once
    path.write_text("".join(json.dumps(_snap(float(i))) + "\n" for i in range(3)) + '{"time": 3.0, "cut')
    assert [r["time"] for r in read_timeline(path)] == [0.0, 1.0, 2.0]
    assert read_timeline(tmp_path / "none.jsonl") == []


def _synthetic_run(seconds: int) -> list[dict]:
    """One snapshot a second of a run: 40 s of start-up, then 120 samples/s appended and workers'
    tokens at 9,000/s, until 300 s of final checkpoint and drain with no append; a version every
    0.7 s, whose publish -> applied latency drifts from 20 ms to 80 ms over the run."""
    end_appends = seconds - 300
    snaps = []
    for t in range(seconds + 1):
        busy = min(max(0, t - 40), end_appends - 40)
        version = int(t / 0.7)
        snaps.append({
            "time": 1_700_000_000.0 + t,
            "counters": {"samples_appended": 120 * busy, "samples_dropped_stale": busy // 100},
            "consumers": {"worker-0": {"age_s": 0.5, "stats": {"tokens": 9000 * busy, "tokens_per_s": 9000.0}}},
            "stats": {"weight_server": {"version": version, "sync_latency_s": 0.020 + 0.060 * t / seconds}},
        })
    return snaps


def test_the_summary_of_a_thinned_timeline_matches_the_full_ones(tmp_path):
    full = _synthetic_run(20_000)
    path = tmp_path / "timeline.jsonl"
    tl = Timeline(path, started=full[0]["time"])
    for snap in full:
        tl.add(snap)
    tl.close()
    thinned = read_timeline(path)
    assert len(thinned) <= 1001 and len(path.read_text().splitlines()) < 4100  # 1,000 (1 + ln 20) = 3,996
    rows = [{"learner/updates": i, "learner/samples_trained": 64 * i, "time": full[0]["time"] + 50 + i} for i in range(1, 100)]
    a = summarize(Config(), rows, full, wall_s=20_000.0, exit_reason="done")
    b = summarize(Config(), rows, thinned, wall_s=20_000.0, exit_reason="done")
    # the last snapshot's counts exactly
    assert (b["samples_generated"], b["samples_dropped_stale"]) == (a["samples_generated"], a["samples_dropped_stale"])
    assert b["buffer_counters"] == a["buffer_counters"]
    # rates from cumulative counters: 120 samples/s either way (the drain's 300 s, between lines
    # 160 s apart once thinned, left out)
    ta, tb = a["throughput"], b["throughput"]
    assert ta["generated_samples_per_s"] == tb["generated_samples_per_s"] == 120.0
    # publish -> applied over the versions: 50 ms, the mean of the drift, from both
    assert abs(ta["weight_sync_latency_s"] - 0.050) < 0.0005
    assert abs(tb["weight_sync_latency_s"] - ta["weight_sync_latency_s"]) < 0.0005
    assert tb["generated_tokens_per_s"] == ta["generated_tokens_per_s"] == 9000.0


def test_a_timeline_the_disk_cannot_hold_stops_with_one_line_naming_it(tmp_path):
    # /dev/full answers every write with ENOSPC, as a full disk does: the launcher's sampling thread
    # logged a traceback once and went on without its timeline, and its close at the run's end failed
    # again; now the error names the file and the room left, and the launcher ends the run with it
    from rlhf_core.errors import UserError

    path = tmp_path / "timeline.jsonl"
    path.symlink_to("/dev/full")
    tl = Timeline(path, started=0.0)
    with pytest.raises(UserError) as err:
        tl.add(_snap(0.0))
    assert str(err.value).startswith(f"cannot write {path} (No space left on device); ")
    assert " MiB free on its disk: " in str(err.value)


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


def test_the_eta_counts_from_the_first_update_seen_and_respects_the_time_budget():
    from rlhf_run.progress import Eta

    eta = Eta(target=100, started=0.0)
    assert eta.text(5.0, 0) == "eta -"  # no rate yet: start-up is not counted
    # 10 updates in 20 s after the first sighting: 2 s an update, 90 left -> 180 s
    assert eta.text(25.0, 10) == "eta 0:03:00"
    assert eta.text(205.0, 100) == "eta 0:00:00"
    # run.max_seconds=60 started at 0: at 25 s, 35 s are left, fewer than the 180 s the rate says
    capped = Eta(target=100, started=0.0, max_seconds=60)
    capped.text(5.0, 0)
    assert capped.text(25.0, 10) == "eta 0:00:35"
    assert Eta(target=100, started=0.0, max_seconds=60).text(70.0, 0) == "eta 0:00:00"
    # a resumed run starts at its checkpoint's updates: the rate counts from there
    resumed = Eta(target=1000, started=0.0)
    resumed.text(3.0, 600)
    assert resumed.text(13.0, 700) == "eta 0:00:30"
