"""The summary (summary.json and its text), the monitor's rates and the throughput plot, from
made-up metrics rows and buffer snapshots (no Redis)."""

from __future__ import annotations


def test_the_cost_of_scoring_reaches_summary_json_and_the_console():
    from rlhf_core.config import Config
    from rlhf_run.summary import format_summary, summarize

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
    assert "reward reasons" not in format_summary(s)
    # the verifiers' reasons, summed over workers (math/wrong 3 + 4), one line
    workers["worker-0"]["stats"]["reward_reasons"] = {"math/wrong": 3, "math/correct": 5}
    workers["worker-1"]["stats"]["reward_reasons"] = {"math/wrong": 4, "math/timeout": 1}
    s = summarize(Config(), rows, [{"consumers": workers, "counters": {}}], wall_s=10.0, exit_reason="done")
    assert "  reward reasons: math/correct 5, math/timeout 1, math/wrong 7" in format_summary(s).splitlines()
    # workers of an older version (no score_share) leave the line out, not a misleading 0%
    old = summarize(Config(), rows, [{"consumers": {"w": {"stats": {}}}, "counters": {}}], wall_s=10.0, exit_reason="done")
    assert old["rewards"]["scoring_share"] is None and "rewards:" not in format_summary(old)


def test_the_summary_says_why_the_learner_stopped():
    from rlhf_core.config import Config
    from rlhf_run.summary import format_summary, summarize

    # the learner's last stats record carries its reason; a run whose data ran out before
    # learner.max_updates once waited for batches for ever, and now says so when it ends
    rows = [{"learner/updates": i, "learner/samples_trained": 8 * i, "time": float(i)} for i in range(1, 3)]
    snap = {"counters": {}, "stats": {"learner": {"learner/updates": 2, "learner/stopped_by": "data"}}}
    s = summarize(Config(), rows, [snap], wall_s=10.0, exit_reason="learner finished")
    assert s["stopped_by"] == "data"
    assert format_summary(s).splitlines()[0].endswith("(learner finished: every prompt of data.epochs trained on) in 10 s")
    older = summarize(Config(), rows, [{"counters": {}}], wall_s=10.0, exit_reason="learner finished")
    assert older["stopped_by"] is None and format_summary(older).splitlines()[0].endswith("(learner finished) in 10 s")


def test_the_summary_tells_decoding_batches_apart_from_waiting_for_them():
    from rlhf_core.config import Config
    from rlhf_run.summary import format_summary, summarize

    # 3 updates, each: compute 1.0 s, decoding its batch 0.5 s, waiting 2.0 s, publish 0.25 s on its thread
    rows = [{"learner/updates": i, "learner/samples_trained": 32 * i, "time": float(i), "learner/time_compute_s": 1.0,
             "learner/time_read_s": 0.5, "learner/time_wait_s": 2.0, "learner/time_publish_s": 0.25} for i in range(1, 4)]
    s = summarize(Config(), rows, [], wall_s=10.0, exit_reason="done")
    assert (s["throughput"]["learner_read_s"], s["throughput"]["learner_wait_s"]) == (1.5, 6.0)
    assert format_summary(s).splitlines()[4].endswith(
        "learner compute 3 s, reading batches 1.5 s, waiting 6 s, publishing 0.8 s (on its own thread)")


