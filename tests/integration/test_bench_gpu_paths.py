"""Each benchmark's --gpu mode runs its code path on a CPU (``--gpu-check``: a 2-layer model), so
the path bench/gpu.sh runs within a device loan cannot rot. Apart from test_bench_smoke.py so the
two test workers share the benches' minutes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_bench_smoke import BENCH, RUN_TIMEOUT_S, _gateway_rows

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(660)]


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
