"""The one-command run: the default task learns, the monitor sees a live run,
multirun jobs get separate namespaces, standalone workers join, Ctrl-C leaves nothing behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from buffer import RunKeys
from buffer.keys import WORKERS_GROUP
from rlhf_core import metric_names as M
from servers import wait_for

pytestmark = [pytest.mark.integration]

BIN = Path(sys.executable).parent


def script(name: str) -> str:
    return str(BIN / name)


def base_overrides(cache: Path) -> list[str]:
    return [
        f"model.cache_dir={cache}",
        "run.progress=false",
        "rollout.slots=8",
        "learner.batch_size=16",
        "learner.micro_batch_size=16",
        "learner.checkpoint_every=2",
        "buffer.heartbeat_interval_s=0.5",
        "buffer.lease_timeout_s=3",
    ]


def child_env(**extra: str) -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)


def run_cmd(args: list[str], cwd: Path, timeout: float, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=child_env(), **kw)


def start_run(tmp_path: Path, out: Path, redis_url: str, run_id: str, cache: Path, *extra: str) -> subprocess.Popen:
    """`rlhf-run` in the background on the test's Redis, output captured (stdout and stderr)."""
    return subprocess.Popen(
        [script("rlhf-run"), f"hydra.run.dir={out}", *base_overrides(cache), f"buffer.url={redis_url}",
         f"buffer.run_id={run_id}", *extra],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env(),
    )




def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purposes
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_default_run_learns_and_reports(tmp_path, model_cache):
    """A smaller version of the README's main command: reward rises, summary and plots exist."""
    out = tmp_path / "out"
    # the default task at a higher learning rate, so 250 updates (~40 s) show it
    proc = run_cmd([script("rlhf-run"), f"hydra.run.dir={out}", f"model.cache_dir={model_cache}", "run.progress=false",
                    "learner.max_updates=250", "learner.lr=1e-3", "learner.checkpoint_every=50"], tmp_path, timeout=540)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 250
    assert summary["samples_trained"] == 250 * 32
    # random level is ~0.01 (one right digit in 99); the start is the mean of the first
    # updates, the end of the last ones
    assert summary["reward_start"] < 0.03, summary
    assert summary["reward_end"] > 3 * summary["reward_start"] and summary["reward_end"] > summary["reward_start"] + 0.03, summary
    assert summary["staleness_max"] <= 2
    assert "reward" in proc.stdout and "->" in proc.stdout
    for png in ("reward.png", "staleness.png", "throughput.png"):
        assert (out / png).stat().st_size > 1000, png
    assert (out / "logs" / "learner.log").exists() and (out / "logs" / "worker-0.log").exists()