def test_samples_the_gateway_made_and_samples_dropped_as_stale_are_in_the_summary():
    from rlhf_core.config import Config
    from rlhf_run.summary import format_summary, summarize

    # a gateway-only run: its worker made no samples of its own (samples_per_s 0); the buffer
    # counted 0 appended at t=100, 1,000 at t=110 and 3,000 at t=120 -> (3000 - 1000) / (120 - 110)
    # = 200 samples/s from the first snapshot that counts any; 2,000 of the 3,000 dropped as too stale
    worker = {"worker-0": {"stats": {"samples_per_s": 0.0, "score_share": 0.0, "reward_calls_per_s": 0.0}}}
    timeline = [{"time": 100.0 + 10 * i, "consumers": worker,
                 "counters": {"samples_appended": n, "samples_dropped_stale": d}}
                for i, (n, d) in enumerate([(0, 0), (1000, 500), (3000, 2000)])]
    rows = [{"learner/updates": i, "learner/samples_trained": 32 * i, "time": 100.0 + i} for i in range(1, 4)]
    s = summarize(Config(), rows, timeline, wall_s=20.0, exit_reason="done")
    assert s["throughput"]["generated_samples_per_s"] == 200.0
    assert (s["samples_generated"], s["samples_dropped_stale"]) == (3000, 2000)
    lines = format_summary(s).splitlines()
    assert lines[1] == "  steps 3, samples trained 96, generated 3000, dropped as too stale 2000"
    # 2000 / 3000 = 67% (over the 10% that earns the hint), with what to do
    assert any(ln.startswith("  67% of the generated samples were more than algo.max_staleness=2") and
               "raise algo.max_staleness" in ln for ln in lines), lines
    # a run that dropped a few (under 10%) says how many, without the hint; a single snapshot
    # falls back on the workers' own rates
    few = summarize(Config(), rows, [{"time": 100.0, "consumers": worker,
                                      "counters": {"samples_appended": 3000, "samples_dropped_stale": 100}}],
                    wall_s=20.0, exit_reason="done")
    assert few["throughput"]["generated_samples_per_s"] == 0.0
    assert format_summary(few).splitlines()[1].endswith("dropped as too stale 100")
    assert "were more than" not in format_summary(few)
    # the workers scored nothing (the agents posted every reward): no line about scoring
    assert "rewards:" not in format_summary(s)


def test_stale_drops_after_a_learner_restart_are_told_apart_and_explained():
    from rlhf_core.config import Config
    from rlhf_run.progress import RestartDrops
    from rlhf_run.summary import format_summary, summarize

    # (learner version, updates, dropped stale) a second apart: the learner dies at version 14
    # (14 updates) and restores checkpoint 10, published as version 15; 16 samples the dead
    # learner's weights made are dropped when read, then the learner trains past 14 + 2 + 2 updates
    # and a later drop (lag from slow workers) is not the restart's
    points = [(13, 13, 0), (14, 14, 0), (15, 10, 0), (19, 14, 16), (21, 16, 16), (23, 18, 16), (24, 19, 20)]
    timeline = [{"time": 100.0 + i, "learner_version": v, "learner_updates": u,
                 "counters": {"samples_appended": 100 * (i + 1), "samples_dropped_stale": d}}
                for i, (v, u, d) in enumerate(points)]
    restarts = RestartDrops(max_staleness=2)
    lines = []
    for snap in timeline:
        restarts.add(snap)
        lines.append(restarts.text())
    assert restarts.restarts == [{"version": 14, "updates": 14, "skipped": 5, "samples_dropped_stale": 16}]
    assert lines[:3] == ["", "", ""] and lines[3] == "  dropped stale 16 after the learner restart at version 14 (made before it)"
    rows = [{"learner/updates": i, "learner/samples_trained": 16 * i, "time": 100.0 + i} for i in range(1, 20)]
    s = summarize(Config(), rows, timeline, wall_s=10.0, exit_reason="done")
    assert s["learner_restarts"] == restarts.restarts
    text = format_summary(s)
    assert ("  16 of the samples dropped as too stale followed a learner restart (at version 14, 16 dropped, the "
            "restored weights numbered 5 versions ahead)") in text and "not a reason to raise algo.max_staleness" in text
    # the other 4 of 700 generated are under the 10% that earns the hint to raise algo.max_staleness
    assert "were more than" not in text
    # a snapshot from before the buffer knew the updates (or an older run's) tells nothing
    older = RestartDrops(max_staleness=2)
    for snap in timeline:
        older.add({k: v for k, v in snap.items() if k != "learner_updates"})
    assert older.restarts == []


class _Counters:
    """What the monitor reads of the buffer: its counters and the consumers' heartbeats."""

    def __init__(self) -> None:
        self.appended = 0
        self.learner: dict = {}  # the learner's published stats

    def run_params(self) -> dict:
        return {"lease_timeout_s": 30.0}

    def metrics(self) -> dict:
        worker = {"age_s": 0.5, "stats": {"samples_per_s": 7.0}}  # a gateway-only run's worker: its own rate says little
        return {"counters": {"samples_appended": self.appended}, "consumers": {"worker-0": worker},
                "stats": {"learner": self.learner}}


