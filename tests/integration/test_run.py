"""The one-command run: the default task learns, the monitor sees a live run,
multirun jobs get separate namespaces, standalone workers join, Ctrl-C leaves nothing behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from omegaconf import OmegaConf

from buffer import RunKeys
from buffer.keys import WORKERS_GROUP
from rlhf_core import metric_names as M
from rlhf_run.progress import read_timeline
from rlhf_run.summary import read_metrics
from servers import wait_for
from test_chaos import RESTORED, SETTLE

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


def pending(r: redis.Redis, run_id: str, consumer: str) -> dict[str, int]:
    """The leases ``consumer`` holds: lease id -> deliveries so far."""
    rows = r.xpending_range(RunKeys.for_run(run_id).prompts, WORKERS_GROUP, "-", "+", 1000, consumername=consumer)
    return {row["message_id"]: row["times_delivered"] for row in rows}


def leases_taken_over(r: redis.Redis, run_id: str, consumer: str, pid: int,
                      held: dict[str, int] | None = None) -> Callable[[], bool]:
    """Call once ``consumer``'s process ``pid`` was killed: waits until the process is gone (a
    worker whose node was removed under it runs on for a moment, and may claim more), then returns
    a predicate, true once every lease it held (``held``: seen before the kill, :func:`pending`;
    and those it holds once gone) is acked or delivered again, to a live worker."""
    wait_for(lambda: not pid_alive(pid), 60, f"{consumer}'s process {pid} to be gone")
    prompts = RunKeys.for_run(run_id).prompts
    orphans = {**(held or {}), **pending(r, run_id, consumer)}  # id -> deliveries

    def taken_over() -> bool:
        for mid, deliveries in orphans.items():
            row = r.xpending_range(prompts, WORKERS_GROUP, mid, mid, 1)
            if row and row[0]["times_delivered"] <= deliveries:
                return False
        return True

    return taken_over


def exposition(port: int) -> str:
    import urllib.request

    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()


def scrape(port: int) -> dict:
    """The target's families by name, parsed with prometheus_client's own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    return {f.name: f for f in text_string_to_metric_families(exposition(port))}


def sample(families: dict, family: str, kind: str, name: str, **labels: str) -> float:
    """The value of sample ``name`` of ``family`` (of type ``kind``) with these labels; 0 when absent."""
    fam = families.get(family)
    if fam is None:
        return 0.0
    assert fam.type == kind, (family, fam.type)
    return sum(s.value for s in fam.samples if s.name == name and labels.items() <= s.labels.items())


