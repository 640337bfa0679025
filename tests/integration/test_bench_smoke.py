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


NEEDS = {"engines": "vllm"}  # bench -> the optional package it needs (installed by ./quickstart.sh)


@pytest.mark.parametrize("name", sorted(BENCHES))
def test_bench_quick_mode_runs_and_writes_its_json(name, tmp_path, model_cache):
    if name in NEEDS:
        pytest.importorskip(NEEDS[name])
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


def gpu_check(name: str, tmp_path: Path, model_cache: Path, *args: str, **env_vars: str) -> dict:
    """Run ``bench/<name>.py --gpu-check *args`` (the --gpu mode's path on a CPU with a 2-layer model)
    with ``env_vars`` in its environment; return its JSON."""
    out = tmp_path / "results"
    env = {**os.environ, "RLHF_BENCH_RESULTS": str(out), "RLHF_TEST_CACHE": str(model_cache), "OMP_NUM_THREADS": "1",
           **env_vars}
    proc = subprocess.run([sys.executable, str(BENCH / f"{name}.py"), "--gpu-check", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads((out / f"{name}_gpu_check.json").read_text())


def test_generation_gpu_mode_code_path_runs_on_a_cpu(tmp_path, model_cache):
    # the --gpu mode's model builder, workloads and methods
    doc = gpu_check("generation", tmp_path, model_cache)
    assert {r["workload"] for r in doc["results"]} == {"uniform", "skewed"}
    assert set(doc["ratios"]["uniform"]) == {"engine_over_generate"}
    # and the engine's decoding steps profiled (on a CPU, its operators' own time)
    prof = doc["profile"]
    assert prof["steps"] > 0 and prof["busy_ms_per_step"] > 0 and prof["top"], prof


def test_vs_trl_runs_trl_and_the_service_on_a_real_model_shape(tmp_path, model_cache):
    # --gpu-check: the --gpu mode's path on a CPU (a 2-layer Qwen2-shaped model with tied
    # embeddings, prompts from a JSONL file, model=hf) for TRL and this service async; --no-sync, as
    # bench/gpu.sh runs it within a device loan (the sync run is the async one at staleness 0: the
    # e2e smoke run covers it), leaves the sync run and every sync figure out.
    pytest.importorskip("trl")
    # a shell's OMP_NUM_THREADS (1 here) does not reach TRL: it trains with torch's own number of
    # threads, as a user runs it, which its row records (TRL once inherited the 1 the bench set for
    # this service's processes while the JSON said it ran with every core)
    doc = gpu_check("vs_trl", tmp_path, model_cache, "--no-sync", OMP_NUM_THREADS="1")
    assert [(r["system"], r["updates"]) for r in doc["runs"]] == [("trl", 5), ("async", 5)]
    assert doc["sync_over_trl"] is None and "sync" not in doc["summary"]
    # the speed window leaves out the first 3 updates on every side (the async worker's head start,
    # buffer.lookahead=2, is used up by then): updates 4 and 5, 2 x 8 samples, a shorter window than
    # the first-to-last one the run's own summary reports
    assert doc["config"]["warmup_updates"] == 3, doc["config"]
    for r in doc["runs"]:
        assert (r["warmup_updates"], r["window_updates"]) == (3, 2), r
        assert r["trained_samples_per_s"] * r["training_window_s"] == pytest.approx(2 * 8), r
        assert 0 < r["training_window_s"] < r["first_to_last"]["training_window_s"], r
    own = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"], capture_output=True,
                         text=True, env={k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}, timeout=120)
    assert doc["config"]["trl_threads"] is None and doc["runs"][0]["threads"] == int(own.stdout), doc["runs"][0]
    assert all(r["trained_samples_per_s"] > 0 for r in doc["runs"])
    trl, asyn = doc["runs"][0]["trained_samples_per_s"], doc["runs"][1]["trained_samples_per_s"]
    assert doc["async_over_trl_per_seed"] == [asyn / trl] and doc["async_over_trl"] == asyn / trl


def test_gateway_gpu_mode_code_path_runs_on_a_cpu(tmp_path, model_cache):
    # --gpu-check: the --gpu mode's path on a CPU (a 2-layer Qwen2-shaped model loaded as
    # model=hf by the run's worker and by the direct engine, the sessions over 2 client processes)
    doc = gpu_check("gateway", tmp_path, model_cache)
    # the JSON names the model both sides ran: the Qwen2 shape, not --shape's tiny builder (its default)
    assert doc["config"]["clients"] == 2 and doc["config"]["qwen2"] and doc["config"]["shape"] is None, doc["config"]
    assert [(r["side"], r["requests"]) for r in doc["rows"]] == [("gateway", 16), ("engine", 16)]
    _gateway_rows(doc)