def test_the_monitors_generated_rate_is_the_buffers_appends_over_the_last_ten_seconds(monkeypatch):
    from rlhf_run import monitor

    now = [100.0]
    monkeypatch.setattr(monitor.time, "time", lambda: now[0])
    buf = _Counters()
    snap = monitor.snapshot(buf)
    assert snap["generated_samples_per_s"] == 7.0  # one snapshot: the workers' own rates
    # the gateway appends whole groups: 64 samples at t=101, nothing until 64 more at t=105;
    # one refresh's rate would read 64, 0, 0, 0, 64; over the window: 64 / 1 s, then
    # 64 / 2 s = 32, 21.3, 16, then (128 - 0) / (105 - 100) = 25.6
    rates = []
    for t, appended in [(101, 64), (102, 64), (103, 64), (104, 64), (105, 128)]:
        now[0], buf.appended = float(t), appended
        snap = monitor.snapshot(buf, snap)
        rates.append(round(snap["generated_samples_per_s"], 1))
    assert rates == [64.0, 32.0, 21.3, 16.0, 25.6]
    # Ten seconds later the window starts at t=106 (points before t=116 - 10 are dropped):
    # (192 - 128) / (116 - 106) = 6.4
    for t in range(106, 117):
        now[0], buf.appended = float(t), 128 if t < 116 else 192
        snap = monitor.snapshot(buf, snap)
    assert snap["appended_window"][0] == [106.0, 128]
    assert round(snap["generated_samples_per_s"], 1) == 6.4


def test_the_monitors_trained_rate_is_samples_trained_per_second_not_per_second_of_compute(monkeypatch):
    from rlhf_run import monitor

    now = [1000.0]
    monkeypatch.setattr(monitor.time, "time", lambda: now[0])
    buf = _Counters()
    snap = monitor.snapshot(buf)
    assert snap["trained_samples_per_s"] is None  # no update yet
    # one update every 10 s, each computing 32 samples in 0.1 s: learner/samples_per_s says 320;
    # seen at t=1001 (32 trained) and t=1011 (64): (64 - 32) / (1011 - 1001) = 3.2 samples/s
    for t in range(1001, 1012):
        updates = 1 if t < 1011 else 2
        now[0], buf.learner = float(t), {"learner/updates": updates, "learner/samples_trained": 32 * updates,
                                         "learner/samples_per_s": 320.0, "learner/time_compute_s": 0.1}
        snap = monitor.snapshot(buf, snap)
    assert snap["trained_samples_per_s"] == 3.2
    # a learner restored from its checkpoint at 32 trained (its count went down at t=1021) starts the
    # window again: no rate, not (32 - 64) / (1021 - 1011) = -3.2; then 64 at t=1031: 32 / 10 s
    rates = []
    for t, trained in [*((t, 64) for t in range(1012, 1021)), (1021, 32), (1031, 64)]:
        now[0], buf.learner = float(t), {"learner/samples_trained": trained}
        snap = monitor.snapshot(buf, snap)
        rates.append(snap["trained_samples_per_s"])
    assert rates[-2:] == [None, 3.2]


def test_the_monitor_shows_the_gateways_calls_sessions_and_errors_by_code():
    import io

    from rich.console import Console

    from rlhf_run import monitor

    gateway = {"calls": 120, "calls_running": 3, "calls_failed": 7, "sessions_open": 9, "sessions_rewarded": 40,
               "sessions_expired": 2, "errors_worker_stopped": 5, "errors_channel_lost": 2}
    out = io.StringIO()
    Console(file=out, width=250).print(monitor.render({"run_id": "r", "stats": {"gateway": gateway}}))
    text = out.getvalue()
    assert "120 (3, 7)" in text and "9, 40, 2" in text
    assert "channel_lost 2  worker_stopped 5" in text  # sorted by code
    out = io.StringIO()
    Console(file=out, width=250).print(monitor.render({"run_id": "r"}))
    assert "gateway" not in out.getvalue()  # a run without a gateway shows no such row


