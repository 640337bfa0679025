"""`rlhf-run launcher=ray` on a Ray cluster of several nodes on this one machine
(``ray.cluster_utils.Cluster``: a head and two more raylets, every one on 127.0.0.1; custom
resources decide which "node" runs what), shared by the tests of this module. One run trains the
default task with a two-rank DeepSpeed learner and workers spread over three nodes; another lives
through everything a cluster does to a run (a worker actor killed, workers added and retired, a
hand-started `rlhf-worker` joining, the learner's node and a worker's node lost at once) and its
buffer's counters show nothing was lost; a third loses one worker's node and measures how long
generation stalls and the lost worker's leases wait. A run without ray.address starts a Ray instance of its
own, and a placement it cannot hold is refused, naming the resource, before anything starts.

Skipped when the `ray` extra is missing. Ray is started cheaply (no dashboard, 80 MB object
stores, 1 logical CPU a node, a lost node declared dead after ~5 s) and every wait is on an
event (a counter, a file, a line).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
import redis

# Ray picks the machine's network address for its nodes unless told that this is one machine;
# with this (read when ray is imported, here and in every process the cluster starts) the
# cluster, the run's servers and all traffic stay on 127.0.0.1.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
ray = pytest.importorskip("ray", reason="the `ray` extra is not installed: pip install -e '.[ray]' (CI installs it)")

from buffer import MonitorClient, RunKeys, Store  # noqa: E402
from buffer.keys import WORKERS_GROUP  # noqa: E402
from rlhf_core import metric_names as M  # noqa: E402
from servers import wait_for  # noqa: E402
from test_chaos import MIN_GENERATED, audit, stale_after_a_learner_restart  # noqa: E402
from test_run import Lines, base_overrides, child_env, leases_taken_over, pending, pid_alive, script  # noqa: E402

pytestmark = [pytest.mark.integration]

LOOPBACK = {"node_ip_address": "127.0.0.1", "object_store_memory": 80 * 2**20}
#: a node whose raylet is gone is declared dead after 5 missed health checks a second apart
#: (Ray's default: 3 s apart); answering within 10 s still counts, however loaded the machine
FAST_NODE_DEATH = {"health_check_period_ms": 1000, "health_check_failure_threshold": 5}


def ray_env(**extra: str) -> dict[str, str]:
    return child_env(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", **extra)


@pytest.fixture(scope="module")
def cluster():
    """A head (1 CPU) and two nodes (1 CPU and 2 `rollout` each: room for one worker asking for 2,
    or two asking for 1)."""
    from ray._private import ray_constants
    from ray.cluster_utils import Cluster

    ray_constants.ENABLE_RAY_CLUSTER = False  # in case ray was imported before the variable was set
    c = Cluster(initialize_head=True, head_node_args=dict(LOOPBACK, num_cpus=1, include_dashboard=False,
                                                          _system_config=FAST_NODE_DEATH))
    for _ in range(2):
        c.add_node(**LOOPBACK, num_cpus=1, resources={"rollout": 2})
    yield c
    c.shutdown()


def rlhf_run(tmp_path: Path, out: Path, cache: Path, *args: str) -> list[str]:
    return [script("rlhf-run"), f"hydra.run.dir={out}", *base_overrides(cache), *args]


def until(lines: Lines, predicate, timeout_s: float, what: str):
    """``wait_for`` that shows the run's last output lines when it times out."""
    try:
        return wait_for(predicate, timeout_s, what, interval=0.2)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; the run's output ends with:\n" + "\n".join(list(lines.lines)[-40:])) from None


def actors(out: Path) -> dict:
    try:
        return json.loads((out / "actors.json").read_text())
    except OSError:  # not written yet (it is written atomically)
        return {}


