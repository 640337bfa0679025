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


def test_the_eta_counts_from_the_first_update_seen_and_respects_the_time_budget():
    from rlhf_run.report import Eta

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


def test_the_cost_of_scoring_reaches_summary_json_and_the_console():
    from rlhf_core.config import Config
    from rlhf_run.report import format_summary, summarize

    # two workers' last heartbeats: scoring threads busy 90% and 70% of the time, 20 + 5 calls/s
    workers = {"worker-0": {"stats": {"score_share": 0.9, "reward_calls_per_s": 20.0, "reward_timeouts": 1,
                                      "empty_responses": 3, "samples_per_s": 10.0}},
               "worker-1": {"stats": {"score_share": 0.7, "reward_calls_per_s": 5.0, "reward_timeouts": 0,
                                      "empty_responses": 2}}}
    rows = [{"learner/updates": i, "learner/samples_trained": 32 * i, "time": float(i)} for i in range(1, 4)]
    s = summarize(Config(), rows, [{"consumers": workers, "counters": {}}], wall_s=10.0, exit_reason="done")
    assert s["rewards"] == {"scoring_share": 0.8, "reward_calls_per_s": 25.0, "reward_timeouts": 1, "empty_responses": 5}
    assert ("  rewards: scoring busy 80% of the workers' scoring-thread time, 25.0 reward calls/s, 1 call(s) timed out, "
            "5 empty response(s)") in format_summary(s).splitlines()
    # workers of an older version (no score_share) leave the line out, not a misleading 0%
    old = summarize(Config(), rows, [{"consumers": {"w": {"stats": {}}}, "counters": {}}], wall_s=10.0, exit_reason="done")
    assert old["rewards"]["scoring_share"] is None and "rewards:" not in format_summary(old)