def check_prometheus_targets(tmp_path: Path, redis_url: str, run_id: str, learner_port: int, worker_port: int,
                             run_port: int) -> None:
    """The learner's, each worker's (worker i on the port + i) and the run's target (served by
    rlhf-run, and by rlhf-monitor): a counter, a histogram and a gauge each, with their labels."""
    learner = wait_for(lambda: (f := scrape(learner_port)) and sample(
        f, "rlhf_learner_staleness_versions", "histogram", "rlhf_learner_staleness_versions_count") > 0 and f,
        30, "the learner's staleness histogram")
    assert sample(learner, "rlhf_learner_updates", "counter", "rlhf_learner_updates_total", run=run_id) >= 2
    assert sample(learner, "rlhf_learner_version", "gauge", "rlhf_learner_version") >= 2
    for i in range(2):
        worker = wait_for(lambda i=i: (f := scrape(worker_port + i)) and sample(
            f, "rlhf_worker_generation_seconds", "histogram", "rlhf_worker_generation_seconds_count") > 0 and f,
            30, f"worker-{i}'s generation latencies")
        labels = {"worker": f"worker-{i}", "run": run_id}
        assert sample(worker, "rlhf_worker_tokens", "counter", "rlhf_worker_tokens_total", **labels) > 0
        assert sample(worker, "rlhf_worker_weight_sync_seconds", "histogram", "rlhf_worker_weight_sync_seconds_count") >= 1
        assert sample(worker, "rlhf_worker_uptime_seconds", "gauge", "rlhf_worker_uptime_seconds", **labels) > 0

    def run_target(port: int) -> dict | None:
        """The run's target once its snapshot has two updates' samples consumed and both workers'
        tokens (it is refreshed once a second; the one before may predate a worker's heartbeat)."""
        try:
            families = scrape(port)
        except OSError:  # rlhf-monitor not listening yet
            return None
        consumed = sample(families, "rlhf_run_samples_consumed", "counter", "rlhf_run_samples_consumed_total", run=run_id)
        tokens = [sample(families, "rlhf_run_worker_tokens", "counter", "rlhf_run_worker_tokens_total", worker=f"worker-{i}")
                  for i in range(2)]
        return families if consumed >= 32 and all(tokens) else None

    run = wait_for(lambda: run_target(run_port), 30, "the run's target")
    assert sample(run, "rlhf_run_staleness_versions", "histogram", "rlhf_run_staleness_versions_count") >= 32
    assert "rlhf_run_depth_samples_in_buffer" in run and run["rlhf_run_depth_samples_in_buffer"].type == "gauge"
    # every live target follows Prometheus's naming rules (and promtool agrees, where it is installed)
    from promlint import lint, promtool

    for port in (learner_port, worker_port, worker_port + 1, run_port):
        text = exposition(port)
        assert lint(text) == [] and promtool(text) in (None, []), (port, lint(text), promtool(text))
    # rlhf-monitor serves the same target for a run it watches
    from servers import free_port

    monitor_port = free_port()
    log = (tmp_path / "monitor.log").open("w")
    monitor = subprocess.Popen([script("rlhf-monitor"), f"url={redis_url}", f"run_id={run_id}",
                                f"prometheus_port={monitor_port}"], cwd=tmp_path, stdout=subprocess.DEVNULL,
                               stderr=log, env=dict(child_env(), PYTHONFAULTHANDLER="1"))
    try:
        def up() -> dict | None:
            assert monitor.poll() is None, (tmp_path / "monitor.log").read_text()[-2000:]
            return run_target(monitor_port)

        watched = wait_for(up, 60, "rlhf-monitor's Prometheus target")
        assert sample(watched, "rlhf_run_version", "gauge", "rlhf_run_version", run=run_id) >= 2
    finally:
        monitor.send_signal(signal.SIGINT)
        try:
            code = monitor.wait(timeout=30)
        except subprocess.TimeoutExpired:  # SIGABRT: faulthandler writes every thread's stack to the log
            monitor.send_signal(signal.SIGABRT)
            monitor.wait(timeout=30)
            code = "still running 30 s after SIGINT"
        log.close()
        assert code == 0, (tmp_path / "monitor.log").read_text()[-4000:]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_default_run_learns_and_reports(tmp_path, model_cache):
    """A smaller version of the default run: reward rises, summary and plots exist;
    the held-out evaluation every 50 versions reaches eval.jsonl, metrics.jsonl, TensorBoard and
    the summary."""
    out = tmp_path / "out"
    # the default task at a higher learning rate, so 250 updates (~40 s) show it
    proc = run_cmd([script("rlhf-run"), f"hydra.run.dir={out}", f"model.cache_dir={model_cache}", "run.progress=false",
                    "learner.max_updates=250", "learner.lr=1e-3", "learner.checkpoint_every=50",
                    "eval.every=50", "eval.n=4", "eval.k=[1,4]", "eval.num_prompts=20", "run.loggers=[tensorboard]"],
                   tmp_path, timeout=540)
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
    # per-version chatter stays in the weight server's own log; once it was 2,500 console lines
    console = proc.stdout + proc.stderr
    assert "published policy" not in console and "applied policy" not in console
    ws_log = (out / "logs" / "weight-server.log").read_text()
    assert "published policy v250" in ws_log and "applied policy v" in ws_log
    assert len(console.splitlines()) < 40, console
    # evaluation: version 0 (or the first the evaluator saw), then each at or past the next multiple of 50
    evals = [json.loads(line) for line in (out / M.EVAL_FILE).read_text().splitlines()]
    versions = [e[M.EVAL_VERSION] for e in evals]
    assert len(evals) >= 3 and all(b >= (a // 50 + 1) * 50 for a, b in zip(versions, versions[1:])), versions
    assert all(e["eval/samples"] == 20 * 4 and e["eval/failed"] == 0 for e in evals), evals
    assert all(0 <= e["eval/pass@1"] <= e["eval/pass@4"] <= 1 for e in evals), evals
    assert evals[-1][M.EVAL_REWARD_MEAN] > evals[0][M.EVAL_REWARD_MEAN], versions
    merged = {r[M.EVAL_VERSION] for r in read_metrics(out) if M.EVAL_VERSION in r}
    assert merged and merged <= set(versions), (merged, versions)  # the learner copied evaluations into its rows
    assert summary_eval(out)["evaluations"] == len(evals) and "eval: reward" in proc.stdout
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars = EventAccumulator(str(out / "tensorboard")).Reload().Scalars(M.EVAL_REWARD_MEAN)
    assert len(scalars) == len(merged)


def summary_eval(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())["eval"]


@pytest.mark.timeout(300)
def test_monitor_snapshot_of_a_live_run_and_ctrl_c_leaves_nothing(tmp_path, redis_server, model_cache):
    from servers import free_port, free_port_block

    out = tmp_path / "out"
    run_id = "live-run"
    learner_port, worker_port, run_port = free_port(), free_port_block(2), free_port()  # worker i serves on worker_port + i
    proc = start_run(tmp_path, out, redis_server.url, run_id, model_cache, "learner.max_updates=100000",
                     "rollout.num_workers=2", f"learner.prometheus_port={learner_port}",
                     f"rollout.prometheus_port={worker_port}", f"run.prometheus_port={run_port}")
    try:
        r = redis.Redis.from_url(redis_server.url)

        def learner_version() -> int:
            v = r.get(RunKeys.for_run(run_id).version)
            return int(v or 0)

        wait_for(lambda: learner_version() >= 2, 180, "two learner updates")
        # Both workers must have reported generated tokens before the snapshot: on a loaded machine
        # one worker can start late, and two updates may be done by the other alone.
        from buffer import MonitorClient, Store

        watch = MonitorClient(Store(r, run_id=run_id))

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
                           M.TIME_READ_S, M.TIME_COMPUTE_S, M.TIME_PUBLISH_S, M.TIME, M.REWARD_MEAN, M.STALENESS_MEAN,
                           M.STALENESS_MAX, M.STALENESS_HIST, *M.METRIC_HELP}
        assert read_by_the_app - set(learner) == set(), "the learner no longer writes what the report reads"
        assert any(k in learner for k in M.KL_KEYS), sorted(learner)
        pids = json.loads((out / "children.json").read_text())
        assert set(pids) == {"launcher", "learner", "worker-0", "worker-1"}  # Redis is the test's here
        assert all(pid_alive(p) for p in pids.values())

        check_prometheus_targets(tmp_path, redis_server.url, run_id, learner_port, worker_port, run_port)

        # a crashed worker is reported and restarted; the run goes on
        os.kill(pids["worker-0"], signal.SIGKILL)
        taken_over = leases_taken_over(r, run_id, "worker-0", pids["worker-0"])
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


def readme_block(after: str) -> list[list[str]]:
    """The commands of docs/cluster.md's first bash block after ``after`` (continuations joined, comments dropped)."""
    import shlex

    text = (Path(__file__).resolve().parents[2] / "docs" / "cluster.md").read_text()
    block = text[text.index(after):].split("```bash\n", 1)[1].split("```", 1)[0]
    lines = block.replace("\\\n", " ").splitlines()
    return [shlex.split(line) for line in lines if line.strip() and not line.lstrip().startswith("#")]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_standalone_workers_join_and_leave_as_the_readme_says(tmp_path, model_cache):
    """docs/cluster.md's standalone-workers commands, run as written (loopback for 10.0.0.5, free ports):
    Redis with a password, CURVE keys, rlhf-run with no workers; rlhf-worker processes join, one leaves."""
    import re

    from servers import free_port_block

    # below the ephemeral range, where no outgoing connection takes them meanwhile (once Redis
    # found its port taken and the test waited for it in vain)
    redis_port = free_port_block(3)
    port, pub_port = redis_port + 1, redis_port + 2
    swap = {"10.0.0.5": "127.0.0.1", "6379": str(redis_port), "5555": str(port), "5556": str(pub_port),
            "/var/lib/rlhf-redis": str(tmp_path / "redis")}
    swapped = re.compile("|".join(map(re.escape, swap)))  # in one pass: a new port holds no old one's digits

    def as_here(cmd: list[str]) -> list[str]:
        cmd = [swapped.sub(lambda m: swap[m.group(0)], arg) for arg in cmd]
        return [script(cmd[0]) if cmd[0].startswith("rlhf-") else cmd[0], *cmd[1:]]

    mkdir_cmd, redis_cmd, keys_cmd, run_cmd_, worker_cmd = [as_here(c) for c in readme_block("## Standalone workers")]
    assert mkdir_cmd[0] == "mkdir" and redis_cmd[0] == "redis-server" and keys_cmd[1:] == ["--gen-keys", "keys/"]
    assert run_cmd(mkdir_cmd, tmp_path, timeout=10).returncode == 0
    out, run_id = tmp_path / "out", "exp1"
    redis_log = tmp_path / "redis.out"
    with redis_log.open("w") as log_file:
        redis_proc = subprocess.Popen(redis_cmd, cwd=tmp_path, stdout=log_file, stderr=subprocess.STDOUT,
                                      start_new_session=True)
    procs: list[subprocess.Popen] = [redis_proc]
    try:
        r = redis.Redis(port=redis_port, password="SECRET")
        wait_for(lambda: _ping(r) or redis_proc.poll() is not None, 30, "the documented Redis")
        assert redis_proc.poll() is None, f"the documented redis-server exited: {redis_log.read_text()[-2000:]}"
        assert run_cmd(keys_cmd, tmp_path, timeout=60).returncode == 0
        run = subprocess.Popen([*run_cmd_, f"hydra.run.dir={out}", *base_overrides(model_cache), "learner.max_updates=6"],
                               cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env())
        procs.append(run)
        wait_for(lambda: (out / "run_config.yaml").exists(), 120, "run config")
        version = lambda: int(r.get(RunKeys.for_run(run_id).version) or 0)  # noqa: E731
        time.sleep(2)
        assert version() == 0, "no worker yet, so no update can have happened"
        for i in range(2):
            procs.append(subprocess.Popen(
                [*worker_cmd, *base_overrides(model_cache), f"hydra.run.dir={tmp_path / f'w{i}'}"],
                cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=child_env(RLHF_WORKER_ID=f"ext-{i}")))
        wait_for(lambda: version() >= 2, 240, "updates from joined workers")
        consumers = lambda: {k.decode() for k in r.hkeys(RunKeys.for_run(run_id).consumers)}  # noqa: E731
        wait_for(lambda: {"ext-0", "ext-1"} <= consumers(), 120, "both external workers to join")
        procs[2].send_signal(signal.SIGTERM)  # one leaves; the run goes on
        assert procs[2].wait(timeout=60) == 0
        output, _ = run.communicate(timeout=300)
        assert run.returncode == 0, output[-3000:]
        summary = json.loads((out / "summary.json").read_text())
        assert summary["steps"] == 6
    finally:
        for p in reversed(procs):
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



@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_run_with_a_trl_style_reward_and_an_llm_judge_over_http_shows_what_scoring_costs(tmp_path, model_cache):
    """JSONL prompts with a `reference` column, scored by a TRL-style batched function and by an LLM
    judge (a stub of the chat API on loopback, both reading the column); the scoring share and the
    reward calls/s reach the console, summary.json and the worker's start-up line."""
    from chat_stub import ChatStub

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{d}:", "reference": "".join(str((d + k) % 10) for k in range(1, 7))})
                               + "\n" for d in range(8)))
    out = tmp_path / "out"
    tests_dir = str(Path(__file__).resolve().parents[1])  # reward_fns, for the launcher and its worker
    env = child_env(PYTHONPATH=os.pathsep.join(filter(None, [tests_dir, os.environ.get("PYTHONPATH")])))
    with ChatStub() as stub:
        proc = subprocess.run(
            [script("rlhf-run"), f"hydra.run.dir={out}", *base_overrides(model_cache), "rollout.num_workers=1",
             "learner.max_updates=6", "data=jsonl", f"data.path={prompts}", "reward.num_threads=2",
             "+reward.functions.ref._target_=reward_fns.trl_reference",
             "+reward.functions.judge._target_=rollout_workers.rewards_remote.ChatJudge",
             f"+reward.functions.judge.url={stub.url}", "+reward.functions.judge.model=match",
             "+reward.functions.judge.template='{reference}|{response}'", "+reward.functions.judge.scale=0.1"],
            cwd=tmp_path, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["samples_trained"] == 6 * 16
    rows = read_metrics(out)
    assert all("reward/ref" in r and "reward/judge" in r for r in rows), rows[0].keys()
    assert all(r["reward/judge"] >= 0 and r["reward/ref"] >= 0 for r in rows)
    asked = [r["body"]["messages"][-1]["content"] for r in stub.requests]
    assert len(asked) >= 6 * 16 - summary["rewards"]["empty_responses"]  # every non-empty sample trained was judged
    assert all(len(a.split("|")[0]) == 6 and a.split("|")[0].isdigit() for a in asked)  # the reference reached it
    rewards = summary["rewards"]
    assert 0 < rewards["scoring_share"] <= 1 and rewards["reward_calls_per_s"] > 0 and rewards["reward_timeouts"] == 0
    assert "rewards: scoring busy" in proc.stdout and "reward calls/s" in proc.stdout
    log = (out / "logs" / "worker-0.log").read_text()
    assert "rewards ref (batched), judge (batched): 2 scoring thread(s) (reward.num_threads)" in log
    assert "torch thread(s) (OMP_NUM_THREADS" in log


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


@pytest.mark.parametrize("overrides, message", [
    ("model=hf", "model=hf needs model.path=/local/hf/dir"),
    ("data=jsonl", "data.source=jsonl needs data.path="),
    ("data=jsonl data.path=typo.jsonl", "data.path 'typo.jsonl' does not exist (data.source=jsonl; a relative path is "
                                        "read from the current folder, "),
    ("eval.every=5 eval.data.source=jsonl eval.data.path=/no/held_out.jsonl",
     "eval.data.path '/no/held_out.jsonl' does not exist (eval.data.source=jsonl)"),
])
def test_a_required_path_left_out_stops_the_run_before_anything_starts(overrides, message, tmp_path, model_cache):
    # once: Redis, the weight server and three children started, and a child log said why ~10 s later
    out = tmp_path / "out"
    proc = run_cmd([script("rlhf-run"), f"hydra.run.dir={out}", *base_overrides(model_cache), *overrides.split()],
                   tmp_path, timeout=60)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert message in proc.stderr
    assert not (out / "children.json").exists()


@pytest.mark.parametrize("mode", ["run", "sweep"])
def test_an_output_folder_that_cannot_be_made_stops_the_run_with_one_line(mode, tmp_path, model_cache):
    # once: Hydra's traceback of the mkdir (PermissionError, NotADirectoryError), exit 1
    (tmp_path / "a_file").write_text("")
    folder = tmp_path / "a_file" / "out"
    proc = run_cmd([script("rlhf-run"), *(["-m"] if mode == "sweep" else []), f"hydra.{mode}.dir={folder}",
                    *base_overrides(model_cache)], tmp_path, timeout=60)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        f"error: cannot write the output folder {folder}: {tmp_path / 'a_file'} is not a folder; start it in a "
        f"folder you can write to, or give hydra.{mode}.dir=/a/folder/you/can/write"], proc.stderr