@pytest.mark.timeout(300)
def test_monitor_snapshot_of_a_live_run_and_ctrl_c_leaves_nothing(tmp_path, redis_server, model_cache):
    from servers import free_port

    out = tmp_path / "out"
    run_id = "live-run"
    learner_port, worker_port = free_port(), free_port()
    proc = start_run(tmp_path, out, redis_server.url, run_id, model_cache, "learner.max_updates=100000",
                     "rollout.num_workers=2", f"learner.prometheus_port={learner_port}",
                     f"rollout.prometheus_port={worker_port}")
    try:
        r = redis.Redis.from_url(redis_server.url)

        def learner_version() -> int:
            v = r.get(RunKeys.for_run(run_id).version)
            return int(v or 0)

        wait_for(lambda: learner_version() >= 2, 180, "two learner updates")
        # Both workers must have reported generated tokens before the snapshot: on a loaded machine
        # one worker can start late, and two updates may be done by the other alone.
        from buffer import Buffer

        watch = Buffer(r, run_id=run_id)

        def workers_with_tokens() -> set[str]:
            consumers = watch.metrics()["consumers"]
            return {n for n, c in consumers.items() if n.startswith("worker-") and c["stats"].get(M.WORKER_TOKENS, 0) > 0}

        wait_for(lambda: workers_with_tokens() == {"worker-0", "worker-1"}, 180, "both workers generating")
        snap_proc = run_cmd([script("rlhf-monitor"), f"url={redis_server.url}", f"run_id={run_id}", "--once", "--json"],
                            tmp_path, timeout=60)
        assert snap_proc.returncode == 0, snap_proc.stderr
        snap = json.loads(snap_proc.stdout.strip().splitlines()[-1])
        assert snap["run_id"] == run_id
        assert snap["learner_version"] >= 2
        workers = {n: c for n, c in snap["consumers"].items() if n.startswith("worker-")}
        assert set(workers) == {"worker-0", "worker-1"}
        assert all(c["stats"][M.WORKER_TOKENS] > 0 for c in workers.values())
        # the fields the report and the monitor read, as the workers write them
        worker_fields = {M.WORKER_TOKENS, M.WORKER_SAMPLES, M.WORKER_TOKENS_PER_S, M.WORKER_SAMPLES_PER_S}
        assert all(worker_fields <= set(c["stats"]) for c in workers.values()), workers
        assert snap["counters"]["samples_consumed"] >= 2 * 16
        assert sum(snap["staleness_hist"].values()) == snap["counters"]["samples_consumed"]
        learner = snap["stats"][M.LEARNER_STATS]  # the same row as the learner's metrics.jsonl line
        assert learner[M.VERSION] >= 2
        read_by_the_app = {M.VERSION, M.UPDATES, M.SAMPLES_TRAINED, M.SAMPLES_PER_S, M.TOKENS_PER_S, M.TIME_WAIT_S,
                           M.TIME_COMPUTE_S, M.TIME_PUBLISH_S, M.TIME, M.REWARD_MEAN, M.STALENESS_MEAN,
                           M.STALENESS_MAX, M.STALENESS_HIST}
        assert read_by_the_app - set(learner) == set(), "the learner no longer writes what the report reads"
        assert any(k in learner for k in M.KL_KEYS), sorted(learner)
        pids = json.loads((out / "children.json").read_text())
        assert set(pids) == {"learner", "worker-0", "worker-1"}
        assert all(pid_alive(p) for p in pids.values())

        # Prometheus on the learner and on each worker (worker i on the port + i)
        import urllib.request

        def scrape(port: int) -> str:
            return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()

        assert "rlhf_learner_version" in wait_for(lambda: "rlhf_learner_version" in scrape(learner_port)
                                                  and scrape(learner_port), 30, "learner metrics")
        for i in range(2):
            body = wait_for(lambda: "rlhf_worker_tokens" in scrape(worker_port + i) and scrape(worker_port + i),
                            30, f"worker-{i} metrics")
            assert f'worker="worker-{i}"' in body

        # a crashed worker is reported and restarted; the run goes on
        prompts = RunKeys.for_run(run_id).prompts
        os.kill(pids["worker-0"], signal.SIGKILL)
        # its leases (id -> deliveries), frozen until they expire after buffer.lease_timeout_s (3 s)
        orphans = {row["message_id"]: row["times_delivered"]
                   for row in r.xpending_range(prompts, WORKERS_GROUP, "-", "+", 1000, consumername="worker-0")}

        def taken_over() -> bool:
            """Every lease the dead worker held is acked or delivered again, to a live worker."""
            for mid, deliveries in orphans.items():
                row = r.xpending_range(prompts, WORKERS_GROUP, mid, mid, 1)
                if row and row[0]["times_delivered"] <= deliveries:
                    return False
            return True

        new = wait_for(lambda: (p := json.loads((out / "children.json").read_text()))["worker-0"] != pids["worker-0"] and p,
                       60, "worker-0 restarted")
        wait_for(taken_over, 120, "the dead worker's leases to be taken over")
        v = learner_version()
        wait_for(lambda: learner_version() >= v + 2, 120, "updates after the restart")
        pids = new

        proc.send_signal(signal.SIGINT)  # Ctrl-C
        output, _ = proc.communicate(timeout=120)
        assert proc.returncode == 130, output[-3000:]
        assert "worker-0 exited with code -9; last lines of" in output  # the crash was reported with the log tail
        assert "restarting worker-0 (restart 1)" in output
        assert not [n for n, p in pids.items() if pid_alive(p)], "children left running"
        metrics = json.loads(run_cmd([script("rlhf-monitor"), f"url={redis_server.url}", f"run_id={run_id}",
                                      "--once", "--json"], tmp_path, timeout=60).stdout.splitlines()[-1])
        assert metrics["depth"]["prompts_leased"] == 0, "a lease was left behind"
        assert metrics["depth"]["samples_inflight"] == 0
        assert (out / "checkpoints").exists() and any((out / "checkpoints").iterdir()), "no final checkpoint"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("launcher", [[], ["hydra/launcher=joblib", "hydra.launcher.n_jobs=2"]], ids=["basic", "joblib"])