def test_a_resume_on_kept_redis_data_counts_generation_from_its_first_append_not_its_start_up():
    from rlhf_run.summary import appended_per_s

    # the buffer counted 1,440 samples before the stop; the resumed launch loads for 20 s, then
    # appends 1,472 -> 1,984 in 3 s: (1984 - 1472) / (24 - 21) = 170.7 samples/s. Counting from the
    # first snapshot that counts any took in the start-up: (1984 - 1440) / 24 = 22.7
    timeline = [{"time": t, "counters": {"samples_appended": n}} for t, n in [(0.0, 1440), (20.0, 1440), (21.0, 1472),
                                                                               (24.0, 1984)]]
    assert abs(appended_per_s(timeline) - 512 / 3) < 1e-9


def test_the_generation_rate_ends_at_the_last_append_not_at_the_end_of_the_run():
    from rlhf_core.config import Config
    from rlhf_run.summary import summarize

    # 100 samples/s from t=10 to t=30 (100 -> 2,100), then 60 s of final checkpoint and drain with
    # no append: (2100 - 100) / (30 - 10) = 100 samples/s. To the last snapshot: 2000 / 80 = 25
    timeline = [{"time": t, "counters": {"samples_appended": n}, "consumers": {}}
                for t, n in [(0.0, 0), (10.0, 100), (20.0, 1100), (30.0, 2100), (60.0, 2100), (90.0, 2100)]]
    rows = [{"learner/updates": i, "learner/samples_trained": 32 * i, "time": 10.0 + 0.32 * i} for i in range(1, 63)]
    s = summarize(Config(), rows, timeline, wall_s=90.0, exit_reason="done")
    assert s["throughput"]["generated_samples_per_s"] == 100.0


def test_the_summarys_weight_sync_latency_is_over_the_versions_not_the_newest_alone():
    from rlhf_core.config import Config
    from rlhf_run.summary import summarize

    # version 1 seen by one worker (40 ms), then both (mean 30 ms); version 2 both (50 ms); the
    # final version 3, published as the workers drained, applied by none: (30 + 50) / 2 = 40 ms,
    # where the last snapshot alone says nothing (None), or one version's figure
    ws = [(1, 0.040), (1, 0.030), (2, 0.050), (3, None)]
    timeline = [{"time": float(i), "counters": {}, "consumers": {},
                 "stats": {"weight_server": {"version": v, "sync_latency_s": lat}}} for i, (v, lat) in enumerate(ws)]
    rows = [{"learner/updates": i, "learner/samples_trained": 32 * i, "time": float(i)} for i in range(1, 4)]
    s = summarize(Config(), rows, timeline, wall_s=10.0, exit_reason="done")
    assert abs(s["throughput"]["weight_sync_latency_s"] - 0.040) < 1e-12


def test_workers_that_left_do_not_count_in_the_generation_rates():
    from rlhf_core.config import Config
    from rlhf_run.summary import summarize

    # worker-1's record is from the launch before a resume (last heartbeat 40 s ago, over
    # buffer.lease_timeout_s=30): its rates over its uptime are not generation now
    consumers = {"worker-0": {"age_s": 0.5, "stats": {"tokens_per_s": 1306.0, "reward_calls_per_s": 20.0}},
                 "worker-1": {"age_s": 40.0, "stats": {"tokens_per_s": 914.0, "reward_calls_per_s": 15.0}}}
    rows = [{"learner/updates": i, "learner/samples_trained": 32 * i, "time": float(i)} for i in range(1, 4)]
    s = summarize(Config(), rows, [{"consumers": consumers, "counters": {}}], wall_s=10.0, exit_reason="done")
    assert s["throughput"]["generated_tokens_per_s"] == 1306.0 and s["rewards"]["reward_calls_per_s"] == 20.0