def test_resuming_a_folder_that_is_not_a_run_writes_nothing_there(tmp_path, model_cache):
    # once: Hydra made the folder (a typo's too) and wrote .hydra/ and cli.log into it before the
    # run said it was not a run: `resume=.` littered the current folder
    (tmp_path / "mine").mkdir()
    for folder in (tmp_path / "mine", tmp_path / "typo"):
        proc = run_cmd([script("rlhf-run"), f"resume={folder}", *base_overrides(model_cache)], tmp_path, timeout=60)
        assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
        assert f"error: resume={folder}: {folder}/launch_config.yaml does not exist" in proc.stderr
    assert not (tmp_path / "typo").exists() and list((tmp_path / "mine").iterdir()) == []


@pytest.mark.timeout(120)
def test_a_redis_nothing_answers_at_stops_the_run_before_anything_starts(tmp_path, model_cache):
    # once: the learner and each worker retried for buffer.connect_timeout_s, were restarted, and
    # the run failed after some 90 s of retry lines
    from servers import free_port

    out, port = tmp_path / "out", free_port()
    proc = run_cmd([script("rlhf-run"), f"hydra.run.dir={out}", *base_overrides(model_cache),
                    f"buffer.url=redis://127.0.0.1:{port}", "buffer.connect_timeout_s=1"], tmp_path, timeout=60)
    assert proc.returncode == 75, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"error: cannot reach Redis at 127.0.0.1:{port}" in proc.stderr and "fix buffer.url" in proc.stderr
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
def test_a_killed_learner_is_restarted_from_its_checkpoint_and_the_run_finishes(tmp_path, redis_server, model_cache,
                                                                                 monkeypatch):
    # once: the launcher restarted a killed worker in 0.3 s but ended the run when the learner died
    out = tmp_path / "out"
    proc = start_run(tmp_path, out, redis_server.url, "learner-restart", model_cache, "learner.max_updates=24",
                     "rollout.num_workers=1", "run.loggers=[tensorboard,mlflow,wandb]", "run.wandb_mode=offline",
                     "run.log_samples_every=4")
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
        # the trackers' run ids came back from the checkpoint: one MLflow run and one wandb id, every step
        from mlflow.tracking import MlflowClient

        monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # as the learner sets it for its own folder
        client = MlflowClient((out / "mlruns").as_uri())
        [run] = client.search_runs([client.get_experiment_by_name("rlhf-service").experiment_id])
        # every update of both learner processes (the step is the version, which jumps past those published before the crash)
        updates = {m.value for m in client.get_metric_history(run.info.run_id, "learner/updates")}
        assert updates == set(range(1, 25)), sorted(updates)
        assert client.list_artifacts(run.info.run_id, "samples")
        wandb_ids = {p.name.split("-")[3] for p in (out / "wandb").glob("offline-run-*")}
        assert len(wandb_ids) == 1 and len(list((out / "wandb").glob("offline-run-*"))) == 2
        assert any((out / "tensorboard").glob("events.out.tfevents.*"))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_resume_after_the_whole_launcher_is_killed_loses_nothing_and_trains_nothing_twice(tmp_path, model_cache):
    """rlhf-run with its private Redis SIGKILLed mid-run (launcher only: its children and Redis
    must die with it), then `rlhf-run resume=<folder>`: the same run id, the Redis data of the
    folder and the learner's checkpoint carry it to its budget; the buffer's counters audit it.
    Killed between checkpoints (every 10 updates), the resumed learner numbers its restored
    weights past the version the buffer holds: pacing counts the updates, so a few updates later
    stale drops stay at most 2% of generated (paced by the version, the surplus never drained)."""
    out = tmp_path / "out"
    with (tmp_path / "first.log").open("w") as log_file:  # a budget out of reach: the kill ends it
        first = subprocess.Popen([script("rlhf-run"), f"hydra.run.dir={out}", *base_overrides(model_cache),
                                  "learner.max_updates=100000", "learner.checkpoint_every=10"],
                                 cwd=tmp_path, stdout=log_file, stderr=subprocess.STDOUT, env=child_env())
    try:
        metrics = out / M.METRICS_FILE
        wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 2, 240, "2 updates")
        busy = run_cmd([script("rlhf-run"), f"resume={out}"], tmp_path, timeout=60)
        assert busy.returncode == 2 and "is still running" in busy.stderr, busy.stderr[-2000:]
        pids = json.loads((out / "children.json").read_text())
        assert set(pids) == {"launcher", "redis", "learner", "worker-0", "worker-1"}
        # between checkpoints (3 to 6 updates past one: the learner is far from the next)
        wait_for(lambda: (n := len(metrics.read_text().splitlines())) > 10 and n % 10 in (3, 4, 5, 6), 240,
                 "updates past a checkpoint")
        os.kill(first.pid, signal.SIGKILL)
        first.wait(timeout=30)
        wait_for(lambda: not [n for n, p in pids.items() if pid_alive(p)], 30, "the run's processes to die with the launcher")
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert (out / "redis" / "appendonlydir").is_dir()
    run_id = OmegaConf.load(out / "launch_config.yaml").buffer.run_id
    # a new budget, given with resume=: long enough that the timeline (a snapshot a second) still
    # samples the window from SETTLE updates after the restart when a quiet machine trains 35 a second
    updates = max(row[M.UPDATES] for row in read_metrics(out)) + 100

    resumed = run_cmd([script("rlhf-run"), f"resume={out}", f"learner.max_updates={updates}"], tmp_path, timeout=400)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"resuming run {run_id} in {out}" in resumed.stdout
    assert "continuing on the run's Redis data" in (out / "cli.log").read_text()  # the resumed launcher logs here too
    restored = RESTORED.search((out / "logs" / "learner.log").read_text())
    assert restored, (out / "logs" / "learner.log").read_text()[-3000:]  # renumbered past the buffer's version
    # from a few updates after the restored weights' version to the end, from the run's timeline
    counts = [(snap["learner_version"], snap["counters"]) for snap in read_timeline(out / "timeline.jsonl")]
    start = next(c for v, c in counts if v >= int(restored[2]) + SETTLE)
    end = counts[-1][1]
    generated, stale = (end[k] - start[k] for k in ("samples_appended", "samples_dropped_stale"))
    assert generated >= 10 * 16 and stale <= 0.05 * generated, (start, end)  # the bound: see test_chaos.py
    assert not (tmp_path / "outputs").exists()  # no new folder for the resumed launcher
    assert not (out / "redis").exists()  # a clean finish removes the Redis data
    # Hydra's record of the first launch stays; the resume's command is kept beside it (once: overwritten)
    assert "learner.max_updates=100000" in (out / ".hydra" / "overrides.yaml").read_text()
    records = sorted((out / ".hydra").glob("resume-*/overrides.yaml"))  # the refused resume's too
    assert len(records) == 2 and f"learner.max_updates={updates}" in records[-1].read_text(), records
    summary = json.loads((out / "summary.json").read_text())
    c = summary["buffer_counters"]
    assert (summary["run_id"], summary["steps"]) == (run_id, updates)
    # samples the killed learner's last, uncheckpointed version generated are trained, not
    # dead-lettered as "newer than the learner" (the resumed learner numbers its weights above them)
    assert summary["dead_letters"] == 0, (out / "logs" / "learner.log").read_text()[-3000:]
    # the weights hold exactly what the buffer handed out and acked: an update lost with the
    # launcher is trained again from the checkpoint, a batch trained twice would break this
    assert summary["samples_trained"] == updates * 16 == c["samples_consumed"], (summary, c)
    assert c["groups_removed"] == c["groups_consumed"] + c["groups_dropped_stale"], c

    # a finished run trains on when given a larger budget: a fresh Redis, the prompts from the checkpoint's cursor
    more = run_cmd([script("rlhf-run"), f"resume={out}", f"learner.max_updates={updates + 4}"], tmp_path, timeout=300)
    assert more.returncode == 0, more.stdout[-3000:] + more.stderr[-3000:]
    assert "a fresh buffer: prompts go on from the checkpoint's cursor" in (out / "logs" / "learner.log").read_text()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["samples_trained"] == (updates + 4) * 16
    # paced from the checkpoint's updates: the 4 batches and the lookahead's, at most 8 x 16 with
    # slack (from 0 admitted on the fresh Redis, about `updates` batches were generated at once)
    assert summary["buffer_counters"]["samples_appended"] <= 8 * 16, summary["buffer_counters"]


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