def test_multirun_jobs_get_separate_namespaces(tmp_path, redis_server, model_cache, launcher):
    sweep = tmp_path / "sweep"
    proc = run_cmd([script("rlhf-run"), "-m", *launcher, f"hydra.sweep.dir={sweep}", *base_overrides(model_cache),
                    f"buffer.url={redis_server.url}", "learner.max_updates=3", "rollout.num_workers=1",
                    "algo.max_staleness=0,2"], tmp_path, timeout=540)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summaries = [json.loads(p.read_text()) for p in sorted(sweep.glob("*/summary.json"))]
    assert [s["max_staleness"] for s in summaries] == [0, 2]
    assert all(s["steps"] == 3 for s in summaries)
    run_ids = {s["run_id"] for s in summaries}
    assert len(run_ids) == 2
    r = redis.Redis.from_url(redis_server.url)
    for run_id in run_ids:  # each job's keys live under its own prefix
        assert int(r.get(RunKeys.for_run(run_id).version)) == 3
    table = json.loads((sweep / "sweep_summary.json").read_text())
    assert [row["max_staleness"] for row in table] == [0, 2]
    assert "sweep comparison" in proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_standalone_workers_join_and_leave(tmp_path, redis_server, model_cache):
    """rlhf-run with no workers and external Redis; rlhf-worker processes join, one leaves."""
    out = tmp_path / "out"
    run_id = "standalone"
    run = start_run(tmp_path, out, redis_server.url, run_id, model_cache, "rollout.num_workers=0",
                    "learner.max_updates=6", "weight_server.port=0")
    workers: list[subprocess.Popen] = []
    try:
        cfg_path = wait_for(lambda: (out / "run_config.yaml").exists() and out / "run_config.yaml", 120, "run config")
        import yaml

        ws = yaml.safe_load(cfg_path.read_text())["weight_server"]
        r = redis.Redis.from_url(redis_server.url)
        version = lambda: int(r.get(RunKeys.for_run(run_id).version) or 0)  # noqa: E731
        time.sleep(2)
        assert version() == 0, "no worker yet, so no update can have happened"
        for i in range(2):
            workers.append(subprocess.Popen(
                [script("rlhf-worker"), *base_overrides(model_cache), f"buffer.url={redis_server.url}",
                 f"buffer.run_id={run_id}", f"weight_server.address={ws['address']}",
                 f"weight_server.pub_address={ws['pub_address']}", f"hydra.run.dir={tmp_path / f'w{i}'}"],
                cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                env=child_env(RLHF_WORKER_ID=f"ext-{i}")))
        wait_for(lambda: version() >= 2, 240, "updates from joined workers")
        consumers = lambda: {k.decode() for k in r.hkeys(RunKeys.for_run(run_id).consumers)}  # noqa: E731
        wait_for(lambda: {"ext-0", "ext-1"} <= consumers(), 120, "both external workers to join")
        workers[0].send_signal(signal.SIGTERM)  # one leaves; the run goes on
        assert workers[0].wait(timeout=60) == 0
        output, _ = run.communicate(timeout=300)
        assert run.returncode == 0, output[-3000:]
        summary = json.loads((out / "summary.json").read_text())
        assert summary["steps"] == 6
    finally:
        for p in workers + [run]:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_real_model_path_reward_model_and_jsonl_prompts(tmp_path, model_cache, tiny_model_cfg):
    """The same command with model.path=<local HF dir>, a reward-model directory and JSONL prompts."""
    from rlhf_core import models

    policy_dir = models.build_tiny_model(tiny_model_cfg.tiny, tmp_path / "policy", head="causal")
    rm_dir = models.build_tiny_model(tiny_model_cfg.tiny, tmp_path / "rm", head="sequence")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"say {w}:"}) + "\n" for w in ("hi", "yes", "ok", "no", "a", "b")))
    out = tmp_path / "out"
    proc = run_cmd([script("rlhf-run"), f"hydra.run.dir={out}", "run.progress=false", "model=hf",
                    f"model.path={policy_dir}", "model.dtype=float32", "model.device=cpu", "data=jsonl",
                    f"data.path={prompts}", "reward=model", f"reward.models.rm.path={rm_dir}",
                    "learner.max_updates=3", "learner.batch_size=16", "learner.micro_batch_size=16",
                    "rollout.num_workers=1", "rollout.max_new_tokens=8", f"learner.export_dir={tmp_path / 'export'}"],
                   tmp_path, timeout=540)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["samples_trained"] == 48
    rows = [json.loads(line) for line in (out / M.METRICS_FILE).read_text().splitlines()]
    assert all("reward/rm" in r for r in rows), rows[0].keys()  # the reward model's component
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    assert exported.config.vocab_size == 99



