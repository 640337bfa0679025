"""Chaos: one run of the default task with 3 workers through a series of process faults, then an
audit from Redis's own counters that nothing was lost and nothing trained twice.

Faults, one after the other while training runs: a worker SIGKILLed (restarted by rlhf-run),
a worker SIGSTOPped past its lease (its prompts go to another worker) then resumed, the learner
SIGKILLed (restarted from its checkpoint), redis-server SIGKILLed and restarted on its
append-only file. The weight server's own restart is covered by
``test_weight_server_faults.py::test_server_killed_and_restarted_mid_run``.

And a learner killed between checkpoints: the same audit, and stale drops back at a run's usual
rate a few updates after its restart (the helpers here serve the Ray and resume variants too).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from buffer import RunKeys
from buffer.keys import WORKERS_GROUP
from buffer_clients import Clients
from servers import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

BIN = Path(sys.executable).parent
LEASE_S = 3.0


def version(r: redis.Redis, keys: RunKeys) -> int:
    try:
        return int(r.get(keys.version) or 0)
    except redis.exceptions.ConnectionError:  # Redis restarting
        return -1


def stop_while_holding_a_lease(r: redis.Redis, keys: RunKeys, pid: int, consumer: str, timeout_s: float) -> None:
    """SIGSTOP a worker at a moment it holds a lease. A worker waiting on the admission budget
    (the learner behind, as under load) holds none, and then nothing could be reclaimed from it:
    stop it, let what it had already sent reach Redis, look; without a lease, resume it and retry."""

    def attempt() -> bool:
        os.kill(pid, signal.SIGSTOP)
        time.sleep(0.2)
        if r.xpending_range(keys.prompts, WORKERS_GROUP, "-", "+", 1, consumername=consumer):
            return True
        os.kill(pid, signal.SIGCONT)
        time.sleep(0.05)
        return False

    wait_for(attempt, timeout_s, f"{consumer} to hold a lease")


def test_a_run_through_process_faults_loses_nothing_and_trains_nothing_twice(tmp_path, redis_server, model_cache):
    out, run_id = tmp_path / "out", "chaos"
    keys = RunKeys.for_run(run_id)
    cmd = [str(BIN / "rlhf-run"), f"hydra.run.dir={out}", f"model.cache_dir={model_cache}", "run.progress=false",
           f"buffer.url={redis_server.url}", f"buffer.run_id={run_id}", "rollout.num_workers=3", "rollout.slots=8",
           "learner.batch_size=16", "learner.micro_batch_size=16", "learner.checkpoint_every=2", "learner.max_updates=100000",
           "buffer.heartbeat_interval_s=0.5", f"buffer.lease_timeout_s={LEASE_S}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    r = redis.Redis.from_url(redis_server.url)
    try:
        wait_for(lambda: version(r, keys) >= 3, 240, "training to start")
        pids = json.loads((out / "children.json").read_text())
        os.kill(pids["worker-0"], signal.SIGKILL)
        reclaimed = int(r.hget(keys.counters, "prompts_reclaimed") or 0)
        try:  # silent past its lease: another worker takes its prompts
            stop_while_holding_a_lease(r, keys, pids["worker-1"], "worker-1", 60)
            wait_for(lambda: int(r.hget(keys.counters, "prompts_reclaimed") or 0) > reclaimed, 60, "a lease reclaimed")
        finally:
            os.kill(pids["worker-1"], signal.SIGCONT)
        v = version(r, keys)
        wait_for(lambda: version(r, keys) >= v + 3, 120, "training after the worker faults")
        os.kill(json.loads((out / "children.json").read_text())["learner"], signal.SIGKILL)
        v = version(r, keys)
        wait_for(lambda: version(r, keys) >= v + 3, 180, "training after the learner's restart")
        redis_server.restart()  # SIGKILL, then the same port and append-only file
        wait_for(lambda: version(r, keys) >= 0, 60, "Redis to answer again")
        v = version(r, keys)
        wait_for(lambda: version(r, keys) >= v + 3, 180, "training after Redis's restart")
        # The budget is out of reach: the run ends on Ctrl-C once every fault is behind it, not
        # on a number of updates a fast machine could reach before the faults are over.
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, output[-4000:]  # stopped by Ctrl-C, cleanly
    assert "restarting worker-0" in output and "restarting the learner from its last checkpoint" in output

    # Four waits for 3 more versions each, but the learner's restart costs up to three versions that
    # are no new step: the updates since its last checkpoint (up to checkpoint_every=2, when it dies
    # between an update's metrics line and its checkpoint) are trained again under their old step
    # numbers, and the checkpoint's weights are republished as a version of their own. Seen under
    # load: steps 1-8, then steps 7-10 as versions 10-13. So >= 12 - 3.
    summary = audit(out, redis_server.url, run_id)
    assert summary["steps"] >= 9, summary


def audit(out: Path, url: str, run_id: str) -> dict:
    """After a run through faults: nothing lost, nothing trained twice, from Redis's own counters
    and the run's summary (returned)."""
    summary = json.loads((out / "summary.json").read_text())
    buf = Clients.connect(url, run_id)
    try:
        c = buf.monitor.metrics()["counters"]
        in_stream = buf.redis.xlen(buf.keys.samples)
    finally:
        buf.close()
    assert summary["dead_letters"] == 0, summary
    # every group appended was consumed, dropped as stale (counted with a reason) or is still there
    assert c["groups_appended"] == c["groups_removed"] + in_stream, c
    assert c["groups_removed"] == c["groups_consumed"] + c["groups_dropped_stale"], c
    # what the learner's weights were trained on is exactly what the buffer handed out and acked:
    # a group trained twice (or lost in a crash) would break the equality
    assert summary["samples_trained"] == c["samples_consumed"], (summary, c)
    assert c["samples_consumed"] <= c["samples_appended"]
    return summary


