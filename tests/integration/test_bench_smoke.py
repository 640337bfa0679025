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
    "engines": (["--quick"], {"results", "ratio_vllm_over_hf", "notes"}),
    "e2e": (["--quick", "--updates", "16"], {"runs", "async_over_sync", "async_over_sync_per_seed", "reward", "target"}),
    "generation": (["--quick"], {"results", "ratios", "targets", "met", "device"}),
    "staleness": (["--quick", "--updates", "20", "--seeds", "1"],
                  {"initial_eval", "summary", "ratios_decoupled_over_ppo", "eval_curves", "runs"}),
    "weight_sync": (["--quick", "--size-mb", "32", "--reps", "2"], {"results", "ratios", "targets", "rounds"}),
}


def _digest(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else None


NEEDS = {"engines": "vllm"}  # bench -> the optional package it needs (installed by ./quickstart.sh)


@pytest.mark.parametrize("name", sorted(BENCHES))
def test_bench_quick_mode_runs_and_writes_its_json(name, tmp_path, model_cache):
    if name in NEEDS:
        pytest.importorskip(NEEDS[name])
    args, keys = BENCHES[name]
    committed = BENCH / "results" / f"{name}.json"
    before = _digest(committed)
    out = tmp_path / "results"
    env = dict(os.environ, RLHF_BENCH_RESULTS=str(out), RLHF_TEST_CACHE=str(model_cache), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(BENCH / f"{name}.py"), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, f"bench/{name}.py {' '.join(args)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    doc = json.loads((out / f"{name}.json").read_text())
    assert (COMMON_KEYS | keys) <= set(doc), sorted(set(doc))
    assert (doc["bench"], doc["mode"]) == (name, "quick")
    assert f"wrote {out / (name + '.json')}" in proc.stdout
    assert _digest(committed) == before, f"the smoke run overwrote {committed}"


def test_generation_gpu_mode_code_path_runs_on_a_cpu(tmp_path, model_cache):
    # --gpu-check: the --gpu mode's model builder, workloads and methods with a 2-layer model.
    out = tmp_path / "results"
    env = dict(os.environ, RLHF_BENCH_RESULTS=str(out), RLHF_TEST_CACHE=str(model_cache), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(BENCH / "generation.py"), "--gpu-check"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    doc = json.loads((out / "generation_gpu_check.json").read_text())
    assert {r["workload"] for r in doc["results"]} == {"uniform", "skewed"}
    assert set(doc["ratios"]["uniform"]) == {"engine_over_generate"}