@pytest.mark.timeout(300)
def test_a_crashed_learner_without_restarts_left_fails_the_run_and_stops_everything(tmp_path, redis_server, model_cache):
    out = tmp_path / "out"
    run_id = "learner-crash"
    proc = start_run(tmp_path, out, redis_server.url, run_id, model_cache, "learner.max_updates=100000",
                     "rollout.num_workers=1", "run.learner_restarts=0")
    try:
        r = redis.Redis.from_url(redis_server.url)
        wait_for(lambda: int(r.get(RunKeys.for_run(run_id).version) or 0) >= 1, 180, "a learner update")
        pids = json.loads((out / "children.json").read_text())
        os.kill(pids["learner"], signal.SIGKILL)
        output, _ = proc.communicate(timeout=120)
        assert proc.returncode == 1, output[-3000:]
        assert "learner crashed (exit -9); last lines of" in output
        assert "learner exited with code -9" in output  # the summary names why the run ended
        assert not [n for n, p in pids.items() if pid_alive(p)], "children left running"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.timeout(120)
def test_an_unimportable_reward_stops_the_run_before_anything_starts(tmp_path, model_cache):
    # once: each worker exited on it in turn, then the run idled with no workers
    out = tmp_path / "out"
    proc = run_cmd([script("rlhf-run"), f"hydra.run.dir={out}", *base_overrides(model_cache),
                    "+reward.functions.typo._target_=rlhf_core.tasks.no_such_reward"], tmp_path, timeout=60)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "reward.functions.typo._target_='rlhf_core.tasks.no_such_reward' cannot be imported" in proc.stderr
    assert not (out / "children.json").exists()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_corrupt_control_state_stops_the_run_naming_the_key(tmp_path, redis_server, model_cache):
    # once: workers crash-looped on a Lua error ("attempt to perform arithmetic on a nil value")
    out = tmp_path / "out"
    run_id = "corrupt-run"
    proc = start_run(tmp_path, out, redis_server.url, run_id, model_cache, "learner.max_updates=100000",
                     "rollout.num_workers=1")
    try:
        r = redis.Redis.from_url(redis_server.url)
        keys = RunKeys.for_run(run_id)
        wait_for(lambda: int(r.get(keys.version) or 0) >= 1, 180, "a learner update")
        pids = json.loads((out / "children.json").read_text())
        r.hset(keys.counters, "admitted", "abc")
        output, _ = proc.communicate(timeout=60)
        assert proc.returncode != 0, output[-3000:]
        assert f"{keys.counters} admitted holds 'abc'" in output, output[-3000:]
        assert "Traceback" not in output[-1500:]
        assert not [n for n, p in pids.items() if pid_alive(p)], "children left running"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


