"""`rlhf-plan` end to end, as a user runs it: a profile from a run's files, simulate, search with
a feasibility check, and the refusals (another model, an impossible request) with exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

RUN = Path(__file__).parent / "data" / "plan_run"  # the records of a 60-update run of the default task, 1 worker


def plan(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlhf_run.plan.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=240)


def test_profile_from_a_run_then_simulate_and_search(tmp_path):
    out = plan("profile", "--from-run", str(RUN), "--out", "p.json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "wrote p.json (cpu profile of tiny(hidden 64" in out.stdout
    profile = json.loads((tmp_path / "p.json").read_text())
    assert profile["source"]["how"] == "run" and profile["generation"]["max_new_tokens"] == 6
    assert profile["learner"]["update_base"] + profile["learner"]["update_per_token"] > 0

    sim = plan("simulate", "--profile", "p.json", "--updates", "80", "--json", "rollout.num_workers=1", cwd=tmp_path)
    assert sim.returncode == 0, sim.stderr
    doc = json.loads(sim.stdout)
    assert doc["plan"]["workers"] == 1 and doc["plan"]["max_staleness"] == 2
    result = doc["result"]
    assert result["trained_samples_per_s"] > 0 and result["max_admitted_over_bound"] <= 0
    assert result["samples_generated"] == result["samples_trained"] + result["samples_dropped"] + result["samples_in_buffer"]

    found = plan("search", "--profile", "p.json", "--max-staleness", "2", "--max-workers", "2", "--updates", "60",
                 "--top", "4", "--json", cwd=tmp_path)
    assert found.returncode == 0, found.stderr
    ranked = json.loads(found.stdout)
    assert len(ranked) == 4
    for r in ranked:  # only feasible plans
        p = r["plan"]
        assert p["lookahead"] <= p["max_staleness"] <= 2 and 1 <= p["workers"] <= 2
        assert p["batch_size"] % p["group_size"] == 0 and 1 <= p["micro_batch_size"] <= p["batch_size"]
        assert f"algo.max_staleness={p['max_staleness']}" in r["overrides"]
    # ranked as search ranks them: rates to 6 places, the less stale first on a tie
    rates = [round(r["result"]["trained_samples_per_s"], 6) for r in ranked]
    assert rates == sorted(rates, reverse=True)

    table = plan("search", "--profile", "p.json", "--max-staleness", "1", "--max-workers", "1", "--updates", "40",
                 cwd=tmp_path)
    assert table.returncode == 0, table.stderr
    assert "run the best plan:\n  rlhf-run rollout.num_workers=1" in table.stdout
    assert "on a Ray cluster:\n  rlhf-run rollout.num_workers=1" in table.stdout and "launcher=ray ray.learner.ranks=1" in table.stdout


def test_calibration_on_this_machine_feeds_the_simulator(tmp_path):
    # every stage alone: the real engine, worker, learner and weight server (small: 16 prompts, 8 slots)
    small = ["rollout.slots=8", "learner.batch_size=16", "learner.micro_batch_size=16"]
    out = plan("profile", "--quick", "--prompts", "16", "--out", "p.json", *small, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    profile = json.loads((tmp_path / "p.json").read_text())
    assert profile["source"]["how"] == "calibration" and profile["source"]["overrides"] == small
    assert profile["identity"]["rollout_engine"] == "hf" and profile["identity"]["learner_engine"] == "torch"
    gen, learner, sync = profile["generation"], profile["learner"], profile["sync"]
    assert gen["decode_base"] + gen["decode_per_row"] > 0 and max(gen["response_tokens"]["values"]) <= gen["max_new_tokens"]
    assert learner["update_base"] + learner["update_per_sample"] + learner["update_per_token"] > 0
    assert sync["bytes"] > 0 and profile["worker"]["claim_call"] > 0
    # a woken thread's wait for a core: some with one free, and no less with every core busy
    machine = profile["machine"]
    assert machine["handoff_s"] > 0 and machine["handoff_busy_s"] >= 0
    assert profile["source"]["handoff"]["busy_handoff_s"] >= machine["handoff_s"]
    sim = plan("simulate", "--profile", "p.json", "--updates", "40", "--warmup", "5", "--json", cwd=tmp_path)
    assert sim.returncode == 0, sim.stderr
    doc = json.loads(sim.stdout)
    assert (doc["plan"]["slots"], doc["plan"]["batch_size"]) == (8, 16)  # the profile's own setup comes first
    assert doc["result"]["trained_samples_per_s"] > 0
    # contention is fitted so the simulator reproduces a short real run of the same config
    fit = profile["source"]["contention_fit"]
    assert fit["measured_samples_per_s"] > 0 and profile["machine"]["contention"] == pytest.approx(fit["contention"], abs=1e-3)
    if 1.001 < fit["contention"] < 3.99:  # not clamped at either end of the bisection
        same = plan("simulate", "--profile", "p.json", "--updates", str(fit["updates"]), "--warmup", str(fit["warmup"]),
                    "--background", str(fit["background_demand"]), "--json", cwd=tmp_path)
        assert json.loads(same.stdout)["result"]["trained_samples_per_s"] == pytest.approx(fit["measured_samples_per_s"], rel=0.03)


@pytest.mark.parametrize("overrides", [["experiment=ppo"], ["algo.kl_coef=0.05"]], ids=["ppo-critic", "kl-reference"])
def test_the_update_of_a_run_with_a_critic_or_a_reference_is_profiled(tmp_path, redis_url, weight_server, model_cache,
                                                                      overrides):
    # the calibration's update stage built its updater without the learner's critic and reference:
    # experiment=ppo stopped with 'gae needs a critic', a learner-side KL (kl_coef > 0,
    # rollout.ref_logprobs_on=learner) with MissingReferenceError, after the other stages had run
    import factories as T
    from learner.trainer import Learner
    from rlhf_run.plan.cli import compose
    from rlhf_run.plan.measure import isolated_config, measure_updates

    small = ["learner.batch_size=8", "learner.micro_batch_size=4", f"model.cache_dir={model_cache}"]
    cfg = isolated_config(compose([*overrides, *small]), redis_url, weight_server.address, weight_server.pub_address,
                          tmp_path)
    learner = Learner(cfg, output_dir=tmp_path)
    try:
        assert (learner.critic is not None) == (overrides == ["experiment=ppo"]) and (learner.ref is not None)
        g = cfg.algo.group_size
        samples = [s for i in range(8 // g) for s in T.group(f"p{i}", g, reward=float(i), finish_reason="length")]
        coef = measure_updates(learner, cfg, samples, reps=1)
    finally:
        learner.close()
    assert len(coef) == 4 and sum(coef) > 0


def test_refusals_name_the_problem(tmp_path):
    assert plan("profile", "--from-run", str(RUN), "--out", "p.json", cwd=tmp_path).returncode == 0
    other = plan("simulate", "--profile", "p.json", "model=hf", "model.path=/models/qwen", "rollout=vllm", cwd=tmp_path)
    assert other.returncode == 2
    assert "was measured for another setup" in other.stderr and "'/models/qwen' (asked)" in other.stderr
    assert "rollout_engine 'hf' (profile) vs 'vllm' (asked)" in other.stderr

    bound = plan("search", "--profile", "p.json", "--max-staleness", "0", "buffer.lookahead=2", cwd=tmp_path)
    assert bound.returncode == 2 and "buffer.lookahead=2 with a staleness bound of 0" in bound.stderr

    cpu_gpus = plan("search", "--profile", "p.json", "--gpus", "8", cwd=tmp_path)
    assert cpu_gpus.returncode == 2 and "--gpus applies to a GPU profile" in cpu_gpus.stderr

    assert plan("profile", "--published", "7b-h100", "--out", "p7b.json", cwd=tmp_path).returncode == 0
    devices = plan("simulate", "--profile", "p7b.json", "--gpus", "4", "rollout.num_workers=8", "learner.devices=[0]",
                   cwd=tmp_path)
    assert devices.returncode == 2 and "need 9 GPUs; 4 given" in devices.stderr

    missing = plan("simulate", "--profile", "nope.json", cwd=tmp_path)
    assert missing.returncode == 2 and "profile nope.json does not exist" in missing.stderr

    bad_run = plan("profile", "--from-run", str(tmp_path), "--out", "q.json", cwd=tmp_path)
    assert bad_run.returncode == 2 and "has no metrics.jsonl" in bad_run.stderr


def test_help_lists_the_commands(tmp_path):
    out = plan("--help", cwd=tmp_path)
    assert out.returncode == 0
    for command in ("profile", "simulate", "search"):
        assert command in out.stdout
    sub = plan("search", "--help", cwd=tmp_path)
    assert "--max-staleness" in sub.stdout and "--gpus" in sub.stdout and "--batch-sizes" in sub.stdout