def test_every_reason_the_learner_stops_for_has_words_in_the_summary():
    """The learner's stop reasons and the summary's words for them were two spellings of one list;
    both take ``rlhf_core.metric_names.STOP_REASONS``, and the learner answers each and only those."""
    import threading
    import time
    from types import SimpleNamespace

    from learner.trainer import Learner
    from rlhf_core import metric_names as M
    from rlhf_run.summary import STOP_REASONS

    assert set(STOP_REASONS) == set(M.STOP_REASONS) and all(STOP_REASONS.values())

    def stop_reason(signalled=False, updates=0, late=False, used_up=False):
        event = threading.Event()
        if signalled:
            event.set()
        state = SimpleNamespace(stop_event=event, updates=updates, reader=SimpleNamespace(used_up=used_up))
        return Learner._stop_reason(state, 10, time.monotonic() - 1 if late else None)

    assert stop_reason() == ""  # go on
    said = {stop_reason(signalled=True), stop_reason(updates=10), stop_reason(late=True), stop_reason(used_up=True)}
    assert said == set(M.STOP_REASONS)


def test_throughput_plot_has_one_clock_and_rates_as_they_happen():
    from rlhf_run.plots import throughput_series

    # snapshots every second from t=100: the buffer counts 32 appended samples a second from
    # t=105, the learner 32 trained a second from t=107. Once: the generated curve counted from the
    # first snapshot and the trained one from the learner's first update (13 s apart on one axis
    # in the default run), the generated one moved only at the workers' 2 s heartbeats (0, 2x, 0,
    # 2x between 1 s snapshots), and the trained one was per second of compute (twice what the
    # learner kept up with)
    timeline = [{"time": 100.0 + i, "counters": {"samples_appended": 32 * max(0, i - 5)},
                 "stats": {"learner": {"learner/samples_trained": 32 * (i - 7)}} if i >= 7 else {}} for i in range(31)]
    rows = [{"time": 107.0 + i, "learner/time_compute_s": 0.5, "learner/samples_per_s": 64.0} for i in range(24)]
    series = throughput_series(rows, timeline)
    gen_t, gen = series["generated (workers)"]
    trained_t, trained = series["trained (learner)"]
    assert gen_t == trained_t == [float(i) for i in range(1, 31)]
    # over the last 10 s: 32 a second once both have gone on for 10 s
    assert gen[14:] == [32.0] * 16 and trained[16:] == [32.0] * 14
    assert gen[:5] == [0.0] * 5 and trained[:7] == [0.0] * 7


def test_a_resume_on_a_new_redis_says_its_generated_count_is_this_launchs():
    from rlhf_core.config import Config
    from rlhf_run.summary import format_summary, summarize

    # a finished run (10 updates of 32, its Redis data removed at the clean finish) resumed at
    # t=100 for 3 more: the learner's count goes on (416), the new Redis's starts at 0 (96 appended).
    # Once: "samples trained 416, generated 96", as if the learner trained what was never generated
    rows = [{"learner/updates": i, "learner/samples_trained": 32 * i, "time": float(i)} for i in range(1, 11)]
    rows += [{"learner/updates": i, "learner/samples_trained": 32 * i, "time": 90.0 + i} for i in range(11, 14)]
    timeline = [{"time": 5.0, "counters": {"samples_appended": 200}},  # the first launch's snapshot
                {"time": 100.0, "counters": {}}, {"time": 105.0, "counters": {"samples_appended": 96}}]
    s = summarize(Config(), rows, timeline, wall_s=10.0, exit_reason="done", since=99.0)
    assert format_summary(s).splitlines()[1] == ("  steps 13, samples trained 416, generated 96 (this launch: the "
                                                 "buffer's counts restarted with the run's Redis)")
    # a resume on the Redis data the launch before kept: the buffer's counts go on, nothing to say
    kept = [{"time": 100.0, "counters": {"samples_appended": 200}}, {"time": 105.0, "counters": {"samples_appended": 296}}]
    s = summarize(Config(), rows, kept, wall_s=10.0, exit_reason="done", since=99.0)
    assert format_summary(s).splitlines()[1] == "  steps 13, samples trained 416, generated 296"


def mismatch_row(update: int, lag0: tuple[float, ...], lagged: tuple[float, ...]) -> dict:
    """A learner row with the mismatch of each split: (tokens, abs_mean, abs_max, kl_k3, out_of_band_frac)."""
    from rlhf_core import metric_names as M

    row = {"learner/updates": update, "learner/samples_trained": 32 * update, "time": float(update)}
    for split, values in ((M.MISMATCH_LAG0, lag0), (M.MISMATCH_LAGGED, lagged)):
        row.update({M.mismatch_key(split, s): v
                    for s, v in zip(("tokens", "abs_mean", "abs_max", "kl_k3", "out_of_band_frac"), values)})
    return row