@pytest.mark.timeout(180)
def test_a_learner_stopped_by_an_error_a_user_must_fix_fails_the_run_and_says_so_last(tmp_path, model_cache):
    # once: the error scrolled by mid-output, then a summary of n/a and "continue the run with:
    # rlhf-run resume=...", which would only repeat the error
    out, prompts = tmp_path / "out", tmp_path / "prompts.jsonl"
    prompts.write_text("")
    proc = run_cmd([script("rlhf-run"), f"hydra.run.dir={out}", *base_overrides(model_cache), "rollout.num_workers=1",
                    "data=jsonl", f"data.path={prompts}"], tmp_path, timeout=150)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    failed = [line for line in proc.stderr.splitlines() if line.startswith("run failed: ")]
    assert failed == [f"run failed: learner exited with code 2: error: data set '{prompts}' has no rows"], proc.stderr
    assert f"fix what the error above says, then continue the run with:\n  rlhf-run resume={out}" in proc.stderr


def test_monitor_says_what_is_wrong_and_keeps_its_json_clean(tmp_path, redis_server):
    # once: a raw OmegaConf error without url, a page of zeros for a wrong run_id, a cli.log left
    # in the current folder, and --help listing the trainer's config groups
    monitor = script("rlhf-monitor")
    missing = run_cmd([monitor], tmp_path, timeout=60)
    assert missing.returncode == 2 and "rlhf-monitor needs url=redis://HOST:PORT/DB and run_id=RUN" in missing.stderr
    wrong = run_cmd([monitor, f"url={redis_server.url}", "run_id=no-such-run", "--once", "--json"], tmp_path, timeout=60)
    assert wrong.returncode == 0, wrong.stderr
    assert json.loads(wrong.stdout)["run_id"] == "no-such-run"  # stdout is the JSON alone
    assert "run 'no-such-run' has not started" in wrong.stderr
    help_text = run_cmd([monitor, "--help"], tmp_path, timeout=60).stdout
    assert "--once --json" in help_text and "algo:" not in help_text
    # a URL nothing answers, or not a Redis one: the fix named the trainer's buffer.url, not url=
    from servers import free_port

    port = free_port()
    gone = run_cmd([monitor, f"url=redis://127.0.0.1:{port}/0", "run_id=x", "--once"], tmp_path, timeout=60)
    assert gone.returncode == 75 and f"or fix url (now redis://127.0.0.1:{port}/0)" in gone.stderr, gone.stderr
    bad = run_cmd([monitor, "url=http://127.0.0.1:6379", "run_id=x", "--once"], tmp_path, timeout=60)
    assert "error: url 'http://127.0.0.1:6379' must start with redis://" in bad.stderr, bad.stderr
    assert "buffer." not in gone.stderr + bad.stderr
    assert not list(tmp_path.glob("*.log")), list(tmp_path.iterdir())