class Lines:
    """A child's merged output, read on a thread so the test can wait on single lines."""

    def __init__(self, proc: subprocess.Popen) -> None:
        import threading

        self.lines: list[str] = []
        self.thread = threading.Thread(target=lambda: self.lines.extend(iter(proc.stdout.readline, "")), daemon=True)
        self.thread.start()

    def find(self, text: str) -> str | None:
        return next((line for line in list(self.lines) if text in line), None)

    def after(self, text: str) -> str | None:
        lines = list(self.lines)
        i = next((i for i, line in enumerate(lines) if text in line), None)
        return lines[i + 1].strip() if i is not None and i + 1 < len(lines) else None


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_redis_down_supervision_goes_on_and_the_printed_command_brings_the_data_back(tmp_path, model_cache):
    import re
    import shlex

    out = tmp_path / "out"
    proc = subprocess.Popen(
        [script("rlhf-run"), f"hydra.run.dir={out}", *base_overrides(model_cache), "learner.max_updates=100000",
         "rollout.num_workers=1", "buffer.max_retry_s=120"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env())
    lines = Lines(proc)
    restarted = None
    try:
        wait_for(lambda: lines.find("started private redis-server pid"), 120, "the launcher's Redis")
        redis_pid, url = re.search(r"pid (\d+) at (\S+)", lines.find("started private redis-server pid")).groups()
        r = redis.Redis.from_url(url)
        wait_for(lambda: lines.find(": output in"), 120, "the run line")
        run_id = re.search(r"run (\S+): output in", lines.find(": output in")).group(1)
        version_key = RunKeys.for_run(run_id).version
        wait_for(lambda: int(r.get(version_key) or 0) >= 2, 180, "learner updates")
        os.kill(int(redis_pid), signal.SIGKILL)
        # the launcher still supervises: a worker killed while Redis is down is restarted
        pids = json.loads((out / "children.json").read_text())
        os.kill(pids["worker-0"], signal.SIGKILL)
        wait_for(lambda: json.loads((out / "children.json").read_text())["worker-0"] != pids["worker-0"], 30,
                 "worker-0 restarted while Redis is down")
        wait_for(lambda: lines.after("restart it on the same data with:"), 40, "the restart command")
        command = lines.after("restart it on the same data with:")
        assert "--appendonly yes" in command and "--dir" in command and f"--port {url.rsplit(':', 1)[1].split('/')[0]}" in command
        restarted = subprocess.Popen(shlex.split(command), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)
        wait_for(lambda: _ping(r), 30, "Redis back")
        back_at = int(r.get(version_key) or 0)
        assert back_at >= 2, "the append-only file did not bring the run's state back"
        wait_for(lambda: int(r.get(version_key) or 0) >= back_at + 3, 180, "training to go on after the outage")
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if restarted is not None and restarted.poll() is None:
            restarted.kill()
            restarted.wait()


def _ping(r: redis.Redis) -> bool:
    try:
        return bool(r.ping())
    except redis.exceptions.ConnectionError:
        return False


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_killed_learner_is_restarted_from_its_checkpoint_and_the_run_finishes(tmp_path, redis_server, model_cache):
    # once: the launcher restarted a killed worker in 0.3 s but ended the run when the learner died
    out = tmp_path / "out"
    proc = start_run(tmp_path, out, redis_server.url, "learner-restart", model_cache, "learner.max_updates=24",
                     "rollout.num_workers=1")
    try:
        r = redis.Redis.from_url(redis_server.url)
        wait_for(lambda: int(r.get(RunKeys.for_run("learner-restart").version) or 0) >= 5, 180, "learner updates")
        first = json.loads((out / "children.json").read_text())["learner"]
        os.kill(first, signal.SIGKILL)
        output, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, output[-3000:]
        assert "restarting the learner from its last checkpoint (restart 1 of 3)" in output
        assert "resumed from checkpoint at version" in (out / "logs" / "learner.log").read_text()
        summary = json.loads((out / "summary.json").read_text())
        assert summary["steps"] == 24 and summary["exit_reason"] == "learner finished", summary
        assert summary["dead_letters"] == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.timeout(180)
def test_a_run_with_no_worker_left_fails_with_the_last_workers_exit(tmp_path, model_cache):
    # once: the run idled for ever once its workers were gone
    out = tmp_path / "out"
    tests_dir = str(Path(__file__).resolve().parents[1])  # reward_fns, for the launcher and its worker
    env = child_env(PYTHONPATH=os.pathsep.join(filter(None, [tests_dir, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([script("rlhf-run"), f"hydra.run.dir={out}", *base_overrides(model_cache), "rollout.num_workers=1",
                           "rollout.restart_on_crash=false", "~reward.functions.count_up",
                           "+reward.functions.exit._target_=reward_fns.exit_process"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=150, env=env)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "run failed: no worker left: worker-0 exited with code 3" in proc.stderr
