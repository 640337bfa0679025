"""The learner's outer loop end to end: ``python -m learner`` child
processes train the tiny model on samples from real ``python -m rollout_workers`` children,
through a real redis-server and a real weight server (a thread of this process).

The crash tests SIGKILL a learner and start a new one on the same checkpoint folder, then
check the invariants the trainer promises:

* it resumes at its checkpoint's version: at that very number when the weight server holds
  exactly those weights there, else (a version beyond the checkpoint was published) its
  restored weights go out as the newest version + 1, so no number names two sets of weights;
* the weight server's newest version, the buffer's learner version and the last checkpoint agree;
* exact sample accounting: every group trained on is in exactly one checkpoint of the final
  lineage and acked once (``samples_consumed`` = samples trained = updates x batch size), a
  batch published but not checkpointed before the crash is trained again from the restored
  weights, and every sample the workers appended is consumed, dropped as stale (counted) or
  still in the stream.

``tests/learner_crash.py`` places a kill exactly between publish and checkpoint, or between
checkpoint and commit; one test kills at whatever moment the learner happens to be in.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from buffer import keys as K
from buffer_clients import Clients
from learner.checkpoint import latest_checkpoint, list_checkpoints
from rlhf_core.config import WeightServerConfig
from servers import wait_for

pytestmark = [pytest.mark.integration]

TESTS_DIR = Path(__file__).resolve().parents[1]
RUN_ID = "loop"
BATCH, GROUP = 8, 4
START_S = 90  # a child imports torch + transformers: seconds on a busy 2-core machine
LEARNER = "learner-0"  # the trainer's consumer name on rank 0


@pytest.fixture
def weight_server():
    from weight_server import WeightServer

    with WeightServer(WeightServerConfig(keep_versions=64)) as server:  # every version stays inspectable
        yield server


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", DS_ACCELERATOR="cpu", **extra)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS_DIR), env.get("PYTHONPATH")]))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


class Run:
    """One run's children (killed by PID at teardown), its folders, and readers of its state."""

    def __init__(self, tmp: Path, redis_url: str, ws: Any, cache: Path, max_updates: int = 8) -> None:
        self.tmp, self.ws = tmp, ws
        self.out, self.ckpt = tmp / "out", tmp / "ckpt"
        self.common = [
            f"buffer.url={redis_url}", f"buffer.run_id={RUN_ID}", f"weight_server.address={ws.address}",
            f"weight_server.pub_address={ws.pub_address}", f"model.cache_dir={cache}",
            f"learner.batch_size={BATCH}", f"learner.micro_batch_size={BATCH}", f"algo.group_size={GROUP}",
            "rollout.max_new_tokens=8", "buffer.heartbeat_interval_s=0.5", "buffer.lease_timeout_s=3",
        ]
        self.learner_args = [
            f"run.output_dir={self.out}", f"learner.checkpoint_dir={self.ckpt}", "learner.checkpoint_every=1",
            "learner.keep_checkpoints=100", f"learner.max_updates={max_updates}",
        ]
        self.procs: dict[str, subprocess.Popen] = {}
        self.buffer = Clients.connect(redis_url, RUN_ID)

    def use_weight_server(self, ws: Any) -> None:
        """Children started from now on use ``ws`` (a run restarted whole gets a fresh server)."""
        self.ws = ws
        self.common = [a for a in self.common if not a.startswith(("weight_server.address=", "weight_server.pub_address="))]
        self.common += [f"weight_server.address={ws.address}", f"weight_server.pub_address={ws.pub_address}"]

    def spawn(self, name: str, module: str, args: list[str], env: dict[str, str],
              launcher: tuple[str, ...] = ()) -> subprocess.Popen:
        cmd = [sys.executable, *launcher, "-m", module, *args, f"hydra.run.dir={self.tmp / 'hydra' / name}",
               "hydra.output_subdir=null"]
        with open(self.tmp / f"{name}.log", "wb") as log:
            self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.tmp)
        return self.procs[name]

    def learner(self, name: str, *extra: str, crash: str | None = None, nproc: int = 1) -> subprocess.Popen:
        """``python -m learner`` (``learner_crash`` with ``crash``); ``nproc`` > 1: under torchrun."""
        from servers import free_port

        env = child_env(**({"RLHF_TEST_CRASH": crash} if crash else {}))
        module = "learner_crash" if crash else "learner"
        launcher = ("-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", str(free_port())) \
            if nproc > 1 else ()
        return self.spawn(name, module, [*self.common, *self.learner_args, *extra], env, launcher)

    def worker(self, name: str) -> subprocess.Popen:
        return self.spawn(name, "rollout_workers", [*self.common, "rollout.slots=8"], child_env(RLHF_WORKER_ID=name))

    def log(self, name: str, lines: int = 40) -> str:
        path = self.tmp / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else "(no log)"

    def wait(self, name: str, timeout: float) -> int:
        try:
            return self.procs[name].wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{name} still running after {timeout} s:\n{self.log(name)}") from None

    def stop_workers(self) -> None:
        """SIGTERM the workers and wait: they finish or release what they hold, and the buffer's
        counters stop moving (the accounting below compares several reads of them)."""
        workers = {n: p for n, p in self.procs.items() if n.startswith("w") and p.poll() is None}
        for proc in workers.values():
            proc.send_signal(signal.SIGTERM)
        for name in workers:
            assert self.wait(name, 60) == 0, self.log(name)

    def close(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is None and name.startswith("w"):
                proc.send_signal(signal.SIGTERM)  # workers drain and release their leases
        for proc in self.procs.values():
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        self.buffer.close()

    # ---- state
    def counters(self) -> dict[str, Any]:
        return self.buffer.monitor.metrics()["counters"]

    def checkpoints(self) -> list[dict[str, Any]]:
        """The ``extra`` of every checkpoint on disk, oldest first (in the order they were written)."""
        return [json.loads((p / "extra.json").read_text()) for p in list_checkpoints(self.ckpt)]

    def latest(self) -> dict[str, Any]:
        path = latest_checkpoint(self.ckpt)
        assert path is not None, "no checkpoint"
        return json.loads((path / "extra.json").read_text())

    def metrics(self) -> list[dict[str, Any]]:
        path = self.out / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def held(self) -> list[int]:
        return self.ws.store.held().get("policy", [])

    def weights_hash(self, version: int) -> bytes:
        ver = self.ws.store.get("policy", version)
        assert ver is not None, f"the weight server does not hold version {version}"
        return ver.content_hash

    def stream_samples(self) -> int:
        """Samples still in the sample stream, counted entry by entry (not from the counters)."""
        entries = self.buffer.redis.xrange(self.buffer.keys.samples, "-", "+")
        return sum(int(fields[K.F_COUNT.encode()]) for _, fields in entries)


@pytest.fixture
def make_run(tmp_path, redis_url, weight_server, model_cache):
    runs: list[Run] = []

    def make(**kw: Any) -> Run:
        runs.append(Run(tmp_path, redis_url, weight_server, model_cache, **kw))
        return runs[-1]

    with contextlib.ExitStack() as stack:  # every run is closed, whatever the test or another close raised
        yield make
        for run in runs:
            stack.callback(run.close)




def buffer_version(run: Run) -> int:
    try:
        return run.buffer.learner.learner_version()
    except Exception:  # noqa: BLE001  # not initialised yet
        return -1


def killed(run: Run, name: str) -> dict[str, Any]:
    """What the killed learner left behind: its latest checkpoint, the newest version on the
    weight server, the buffer's entries pending for the learner, and its metrics lines. Waits
    up to 90 s: under load a learner and its worker took over 30 s to start and reach the crash
    (the log held only its first line)."""
    assert run.wait(name, 90) == -signal.SIGKILL, run.log(name)
    return {"ckpt": run.latest(), "newest": max(run.held()), "pending": run.buffer.learner.pending_for(LEARNER),
            "lines": len(run.metrics()), "counters": run.counters()}


def check_resume(run: Run, before: dict[str, Any], updates: int) -> int:
    """The restarted learner resumed at its checkpoint's version, under a number that names no
    other weights, and finished the run; returns the version it started at."""
    ck = before["ckpt"]
    lines = run.metrics()[before["lines"]:]  # the restarted learner's own lines
    assert [m["learner/updates"] for m in lines] == list(range(ck["updates"] + 1, updates + 1))
    start = int(lines[0]["learner/version"]) - 1
    if before["newest"] == ck["version"]:
        # the server holds exactly the checkpoint's weights at its version: continue at that number
        assert start == ck["version"]
    else:
        # a version beyond the checkpoint was published before the crash: the restored weights go
        # out above it, and they are the checkpoint's weights (the same bytes as its own version)
        assert before["newest"] == ck["version"] + 1
        assert start == before["newest"] + 1
        assert run.weights_hash(start) == run.weights_hash(ck["version"])
        assert run.weights_hash(before["newest"]) != run.weights_hash(ck["version"])
    final = start + updates - ck["updates"]
    assert [int(m["learner/version"]) for m in lines] == list(range(start + 1, final + 1))
    # one number, one set of weights: every number up to the end was published once, none skipped
    assert run.held() == list(range(final + 1))
    assert run.buffer.learner.learner_version() == final == run.latest()["version"]
    return start


def check_accounting(run: Run, updates: int) -> None:
    """Exact sample accounting over every incarnation of the learner (see the module docstring)."""
    run.stop_workers()
    c = run.counters()
    # The lineage: a checkpoint written but not yet named by `latest` when the learner died was not
    # resumed from; the restarted learner wrote its own for that update later (later in the list).
    ckpts = sorted({ck["updates"]: ck for ck in run.checkpoints()}.values(), key=lambda ck: ck["updates"])
    assert run.buffer.learner.pending_for(LEARNER) == []  # everything read was trained and acked
    assert [ck["updates"] for ck in ckpts] == list(range(1, updates + 1))  # the lineage, one per update
    assert [ck["samples_trained"] for ck in ckpts] == [BATCH * u for u in range(1, updates + 1)]
    ids = [i for ck in ckpts for i in ck["trained_ids"]]
    assert len(ids) == len(set(ids)) == updates * BATCH // GROUP  # each group in exactly one update
    assert (c["groups_consumed"], c["samples_consumed"]) == (len(ids), updates * BATCH)
    # the metrics lines of the lineage (a re-trained update's later line replaces the lost one)
    by_update = {int(m["learner/updates"]): m for m in run.metrics()}
    assert sorted(by_update) == list(range(1, updates + 1))
    assert sum(int(m["learner/num_samples"]) for m in by_update.values()) == updates * BATCH
    assert by_update[updates]["learner/samples_trained"] == updates * BATCH
    # decoding the batch is reported apart from waiting for it
    assert all(m["learner/time_read_s"] > 0 and m["learner/time_wait_s"] >= 0 for m in by_update.values())
    # nothing lost: every appended sample was trained once, dropped as stale (counted) or is still there
    assert c["dead_letters"] == 0 and c["samples_dead_lettered"] == 0
    in_stream = run.stream_samples()
    assert c["samples_appended"] == c["samples_consumed"] + c["samples_dropped_stale"] + in_stream
    assert sum(run.buffer.monitor.metrics()["staleness_hist"].values()) == c["samples_consumed"]


# ------------------------------------------------------------------ crash and resume
@pytest.mark.timeout(180)
def test_crash_after_publish_before_checkpoint_retrains_the_batch_from_restored_weights(make_run):
    run = make_run(max_updates=6)
    run.learner("learner-a", crash="before_checkpoint:3")
    run.worker("w0")
    before = killed(run, "learner-a")
    ck = before["ckpt"]
    assert (ck["version"], ck["updates"], before["newest"]) == (2, 2, 3)  # v3 published, not checkpointed
    assert run.buffer.learner.learner_version() == 3
    lost_batch = before["pending"]  # read and trained for v3, never acked
    assert len(lost_batch) == BATCH // GROUP
    assert not set(lost_batch) & {i for c in run.checkpoints() for i in c["trained_ids"]}
    assert before["counters"]["samples_consumed"] == 2 * BATCH

    run.learner("learner-b")
    assert run.wait("learner-b", 120) == 0, run.log("learner-b")
    start = check_resume(run, before, 6)
    assert start == 4  # the restored v2 weights, as version 4 (3 names the lost update's weights)
    assert "published the restored weights (checkpoint version 2) as version 4" in run.log("learner-b", 400)
    # the lost batch was trained again, from the restored weights, as the restarted learner's first update
    first = next(c for c in run.checkpoints() if c["updates"] == 3)
    assert sorted(first["trained_ids"]) == sorted(lost_batch) and first["version"] == 5
    check_accounting(run, 6)


@pytest.mark.timeout(240)
def test_a_whole_run_restarted_on_a_fresh_weight_server_numbers_its_weights_above_the_buffers_version(make_run):
    """``rlhf-run resume=`` after the launcher died: Redis keeps its data, with samples tagged
    with the version the dead learner published last (3, never checkpointed), but the new
    weight server holds nothing. The restored weights must go out above the buffer's version:
    at 2 again, those samples would look newer than the learner and be dead-lettered."""
    from weight_server import WeightServer

    run = make_run(max_updates=6)
    run.learner("learner-a", crash="before_checkpoint:3")
    run.worker("w0")
    before = killed(run, "learner-a")
    assert (before["ckpt"]["version"], run.buffer.learner.learner_version()) == (2, 3)

    def groups_at_v3() -> bool:
        entries = run.buffer.redis.xrange(run.buffer.keys.samples, "-", "+")
        return any(int(fields[K.F_VERSION.encode()]) >= 3 for _, fields in entries)

    wait_for(groups_at_v3, 60, "a group generated by version 3 in the stream")
    run.procs["w0"].kill()  # the rest of the run dies too; its leases time out
    run.wait("w0", 30)
    fresh = WeightServer(WeightServerConfig(keep_versions=64)).start()
    try:
        run.use_weight_server(fresh)
        run.learner("learner-b")
        run.worker("w1")
        assert run.wait("learner-b", 120) == 0, run.log("learner-b")
        assert "published the restored weights (checkpoint version 2) as version 4" in run.log("learner-b", 400)
        assert run.held() == [4, 5, 6, 7, 8]  # the fresh server: the restored weights, then updates 3 to 6
        check_accounting(run, 6)  # nothing dead-lettered, every sample accounted for
    finally:
        run.stop_workers()
        fresh.stop()


@pytest.mark.timeout(180)
def test_crash_after_checkpoint_before_commit_acks_what_the_checkpoint_recorded(make_run):
    run = make_run(max_updates=6)
    run.learner("learner-a", crash="after_checkpoint:3")
    run.worker("w0")
    before = killed(run, "learner-a")
    ck = before["ckpt"]
    assert (ck["version"], ck["updates"], before["newest"]) == (3, 3, 3)
    # the checkpoint holds the batch, the buffer has not been told: exactly that batch is pending
    assert sorted(before["pending"]) == sorted(ck["trained_ids"]) and len(ck["trained_ids"]) == BATCH // GROUP
    assert before["counters"]["groups_consumed"] == 2 * BATCH // GROUP

    run.learner("learner-b")
    assert run.wait("learner-b", 120) == 0, run.log("learner-b")
    assert check_resume(run, before, 6) == 3  # same weights at the same number: no new version needed
    assert "the weight server already held versions" not in run.log("learner-b", 400)
    later = {i for c in run.checkpoints() if c["updates"] > 3 for i in c["trained_ids"]}
    assert not later & set(ck["trained_ids"])  # acked on resume, never delivered again
    check_accounting(run, 6)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sigkill_at_any_moment_resumes_with_exact_accounting(make_run):
    """Two workers; the learner is SIGKILLed at a random moment after the buffer says version 3
    (right after a publish, mid-update, mid-checkpoint ...): whatever it was doing, the same holds."""
    updates = 20
    run = make_run(max_updates=updates)
    run.learner("learner-a")
    run.worker("w0")
    run.worker("w1")
    wait_for(lambda: buffer_version(run) >= 3, START_S, "learner version 3")
    time.sleep(random.uniform(0.0, 0.1))  # an update takes 0.03-0.1 s here
    run.procs["learner-a"].send_signal(signal.SIGKILL)
    before = killed(run, "learner-a")
    print(f"killed at checkpoint v{before['ckpt']['version']}, newest published v{before['newest']}, "
          f"{len(before['pending'])} group(s) pending")
    ck = before["ckpt"]
    assert 2 <= ck["version"] <= before["newest"] <= ck["version"] + 1 < updates
    pending = set(before["pending"])
    assert len(pending) <= BATCH // GROUP  # one batch at most: read and not yet acked

    run.learner("learner-b")
    assert run.wait("learner-b", 150) == 0, run.log("learner-b")
    check_resume(run, before, updates)
    # what the checkpoint recorded was acked on resume; what was pending beyond it was trained again
    later = {i for c in run.checkpoints() if c["updates"] > ck["updates"] for i in c["trained_ids"]}
    assert later & set(ck["trained_ids"]) == set()
    assert pending - set(ck["trained_ids"]) <= later
    check_accounting(run, updates)
    consumers = run.buffer.monitor.metrics()["consumers"]
    assert {"w0", "w1"} <= set(consumers)
    assert all(consumers[w]["stats"].get("samples", 0) > 0 for w in ("w0", "w1")), consumers


# ------------------------------------------------------------------ the final export
@pytest.mark.timeout(150)
def test_final_hf_export_loads_with_transformers_as_is(make_run, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from weight_server import WeightSubscriber

    export = tmp_path / "export"
    run = make_run(max_updates=2)
    run.learner("learner", f"learner.export_dir={export}")
    run.worker("w0")
    assert run.wait("learner", 120) == 0, run.log("learner")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in export.iterdir()}
    model = AutoModelForCausalLM.from_pretrained(export)  # plain transformers, nothing of ours
    tok = AutoTokenizer.from_pretrained(export)
    assert tok("3:")["input_ids"] and tok.eos_token_id == model.config.eos_token_id
    with WeightSubscriber(run.ws.address, run.ws.pub_address, WeightServerConfig(), worker_id="test") as sub:
        version, published = sub.pull()
    assert version == 2 == run.latest()["version"]
    state = model.state_dict()
    assert all(torch.equal(state[name], t) for name, t in published.items())  # the trained weights, exactly
    initial = _initial(run)
    assert max(float((published[n] - initial[n]).abs().max()) for n in initial if n in published) > 1e-4  # trained
    ids = torch.tensor([tok("3:")["input_ids"]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size) and bool(torch.isfinite(logits).all())


@pytest.mark.timeout(240)
def test_lora_versions_are_adapters_a_restart_keeps_one_number_per_weights_and_the_export_merges(make_run, tmp_path):
    """LoRA through the learner's own publish, crash and restart: every version on the weight
    server is the adapter tensors alone; the restored adapters go out above the lost update's
    number (as for a whole model); the final export is the merged model, equal to the base model
    with the last version's adapters applied."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlhf_core import lora
    from rlhf_core.config import LoraConfig, ModelConfig
    from rlhf_core.models import load_policy
    from weight_server import WeightSubscriber

    export = tmp_path / "export"
    run = make_run(max_updates=5)
    run.common += ["model.lora.r=2", "model.lora.target_modules=[all-linear,lm_head]", "learner.lr=3e-3"]
    run.learner("learner-a", crash="before_checkpoint:3")
    run.worker("w0")
    run.wait("learner-a", START_S)  # two processes start on a busy machine, the worker joins when the learner is up
    before = killed(run, "learner-a")
    assert (before["ckpt"]["version"], before["newest"]) == (2, 3)  # v3 published, not checkpointed
    run.learner("learner-b", f"learner.export_dir={export}")
    assert run.wait("learner-b", 120) == 0, run.log("learner-b")
    assert check_resume(run, before, 5) == 4  # the restored v2 adapters as version 4, hash-equal to v2
    cache = next(a.split("=", 1)[1] for a in run.common if a.startswith("model.cache_dir="))
    cfg = ModelConfig(cache_dir=cache, lora=LoraConfig(r=2, target_modules=["all-linear", "lm_head"]))
    model = load_policy(cfg).eval()
    adapters = lora.adapter_parameters(model)
    for v in run.held():  # adapters only, in every version of both learners
        assert sorted(t.name for t in run.ws.store.get("policy", v).layout.tensors) == sorted(adapters), v
    with WeightSubscriber(run.ws.address, run.ws.pub_address, WeightServerConfig(), worker_id="test") as sub:
        version, _ = sub.pull(into=adapters)  # what a worker's hf engine does
    assert version == 7 == run.latest()["version"]  # 4 (restored v2) + updates 3, 4, 5
    exported = AutoModelForCausalLM.from_pretrained(export).eval()  # plain transformers, no peft
    assert not lora.has_adapters(exported)
    ids = torch.tensor([[1, 23, 30]])
    with torch.no_grad():
        merged, unmerged = exported(input_ids=ids).logits, model(input_ids=ids).logits
        base = load_policy(ModelConfig(cache_dir=cache)).eval()(input_ids=ids).logits
    torch.testing.assert_close(merged, unmerged, atol=1e-4, rtol=1e-4)
    assert float((merged - base).abs().max()) > 1e-3  # trained: not the base model


# ------------------------------------------------------------------ experiment trackers
@pytest.mark.timeout(300)
def test_trackers_log_offline_and_a_restored_learner_continues_their_runs(make_run, monkeypatch):
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trackers = ("run.loggers=[tensorboard,mlflow,wandb]", "run.wandb_mode=offline", "run.log_samples_every=2")
    run = make_run(max_updates=3)
    run.learner("learner-a", *trackers)
    run.worker("w0")
    assert run.wait("learner-a", 2 * START_S) == 0, run.log("learner-a")
    ids = run.latest()["trackers"]
    assert set(ids) == {"mlflow", "wandb"}  # TensorBoard has no run id: it appends to its folder
    run.learner_args = [a for a in run.learner_args if not a.startswith("learner.max_updates=")]
    run.learner("learner-b", *trackers, "learner.max_updates=5")  # restored from the checkpoint of update 3
    assert run.wait("learner-b", 2 * START_S) == 0, run.log("learner-b")
    assert run.latest()["trackers"] == ids and run.latest()["version"] == 5

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # as the learner sets it for its own folder
    client = MlflowClient((run.out / "mlruns").as_uri())
    [mlflow_run] = client.search_runs([client.get_experiment_by_name("rlhf-service").experiment_id])
    assert mlflow_run.info.run_id == ids["mlflow"]
    history = client.get_metric_history(ids["mlflow"], "learner/updates")
    assert sorted((m.step, m.value) for m in history) == [(u, u) for u in range(1, 6)]  # step = version, continued
    assert [a.path for a in client.list_artifacts(ids["mlflow"], "samples")] == \
        ["samples/step_00000002.json", "samples/step_00000004.json"]
    wandb_runs = list((run.out / "wandb").glob("offline-run-*"))
    assert len(wandb_runs) == 2 and all(f"-{ids['wandb']}" in p.name for p in wandb_runs), wandb_runs
    events = EventAccumulator(str(run.out / "tensorboard")).Reload()
    assert [e.step for e in events.Scalars("learner/updates")] == [1, 2, 3, 4, 5]


def _initial(run: Run) -> dict[str, Any]:
    """The weights every learner starts from (the tiny model on disk)."""
    from rlhf_core.config import ModelConfig
    from rlhf_core.models import load_policy

    cache = next(a.split("=", 1)[1] for a in run.common if a.startswith("model.cache_dir="))
    return load_policy(ModelConfig(cache_dir=cache)).state_dict()


# ------------------------------------------------------------------ several learner processes
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_process_zero3_learner_trains_publishes_and_commits_through_the_loop(make_run):
    """torchrun, 2 ranks, ZeRO-3 on CPU (gloo): rank 0 alone reads the buffer, publishes and
    commits; both ranks train every batch and write their partitions into each checkpoint."""
    updates = 3
    run = make_run(max_updates=updates)
    run.learner("learner", "learner.engine=deepspeed", "learner.zero_stage=3", "learner.micro_batch_size=4", nproc=2)
    run.worker("w0")
    assert run.wait("learner", 240) == 0, run.log("learner", 80)
    assert run.held() == list(range(updates + 1))
    assert run.weights_hash(updates) != run.weights_hash(0)
    assert run.buffer.learner.learner_version() == updates == run.latest()["version"]
    c = run.counters()
    assert (c["samples_consumed"], c["groups_consumed"]) == (updates * BATCH, updates * BATCH // GROUP)
    assert run.buffer.learner.pending_for(LEARNER) == []
    readers = run.buffer.redis.xinfo_consumers(run.buffer.keys.samples, K.LEARNER_GROUP)
    assert [r["name"].decode() if isinstance(r["name"], bytes) else r["name"] for r in readers] == [LEARNER]
    lines = run.metrics()  # rank 0 writes them
    assert [(m["learner/updates"], m["learner/num_samples"]) for m in lines] == [(u, BATCH) for u in (1, 2, 3)]
    latest = latest_checkpoint(run.ckpt)
    assert json.loads((latest / "meta.json").read_text())["world_size"] == 2
    partitions = sorted(p.name for p in (latest / "policy").rglob("*optim_states.pt"))
    assert len(partitions) == 2 and "rank_0" in partitions[0] and "rank_1" in partitions[1], partitions