def test_the_summary_weighs_each_updates_mismatch_by_its_tokens():
    from rlhf_core.config import Config
    from rlhf_run.summary import format_summary, summarize

    # lag 0: 30 tokens at |dlogp| mean 1e-7 and 10 at 5e-7 -> (3e-6 + 5e-6) / 40 = 2e-7; KL (30 * 1e-14 + 10 * 5e-14)
    # / 40 = 2e-14; max of the maxima 9e-7. The third update has no lag-0 token: its zeros weigh nothing.
    # lagged: 100 and 300 tokens at |dlogp| mean 0.1 and 0.3 -> 0.25, KL 0.01 and 0.03 -> 0.025, out of band 0.0
    # and 0.02 -> 0.015
    rows = [mismatch_row(1, (30, 1e-7, 4e-7, 1e-14, 0.0), (100, 0.1, 2.0, 0.01, 0.0)),
            mismatch_row(2, (10, 5e-7, 9e-7, 5e-14, 0.0), (0, 0.0, 0.0, 0.0, 0.0)),
            mismatch_row(3, (0, 0.0, 0.0, 0.0, 0.0), (300, 0.3, 3.0, 0.03, 0.02))]
    cfg = Config()
    cfg.algo.mismatch_warn = 3e-14  # the second update's lag-0 KL is over it
    s = summarize(cfg, rows, [], wall_s=10.0, exit_reason="done")
    lag0, lagged = s["mismatch"]["lag0"], s["mismatch"]["lagged"]
    assert lag0["tokens"] == 40 and lag0["abs_max"] == 9e-7 and lag0["kl_k3_max"] == 5e-14
    assert abs(lag0["abs_mean"] - 2e-7) < 1e-20 and abs(lag0["kl_k3"] - 2e-14) < 1e-27
    assert lagged["tokens"] == 400 and abs(lagged["kl_k3"] - 0.025) < 1e-15 and abs(lagged["out_of_band_frac"] - 0.015) < 1e-15
    assert ("  mismatch: lag-0 |dlogp| mean 2e-07 max 9e-07, KL k3 2e-14, out of [0.5, 2] 0 (40 tokens); "
            "lag>0 |dlogp| mean 0.25 max 3, KL k3 0.025, out of [0.5, 2] 0.015 (400 tokens)") in format_summary(s).splitlines()
    assert (s["mismatch"]["lag0_updates"], s["mismatch"]["lag0_updates_over_warn"]) == (2, 1)
    assert format_summary(s).splitlines()[-1].startswith("  the lag-0 mismatch was over algo.mismatch_warn in 1 of the 2 updates")
    # a synchronous run has no lagged token; DPO reports no mismatch at all
    sync = summarize(Config(), rows[1:2], [], wall_s=10.0, exit_reason="done")
    assert format_summary(sync).splitlines()[-1].endswith("(10 tokens); lag>0 no tokens")
    dpo = summarize(Config(), [{"learner/updates": 1, "time": 1.0}], [], wall_s=10.0, exit_reason="done")
    assert dpo["mismatch"] is None and "mismatch" not in format_summary(dpo)


def test_the_monitor_shows_the_newest_updates_mismatch():
    import io

    from rich.console import Console

    from rlhf_run import monitor

    out = io.StringIO()
    learner = mismatch_row(5, (40, 2e-7, 9e-7, 2e-14, 0.0), (0, 0.0, 0.0, 0.0, 0.0))
    Console(file=out, width=300).print(monitor.render({"run_id": "r", "stats": {"learner": learner}}))
    text = out.getvalue()
    assert "mismatch lag 0" in text and "|dlogp| mean 2e-07 max 9e-07, KL k3 2e-14" in text and "no tokens" in text
    out = io.StringIO()
    Console(file=out, width=300).print(monitor.render({"run_id": "r", "stats": {"learner": {"learner/updates": 1}}}))
    assert "mismatch" not in out.getvalue()  # DPO's rows have none