def version_of(r: redis.Redis, run_id: str) -> int:
    return int(r.get(RunKeys.for_run(run_id).version) or 0)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_default_task_trains_with_a_two_rank_deepspeed_learner_and_workers_on_three_nodes(tmp_path, cluster,
                                                                                              model_cache):
    """The default task at a higher learning rate. The learner's two ranks are a STRICT_SPREAD
    placement group (rank 0 on the driver's node, rank 1 on another; gloo, the rendezvous on
    rank 0's node); the workers one per `rollout` node; the private redis-server and the weight
    server in actors on the driver's node. The output folder, report and plots are the
    one-machine launcher's."""
    out = tmp_path / "out"
    proc = subprocess.run([script("rlhf-run"), f"hydra.run.dir={out}", f"model.cache_dir={model_cache}",
                           "run.progress=false", "learner.max_updates=250", "learner.lr=1e-3",
                           "learner.checkpoint_every=100",
                           "launcher=ray", f"ray.address={cluster.address}", "learner.engine=deepspeed",
                           "ray.learner.ranks=2", "ray.learner.strategy=STRICT_SPREAD", "ray.learner.num_cpus=0.5",
                           "ray.worker.num_cpus=0.5", "+ray.worker.resources.rollout=2"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=560, env=ray_env(DS_ACCELERATOR="cpu"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 250 and summary["samples_trained"] == 250 * 32, summary
    # random level is ~0.01 (one right digit in 99); 250 updates at this rate reach ~0.05
    assert summary["reward_start"] < 0.03 and summary["reward_end"] > summary["reward_start"] + 0.02, summary
    assert summary["staleness_max"] <= 2 and summary["dead_letters"] == 0
    placed = actors(out)
    node = {name: placed[name]["node_id"] for name in ("learner", "learner-1", "worker-0", "worker-1", "redis",
                                                        "weight_server")}
    # the driver's node (with every node on 127.0.0.1, the driver attaches to any of them)
    assert node["learner"] == node["redis"] == node["weight_server"], placed
    assert node["learner-1"] != node["learner"] and node["worker-0"] != node["worker-1"], placed
    assert "learner done at version 250 after 250 updates" in (out / "logs" / "learner-1.log").read_text()
    assert "applied policy v250" in (out / "logs" / "weight-server.log").read_text()
    for png in ("reward.png", "staleness.png", "throughput.png"):
        assert (out / png).stat().st_size > 1000, png
    assert (out / "run_config.yaml").stat().st_mode & 0o077 == 0  # it holds the secret and the password
    assert "auth: hmac" in (out / "run_config.yaml").read_text()
    assert not (out / "redis").exists()  # a clean finish removes the private Redis's data
    assert "learner finished" in proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_run_loses_nothing_to_killed_workers_scaling_hand_started_workers_and_lost_nodes(tmp_path, cluster,
                                                                                         redis_server, model_cache):
    """On the test's Redis, so the buffer can be audited after Ctrl-C. The learner runs on a node
    of its own (`trainer`; ``ray.learner.on_driver_node=false``: the output folder must be one
    every node sees, here the same disk). In turn: worker-0's process is SIGKILLed (Ray restarts
    its actor); `rlhf-monitor workers=3` adds a worker and a hand-started `rlhf-worker` joins;
    `workers=1` retires two (they drain); then the learner's node and worker-0's node are lost
    together and new nodes join: Ray re-places worker-0 and the learner's placement group, the
    learner resumes from its checkpoint and trains on."""
    out, run_id = tmp_path / "out", "ray-chaos"
    r = redis.Redis.from_url(redis_server.url)
    trainer = cluster.add_node(**LOOPBACK, num_cpus=1, resources={"trainer": 1})
    proc = subprocess.Popen(rlhf_run(tmp_path, out, model_cache, "launcher=ray", f"ray.address={cluster.address}",
                                     "+ray.learner.resources.trainer=1", "ray.learner.on_driver_node=false",
                                     "ray.worker.num_cpus=0.5", "+ray.worker.resources.rollout=1",
                                     f"buffer.url={redis_server.url}",
                                     f"buffer.run_id={run_id}", "learner.max_updates=100000"),
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ray_env())
    lines, procs = Lines(proc), [proc]

    def generating() -> set[str]:
        snap = MonitorClient(Store(r, run_id=run_id)).metrics()["consumers"]
        return {n for n, c in snap.items() if c.get("stats", {}).get(M.WORKER_TOKENS, 0) > 0}

    def monitor_workers(n: int) -> str:
        done = subprocess.run([script("rlhf-monitor"), f"url={redis_server.url}", f"run_id={run_id}", f"workers={n}"],
                              cwd=tmp_path, capture_output=True, text=True, timeout=60, env=ray_env())
        assert done.returncode == 0, done.stderr
        return done.stdout

    try:
        until(lines, lambda: version_of(r, run_id) >= 2, 240, "two updates")
        first = until(lines, lambda: (a := actors(out)).get("worker-1") and a, 60, "both workers placed")
        assert first["learner"]["node_id"] == trainer.node_id
        # every role at the normal CPU priority: at Ray's default niceness (15) each got 3-4% of a
        # core beside two busy loops, and this test then failed (the learner not resumed in time)
        assert {n: os.getpriority(os.PRIO_PROCESS, a["pid"]) for n, a in first.items()} == dict.fromkeys(first, 0), first
        os.kill(first["worker-0"]["pid"], signal.SIGKILL)  # the process of a worker actor
        until(lines, lambda: actors(out).get("worker-0", {}).get("restarts") == 1
              and actors(out)["worker-0"]["pid"] != first["worker-0"]["pid"], 120, "worker-0 restarted by Ray")

        assert "worker target 2 -> 3" in monitor_workers(3)
        hand = subprocess.Popen([script("rlhf-worker"), "--config-path", str(out), "--config-name", "run_config",
                                 f"hydra.run.dir={tmp_path / 'ext'}"], cwd=tmp_path, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, env=ray_env(RLHF_WORKER_ID="ext-0"))
        procs.append(hand)
        until(lines, lambda: {"worker-2", "ext-0"} <= generating(), 180, "worker-2 and the hand-started worker generating")
        assert "worker target 3 -> 1" in monitor_workers(1)
        until(lines, lambda: all(lines.find(f"worker-{i} left (scaled down; exit 0)") for i in (1, 2)), 120,
              "workers 1 and 2 to drain and leave")
        assert {n for n in actors(out) if n.startswith("worker-")} == {"worker-0"}
        hand.send_signal(signal.SIGTERM)
        assert hand.wait(timeout=60) == 0

        # the learner's node and worker-0's node are lost (their raylets and every process on them)
        placed = actors(out)
        lost = next(n for n in cluster.worker_nodes if n.node_id == placed["worker-0"]["node_id"])
        cluster.remove_node(trainer, allow_graceful=False)
        cluster.remove_node(lost, allow_graceful=False)
        taken_over = leases_taken_over(r, run_id, "worker-0", placed["worker-0"]["pid"])
        trainer = cluster.add_node(**LOOPBACK, num_cpus=1, resources={"trainer": 1})
        cluster.add_node(**LOOPBACK, num_cpus=1, resources={"rollout": 2})  # the fixture's two rollout nodes again
        until(lines, lambda: actors(out).get("learner", {}).get("node_id") == trainer.node_id
              and actors(out).get("worker-0", {}).get("node_id") not in (None, lost.node_id), 180,
              "the learner and worker-0 placed again")
        until(lines, lambda: "resumed from checkpoint at version" in (out / "logs" / "learner.log").read_text(), 120,
              "the learner to resume from its checkpoint")
        v = version_of(r, run_id)
        until(lines, lambda: version_of(r, run_id) >= v + 2, 180, "two updates after the nodes were lost")
        until(lines, taken_over, 120, "the lost worker's leases to be taken over")

        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=180) == 130
        lines.thread.join(timeout=10)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        if trainer in cluster.worker_nodes:
            cluster.remove_node(trainer, allow_graceful=False)
    output = "\n".join(lines.lines)
    # what was trained is what the buffer handed out and acked; every group appended left the
    # stream consumed or stale; nothing dead-lettered, no lease or sample in flight left
    summary = json.loads((out / "summary.json").read_text())
    snap = MonitorClient(Store(r, run_id=run_id)).metrics()
    c = snap["counters"]
    assert summary["samples_trained"] == c["samples_consumed"] > 0, (summary, c)
    assert c["groups_removed"] == c["groups_consumed"] + c["groups_dropped_stale"], c
    assert summary["dead_letters"] == 0 and snap["depth"]["dead_letters"] == 0, output[-3000:]
    # seen twice with the suite on two loaded cores (2 leases, the 8 samples of their groups): say whose
    # (pytest.fail: an assert's message is cut short)
    if snap["depth"]["prompts_leased"] or snap["depth"]["samples_inflight"]:
        holders = r.xpending(RunKeys.for_run(run_id).prompts, WORKERS_GROUP)["consumers"]
        ends = [line for line in lines.lines if "did not stop" in line or "exited with" in line or " left (" in line]
        pytest.fail(f"leases or samples left after Ctrl-C: {snap['depth']}\nholders: {holders}\n"
                    f"actors: {actors(out)}\nhow the roles ended:\n" + "\n".join(ends[-20:]), pytrace=False)
    assert "restarting worker-0 (restart 1 of 5" in output and "restarting worker-0 (restart 2 of 5" in output
    mine = "\n".join(line for line in lines.lines if "worker-0" in line)  # the supervisor's lines about it
    assert "worker-0 exited with code -9 (the actor died" in output, mine[-3000:]
    assert "scaling the workers from 2 to 3" in output and "scaling the workers from 3 to 1" in output
    assert "restarting the learner from its last checkpoint (restart 1 of 3)" in output, output[-3000:]
    # every worker that took part has its record, or was retired (10 lease timeouts after it left);
    # worker-0 may also have been retired once while Ray placed it again (its leases were expired
    # when it died, so it held none), its next process making a new record
    records = {k.decode() for k in r.hkeys(RunKeys.for_run(run_id).consumers)}
    assert "worker-0" in records and len(records & {"worker-1", "worker-2", "ext-0"}) + snap["retired"]["consumers"] in (3, 4), \
        (records, snap["retired"])
    local = json.loads((out / "children.json").read_text())
    assert not [n for n, p in local.items() if pid_alive(p)], "processes left running"


def frozen_holding_leases(r: redis.Redis, run_id: str, consumer: str, pid: int) -> dict[str, int]:
    """SIGSTOP ``consumer``'s process ``pid``; once stopped, the leases it holds (:func:`pending`).
    Holding none, it is let go again (SIGCONT) and ``{}`` returned: call again."""
    os.kill(pid, signal.SIGSTOP)
    wait_for(lambda: Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T", 10, f"{pid} stopped")
    held = pending(r, run_id, consumer)
    if not held:
        os.kill(pid, signal.SIGCONT)
    return held


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_lost_workers_node_stalls_generation_no_longer_than_ray_takes_to_see_it(tmp_path, cluster, redis_server,
                                                                                   model_cache):
    """Two workers on the two `rollout` nodes (nothing but ``ray.worker.strategy``, SPREAD by
    default, keeps them apart: each node has room for four, and Ray's DEFAULT placement packs
    them on one below half of a node's resources), the learner on the driver's node,
    the run's lease timeout the default 30 s. One worker's node is lost, its worker frozen while it
    holds leases (so none can be finished by it) and then killed with the node: the other generates on,
    and the lost worker's leases are taken over as soon as the launcher sees its actor die, not
    after ``buffer.lease_timeout_s``. Both waits are measured from the kill, against Ray's own
    node-death detection (``FAST_NODE_DEATH``: 5 s) + 5 s."""
    import threading
    import time

    out, run_id = tmp_path / "out", "ray-node-loss"
    r = redis.Redis.from_url(redis_server.url)
    keys = RunKeys.for_run(run_id)
    proc = subprocess.Popen(rlhf_run(tmp_path, out, model_cache, "launcher=ray", f"ray.address={cluster.address}",
                                     "ray.worker.num_cpus=0.25", "+ray.worker.resources.rollout=0.5",
                                     f"buffer.url={redis_server.url}", f"buffer.run_id={run_id}",
                                     "buffer.lease_timeout_s=30", "learner.max_updates=100000"),
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ray_env())
    lines = Lines(proc)
    appends: list[tuple[float, int]] = []  # (time, samples appended so far), every 0.1 s
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.1):
            appends.append((time.monotonic(), int(r.hget(keys.counters, "samples_appended") or 0)))

    sampler = threading.Thread(target=sample, daemon=True)
    lost = None
    try:
        until(lines, lambda: version_of(r, run_id) >= 2, 240, "two updates")
        placed = until(lines, lambda: (a := actors(out)).get("worker-1") and a, 60, "both workers placed")
        assert placed["worker-0"]["node_id"] != placed["worker-1"]["node_id"], placed  # spread
        lost = next(n for n in cluster.worker_nodes if n.node_id == placed["worker-0"]["node_id"])
        assert placed["learner"]["node_id"] != lost.node_id, placed
        sampler.start()
        pid = placed["worker-0"]["pid"]
        held = until(lines, lambda: frozen_holding_leases(r, run_id, "worker-0", pid), 60, "worker-0 frozen with leases")
        killed = time.monotonic()
        # the node goes at once with everything on it: the frozen worker can finish nothing (removing
        # the node alone lets its process run on for a moment, and it may ack what it holds first)
        cluster.remove_node(lost, allow_graceful=False)
        os.kill(pid, signal.SIGKILL)
        taken_over = leases_taken_over(r, run_id, "worker-0", pid, held)
        until(lines, taken_over, 120, "the lost worker's leases to be taken over")
        until(lines, lambda: lines.find("worker-0 exited with code"), 60, "the launcher to see worker-0's death")
        taken_s = time.monotonic() - killed
        v = version_of(r, run_id)
        until(lines, lambda: version_of(r, run_id) >= v + 2, 180, "two updates after the leases were taken over")
        stop.set()
        sampler.join(timeout=10)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=180) == 130
        lines.thread.join(timeout=10)
    finally:
        stop.set()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if lost is not None:
            cluster.add_node(**LOOPBACK, num_cpus=1, resources={"rollout": 2})  # the fixture's two rollout nodes again
    # the stall: the longest time without a sample appended, from the last append before the kill on
    grew = [t for (_, n0), (t, n) in zip(appends, appends[1:]) if n > n0]
    before = [t for t in grew if t <= killed]
    times = before[-1:] + [t for t in grew if t > killed]
    stall_s = max(b - a for a, b in zip(times, times[1:]))
    detection_s = FAST_NODE_DEATH["health_check_period_ms"] * FAST_NODE_DEATH["health_check_failure_threshold"] / 1000
    print(f"node loss: {len(held)} lease(s) held, taken over after {taken_s:.1f} s; longest time without an append "
          f"{stall_s:.1f} s (Ray's node-death detection {detection_s:g} s)")
    assert stall_s <= detection_s + 5 and taken_s <= detection_s + 5, (stall_s, taken_s, held)
    output = "\n".join(lines.lines)
    mine = "\n".join(line for line in lines.lines if "worker-0" in line)  # the supervisor's lines about it
    assert "worker-0 exited with code -9 (the actor died" in output, mine[-3000:]
    assert "lease(s) expired: the other workers take them over now" in output, output[-3000:]
    snap = MonitorClient(Store(r, run_id=run_id)).metrics()
    c = snap["counters"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["samples_trained"] == c["samples_consumed"] > 0, (summary, c)
    assert c["groups_removed"] == c["groups_consumed"] + c["groups_dropped_stale"], c
    assert snap["depth"]["dead_letters"] == 0 and snap["depth"]["prompts_leased"] == 0, snap["depth"]
    assert c["prompts_reclaimed"] >= 1, c  # taken over, not all finished by worker-0 before it died


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_learner_actor_killed_between_checkpoints_drops_no_more_than_before(tmp_path, cluster, redis_server,
                                                                               model_cache):
    """The Ray twin of ``test_chaos.py::test_a_learner_killed_between_checkpoints_drops_no_more_than_before``:
    the learner actor's process SIGKILLed between checkpoints, restarted by the launcher from the
    last one and renumbered past the versions it had published; from a few updates
    after, stale drops stay at most 2% of generated, and the audit holds."""
    out, run_id = tmp_path / "out", "ray-restart-pacing"
    r = redis.Redis.from_url(redis_server.url)
    proc = subprocess.Popen(rlhf_run(tmp_path, out, model_cache, "launcher=ray", f"ray.address={cluster.address}",
                                     "ray.worker.num_cpus=0.5", "+ray.worker.resources.rollout=1",
                                     f"buffer.url={redis_server.url}", f"buffer.run_id={run_id}",
                                     "learner.checkpoint_every=10", "learner.max_updates=100000"),
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ray_env())
    lines = Lines(proc)
    try:
        until(lines, lambda: actors(out).get("learner"), 240, "the learner placed")
        counts = stale_after_a_learner_restart(r, RunKeys.for_run(run_id), out / "logs" / "learner.log",
                                               lambda: os.kill(actors(out)["learner"]["pid"], signal.SIGKILL),
                                               wait=lambda *a: until(lines, *a))
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=180) == 130
        lines.thread.join(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = "\n".join(lines.lines)
    assert "restarting the learner from its last checkpoint (restart 1 of 3)" in output, output[-3000:]
    audit(out, redis_server.url, run_id)
    generated, stale = counts["window"]
    assert generated >= MIN_GENERATED and stale <= 0.05 * generated, counts  # the bound: test_chaos.py's twin


@pytest.mark.timeout(120)
def test_a_placement_a_local_ray_instance_cannot_hold_is_refused_naming_the_resource(tmp_path, model_cache):
    """Without ray.address the run starts a Ray instance of its own (never joining another on
    this machine, such as the test cluster), which has no GPU."""
    out = tmp_path / "out"
    proc = subprocess.run(rlhf_run(tmp_path, out, model_cache, "launcher=ray", "ray.worker.num_gpus=1"), cwd=tmp_path,
                          capture_output=True, text=True, timeout=100, env=ray_env())
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert ("the run asks for 2 GPU in all (worker-0 1, worker-1 1) but the Ray cluster at this machine (a local "
            "instance) has 0 GPU on 1 alive node(s)" in proc.stderr), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "started a local Ray instance" in proc.stdout + proc.stderr
    assert not (out / "children.json").exists() and not (out / "logs").exists()  # nothing started


@pytest.mark.timeout(120)
def test_sigterm_stays_the_launchers_once_ray_is_up(tmp_path):
    """``Supervisor.run`` catches SIGTERM to stop the run cleanly (final checkpoint, summary, exit
    130); ``ray.init`` installs a handler of its own (``sys.exit``) over it, which ended a
    SIGTERMed run without its summary, its roles given 5 s instead of their grace."""
    from rlhf_core.config import Config
    from rlhf_run.ray_backend import RayBackend

    got: list[int] = []
    before = signal.signal(signal.SIGTERM, lambda signum, _frame: got.append(signum))
    launcher = RayBackend(Config(launcher="ray"), tmp_path)
    try:
        launcher.connect()  # a local Ray instance of its own
        os.kill(os.getpid(), signal.SIGTERM)
        wait_for(lambda: got, 5, "SIGTERM to reach the launcher's handler", interval=0.05)
    finally:
        signal.signal(signal.SIGTERM, before)
        launcher.ray.shutdown()


@pytest.mark.timeout(120)
def test_a_worker_target_the_cluster_cannot_hold_is_refused_naming_the_resource(tmp_path, caplog):
    """``rlhf-monitor workers=N`` with N past what the cluster holds: refused as the same run
    would be at its start, the workers it has kept, not N actors queued that no node can take
    (with a typo such as workers=1000, a thousand actors and their processes as nodes join)."""
    from rlhf_core.config import Config
    from rlhf_run.ray_backend import RayBackend
    from rlhf_run.supervisor import Supervisor

    cfg = Config(launcher="ray")
    cfg.ray.num_cpus = 2  # the local instance: room for the learner and one worker
    launcher = RayBackend(cfg, tmp_path)
    supervisor = Supervisor(cfg, tmp_path, launcher)
    try:
        launcher.connect()
        supervisor.scale_to(1000)
        assert supervisor.roles == [] and supervisor.worker_target == 1000  # asked once, said once
        assert "workers=1000 is refused" in caplog.text
        assert "the run asks for 1001 CPU in all (learner rank 0 1, worker-0 1, worker-1 1, worker-2 1, worker-3 1, " \
               "... 996 more) but the Ray cluster at this machine (a local instance) has 2 CPU" in caplog.text
    finally:
        launcher.ray.shutdown()


@pytest.mark.timeout(60)
def test_ray_address_auto_with_no_cluster_on_this_node_is_a_clear_error(tmp_path, monkeypatch):
    """``auto`` is RAY_ADDRESS, else the cluster `ray start` recorded on this node (in Ray's temp
    folder, here an empty one): with neither, a ConfigError saying what to do, not Ray's
    ConnectionError, and never a Ray instance some other program started on this machine."""
    from rlhf_core.config import Config, ConfigError
    from rlhf_run.ray_backend import RayBackend

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    cfg = Config(launcher="ray")
    cfg.ray.address = "auto"
    launcher = RayBackend(cfg, tmp_path)
    try:
        with pytest.raises(ConfigError) as err:
            launcher.connect()
        assert str(err.value).startswith("ray.address=auto: no Ray cluster was started on this node"), err.value
        assert "ray start --head" in str(err.value) and "leave ray.address unset" in str(err.value)
    finally:
        if ray.is_initialized():  # before the fix: joined whatever Ray instance runs on this machine
            ray.shutdown()


@pytest.mark.timeout(60)
def test_an_address_that_accepts_connections_but_is_no_ray_cluster_is_refused_within_the_timeout(tmp_path,
                                                                                               monkeypatch):
    """A port that accepts TCP connections and never answers (here a listener that says nothing;
    a Redis or any other server is alike to Ray): ray.init kept retrying for ~14 minutes."""
    import socket
    import threading
    import time

    from ray._private import ray_constants

    from rlhf_core.config import Config, ConfigError
    from rlhf_run.ray_backend import RayBackend

    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)  # Ray connects to 127.0.0.1 as given
    listener = socket.create_server(("127.0.0.1", 0), backlog=64)
    accepted: list[socket.socket] = []

    def accept() -> None:
        try:
            while True:
                accepted.append(listener.accept()[0])
        except OSError:  # the listener was closed
            pass

    threading.Thread(target=accept, daemon=True).start()
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    cfg = Config(launcher="ray")
    cfg.ray.address, cfg.ray.connect_timeout_s = address, 3.0
    launcher = RayBackend(cfg, tmp_path)
    t0 = time.monotonic()
    try:
        with pytest.raises(ConfigError) as err:
            launcher.connect()
        took = time.monotonic() - t0
        assert str(err.value).startswith(f"ray.address={address}: something accepts connections there but no Ray "
                                         "cluster answered"), err.value
        assert "ray start --head" in str(err.value) and "leave ray.address unset" in str(err.value)
        assert len(accepted) >= 2, "Ray never reached the listener (only the launcher's own probe did)"
        assert took < 3.0 + 5.0, f"took {took:.1f} s with ray.connect_timeout_s=3"
    finally:
        listener.close()
        for conn in accepted:
            conn.close()
        if ray.is_initialized():
            ray.shutdown()