def test_the_live_monitor_rides_a_redis_outage_out(tmp_path, redis_server):
    # Redis down longer than the buffer's retry budget (buffer.max_retry_s, 30 s) ended the live view
    # with exit 75, though the run rides such an outage out. Now it says so and tries again: each
    # refresh waits a short budget (2 s), so the outage shows within seconds and needs no 30 s here.
    from buffer import LearnerClient
    from rlhf_core.config import BufferConfig
    from servers import free_port

    buf = LearnerClient.connect(redis_server.url, "down", BufferConfig())
    buf.init_run(batch_size=8, group_size=4, max_staleness=1)
    buf.close()
    port, err = free_port(), tmp_path / "monitor.err"
    with err.open("w") as log:
        monitor = subprocess.Popen([script("rlhf-monitor"), f"url={redis_server.url}", "run_id=down", "refresh_s=0.2",
                                    f"prometheus_port={port}"], cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=log,
                                   env=child_env())
    try:
        def version() -> float | None:
            assert monitor.poll() is None, err.read_text()[-3000:]
            try:
                return sample(scrape(port), "rlhf_run_version", "gauge", "rlhf_run_version", run="down") + 1
            except OSError:  # not listening yet
                return None

        assert wait_for(version, 60, "the monitor's target") == 1  # version 0
        redis_port = redis_server.port
        redis_server.stop()
        wait_for(lambda: "Redis unreachable" in err.read_text(), 30, "the monitor to see Redis gone")
        assert monitor.poll() is None, err.read_text()[-3000:]
        redis_server.start(port=redis_port)
        buf = LearnerClient.connect(redis_server.url, "down", BufferConfig())
        buf.set_learner_version(7)
        buf.close()
        assert wait_for(lambda: version() == 8, 30, "the monitor's snapshots after Redis came back")
        assert "Redis reachable again" in err.read_text()
    finally:
        monitor.send_signal(signal.SIGINT)
        code = monitor.wait(timeout=30)
    assert code == 0, err.read_text()[-3000:]

