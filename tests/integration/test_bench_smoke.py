"""Every benchmark's quick mode runs to the end and writes its JSON, so the benches cannot rot.

Each bench runs as its own process, as a user starts it, with ``RLHF_BENCH_RESULTS`` pointing at
this test's temp dir: the committed numbers in ``bench/results/`` are never overwritten. Benches
whose quick mode takes minutes on a 2-core machine get smaller sizes through their own options;
the code path is the quick mode's.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(660)]

BENCH = Path(__file__).resolve().parents[2] / "bench"
RUN_TIMEOUT_S = 600
COMMON_KEYS = {"bench", "date", "machine", "mode", "config"}

# bench -> (arguments, the JSON's own top-level keys besides COMMON_KEYS)
BENCHES = {
    "buffer": (["--quick"], {"results", "targets", "notes"}),
    "engines": (["--quick", "--enforce-eager"], {"results", "ratio_vllm_over_hf", "notes"}),
    "e2e": (["--quick", "--updates", "16"], {"runs", "async_over_sync", "async_over_sync_per_seed", "reward", "target"}),
    # the larger model's path (--shape small), which runs everything the tiny one does, with other model
    # settings; the sessions split over two client processes
    "gateway": (["--quick", "--sessions", "8", "--turn-tokens", "16", "--shape", "small", "--clients", "2"],
                {"rows", "ratio_gateway_over_engine", "target", "met"}),
    "generation": (["--quick"], {"results", "ratios", "targets", "met", "device"}),
    "learner": (["--quick", "--profile", "--variant", "kept=learner.keep_head_logits=true",
                 "--variant", "ep2=learner.ppo_epochs=2"], {"results", "speed_over_plain", "best_learner_mfu", "target_mfu", "device", "notes", "head",
                              "head_compiled_over_eager"}),
    "lora": (["--quick", "--reps", "1"], {"results", "ratios", "targets", "met", "device", "generation_tiny_cpu", "notes"}),
    "multi_turn": (["--quick", "--episodes", "64", "--skip-learning"], {"latency"}),  # the learning run: test_multi_turn_run
    "rewards": (["--quick", "--updates", "4"], {"runs", "batched_over_per_sample", "ratios_per_seed", "target",
                                                 "reward_model_ms_per_completion"}),
    "sandbox": (["--quick", "--updates", "4"], {"load", "executions", "overhead", "math_reward_alone", "runs", "ratios_over_default",
                                                 "targets", "met", "notes"}),
    "staleness": (["--quick", "--updates", "20", "--seeds", "1"],
                  {"initial_eval", "summary", "ratios_decoupled_over_ppo", "eval_curves", "runs"}),
    "weight_sync": (["--quick", "--size-mb", "32", "--reps", "2"], {"results", "ratios", "targets", "rounds"}),
}


RESULT = {"gateway": "gateway_small"}  # bench -> its JSON's name where the arguments above change it


def _gateway_rows(doc: dict) -> None:
    # each side's forward passes (the gateway's from its worker's heartbeats) and the client processes' CPU
    for row in doc["rows"]:
        assert row["steps"] > 0 and 0 < row["prefills_per_step"] <= 1, row
    assert all(row["cpu_s"]["client"] > 0 for row in doc["rows"] if row["side"] == "gateway"), doc["rows"]
    # where the gateway's calls spent their time (its /v1/rl/stats), every phase measured
    for row in (r for r in doc["rows"] if r["side"] == "gateway"):
        ms = row["call_ms"]
        assert set(ms) == {"gateway_in", "to_worker", "engine", "to_gateway", "rest"} and ms["engine"] > 0, ms
        assert min(ms["gateway_in"], ms["to_worker"], ms["to_gateway"]) >= 0, ms


def _learner_profile(doc: dict) -> None:
    # the learner's update profiled (on a CPU its operators' own time): mostly matrix products
    (prof,) = [row["profile"] for row in doc["results"] if "profile" in row]
    assert 0 < prof["busy_ms"] and 0 < prof["busy_fraction"] <= 1.5, prof
    assert max(prof["by_kind_ms"], key=prof["by_kind_ms"].get) == "matmul", prof["by_kind_ms"]
    assert prof["top"] and prof["top"][0]["kind"] == "matmul", prof["top"]
    assert prof["host_syncs"]["aten::_local_scalar_dense"]["calls"] > 0, prof  # the metrics' reads, at least
    # --variant: one more learner row under its overrides; the head alone eager, compiled and with its logits kept
    methods = [row["method"] for row in doc["results"]]
    assert any(m.startswith("learner torch + kept (learner.keep_head_logits=true)") for m in methods), methods
    assert [row["math"] for row in doc["head"]] == ["eager", "compiled", "compiled, logits kept"], doc["head"]
    # FLOPs as the learner counts them (learner.stats.flops_metrics): two epochs train every token twice
    flops = {row["method"].split(" (")[0]: row["tflops"] * row["step_s"] for row in doc["results"]}
    assert flops["learner torch + ep2"] == pytest.approx(2 * flops["learner torch"], rel=1e-6), flops


CHECKS = {"gateway": _gateway_rows, "learner": _learner_profile}  # bench -> what its JSON must hold beyond its keys


def _digest(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else None


NEEDS = {"engines": "vllm", "sandbox": "math_verify"}  # bench -> the optional package it needs (installed by ./quickstart.sh)
NEEDS_PROGRAM = {"sandbox": "bwrap"}  # bench -> the program it needs (./quickstart.sh installs it as root)


@pytest.mark.parametrize("name", sorted(BENCHES))
def test_bench_quick_mode_runs_and_writes_its_json(name, tmp_path, model_cache):
    if name in NEEDS:
        pytest.importorskip(NEEDS[name])
    if name in NEEDS_PROGRAM and shutil.which(NEEDS_PROGRAM[name]) is None:
        pytest.skip(f"bench/{name}.py needs {NEEDS_PROGRAM[name]} (apt-get install -y bubblewrap)")
    args, keys = BENCHES[name]
    result = RESULT.get(name, name)
    committed = BENCH / "results" / f"{result}.json"
    before = _digest(committed)
    out = tmp_path / "results"
    env = dict(os.environ, RLHF_BENCH_RESULTS=str(out), RLHF_TEST_CACHE=str(model_cache), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(BENCH / f"{name}.py"), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, f"bench/{name}.py {' '.join(args)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    doc = json.loads((out / f"{result}.json").read_text())
    assert (COMMON_KEYS | keys) <= set(doc), sorted(set(doc))
    assert (doc["bench"], doc["mode"]) == (result, "quick")
    CHECKS.get(name, lambda doc: None)(doc)
    assert f"wrote {out / (result + '.json')}" in proc.stdout
    assert _digest(committed) == before, f"the smoke run overwrote {committed}"