def generated_and_stale(r: redis.Redis, keys: RunKeys) -> tuple[int, int]:
    """The buffer's counts of samples appended and of samples dropped as too stale."""
    appended, stale = r.hmget(keys.counters, "samples_appended", "samples_dropped_stale")
    return int(appended or 0), int(stale or 0)


#: what a learner restarted between checkpoints logs: its checkpoint, and the version it publishes it as
RESTORED = re.compile(r"published the restored weights \(checkpoint version (\d+)\) as version (\d+)")
#: updates after the restored weights' version before stale drops are counted: the updates lost with
#: the crash trained again (up to 7), what the lost weights generated read (too stale for the new
#: number, once) and the pipeline refilled
SETTLE = 12
#: updates over which they are counted
WINDOW = 20
#: samples generated over the window, at the least, for its drop share to mean anything: what a
#: window generates is what it trained (WINDOW * 16) less the backlog it started with, which after
#: a restart's catch-up can be several batches deep (8 on Ray under load)
MIN_GENERATED = WINDOW * 16 // 4


def stale_after_a_learner_restart(r: redis.Redis, keys: RunKeys, log: Path, kill_learner: Callable[[], None],
                                  wait: Callable[..., Any] = wait_for) -> dict[str, tuple[int, int]]:
    """In a run with ``learner.checkpoint_every=10``: SIGKILL the learner (``kill_learner``) 3 to 6
    updates past a checkpoint (far from the next), wait for its restart (``log``: its log file)
    and count the samples generated and dropped as too stale over ``WINDOW`` updates from
    ``SETTLE`` after it. Returns ``{"before": (generated, stale) at the kill, "window": (generated,
    stale)}``."""
    wait(lambda: (v := version(r, keys)) > 10 and v % 10 in (3, 4, 5, 6), 300, "updates past a checkpoint")
    kill_learner()
    before = generated_and_stale(r, keys)
    restored = wait(lambda: RESTORED.search(log.read_text()), 240, "the learner to restart")  # renumbered
    start_v = int(restored[2]) + SETTLE
    wait(lambda: version(r, keys) >= start_v, 240, f"version {start_v}")
    start = generated_and_stale(r, keys)
    wait(lambda: version(r, keys) >= start_v + WINDOW, 300, f"version {start_v + WINDOW}")
    end = generated_and_stale(r, keys)
    return {"before": before, "window": (end[0] - start[0], end[1] - start[1])}


@pytest.mark.timeout(900)
def test_a_learner_killed_between_checkpoints_drops_no_more_than_before(tmp_path, redis_server, model_cache):
    """The learner SIGKILLed a few updates past a checkpoint (every 10 updates): it restores that
    checkpoint and publishes it above the versions the dead learner published, so its version
    runs ahead of the updates its weights hold. Once the samples made before the crash are read
    (the first few updates), stale drops are back to a run's usual rate. Paced by the version, 10-16%
    of the window's samples were dropped here (51% from outside); paced by the updates, 0 in quiet
    runs, but on two cores kept busy a worker that pulls the renumbered weights late drops a few
    groups with or without a restart (12 of 340 seen once), so the bound is 5%."""
    out, run_id = tmp_path / "out", "restart-pacing"
    cmd = [str(BIN / "rlhf-run"), f"hydra.run.dir={out}", f"model.cache_dir={model_cache}", "run.progress=false",
           f"buffer.url={redis_server.url}", f"buffer.run_id={run_id}", "rollout.slots=8",
           "learner.batch_size=16", "learner.micro_batch_size=16", "learner.checkpoint_every=10",
           "learner.max_updates=100000"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    r = redis.Redis.from_url(redis_server.url)
    try:
        kill = lambda: os.kill(json.loads((out / "children.json").read_text())["learner"], signal.SIGKILL)  # noqa: E731
        counts = stale_after_a_learner_restart(r, RunKeys.for_run(run_id), out / "logs" / "learner.log", kill)
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, output[-4000:]
    summary = audit(out, redis_server.url, run_id)
    generated, stale = counts["window"]
    assert generated >= MIN_GENERATED and stale <= 0.05 * generated, counts
    # the summary counts the restart's drops (what the lost weights made) apart, and says why
    [restart] = summary["learner_restarts"]
    assert restart["version"] > 10 and restart["skipped"] >= 2, summary
    assert restart["samples_dropped_stale"] <= summary["samples_dropped_stale"]
    assert ("followed a learner restart (at version" in output) == (restart["samples_dropped_stale"] > 0), output[-3000:]
