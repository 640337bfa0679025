"""Plan search and profiles: only feasible plans come back, impossible requests are refused with
what to change, profiles of another model or engine are refused, overrides round-trip."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from rlhf_run.plan.cli import compose
from rlhf_run.plan.profile import ProfileError, check_identity, load
from rlhf_run.plan.scale import published_7b
from rlhf_run.plan.search import (PlanError, Request, check_plan, candidates, memory_problems, overrides, plan_from_config,
                                  ray_overrides, search)
from rlhf_run.plan.simulate import Plan

PROFILE = Path(__file__).parent / "data" / "plan_profile_cpu.json"


@pytest.fixture(scope="module")
def cpu_profile():
    return load(PROFILE)


@pytest.fixture(scope="module")
def gpu_profile():
    return published_7b("nccl")


def test_cpu_search_returns_only_feasible_plans_best_first(cpu_profile):
    request = Request(base=Plan(), max_staleness=2, max_workers=2)
    ranked = search(request, cpu_profile, top=500, updates=60)
    assert len(ranked) == 2 * 4 * 2 * 6  # workers x slots x micro-batches x (staleness, lookahead) pairs
    for r in ranked:
        assert check_plan(r.plan, request, cpu_profile) == []
        assert r.plan.lookahead <= r.plan.max_staleness <= 2 and 1 <= r.plan.workers <= 2
        assert r.result.max_admitted_over_bound <= 0
    rates = [r.result.trained_samples_per_s for r in ranked]
    assert rates == sorted(rates, reverse=True)


def test_a_fixed_lookahead_is_searched_alone(cpu_profile):
    request = Request(base=replace(Plan(), lookahead=1), max_staleness=2, max_workers=1, lookahead_fixed=True)
    assert {p.lookahead for p in candidates(request, cpu_profile)} == {1}
    assert {p.max_staleness for p in candidates(request, cpu_profile)} == {1, 2}


def test_gpu_search_respects_devices_and_memory(gpu_profile):
    base = Plan(group_size=8, batch_size=256, micro_batch_size=1, checkpoint_every=0, reward_batch_size=64)
    request = Request(base=base, gpus=16, nodes=2, max_staleness=2, batch_sizes=(256, 512))
    plans = candidates(request, gpu_profile)
    assert plans
    assert {p.workers + p.learner_devices for p in plans} >= {16, 12}  # every GPU busy, or some left idle
    for plan in plans:
        assert plan.workers + plan.learner_devices <= 16
        assert memory_problems(plan, gpu_profile) == []
        assert plan.batch_size % (plan.learner_devices * plan.micro_batch_size) == 0
    ranked = search(request, gpu_profile, top=3, simulate_at_most=3, updates=8)
    assert len(ranked) == 3 and all(check_plan(r.plan, request, gpu_profile) == [] for r in ranked)


def test_memory_rules_out_a_learner_that_cannot_hold_its_states(gpu_profile):
    # ZeRO-1 on one GPU keeps 16 bytes per parameter: 7.6 B x 16 = 122 GB > 72 GB usable
    problems = memory_problems(Plan(learner_devices=1, zero_stage=1, micro_batch_size=1, slots=1), gpu_profile)
    assert problems and "ZeRO-1 states 121.6 GB" in problems[0]
    # ZeRO-3 over 8 GPUs: 15.2 GB of states each, fits
    assert memory_problems(Plan(learner_devices=8, zero_stage=3, micro_batch_size=1, slots=64), gpu_profile) == []
    # a KV cache of 4,096 slots x 4,352 tokens x 56 kB does not
    assert "rollout" in memory_problems(Plan(learner_devices=8, zero_stage=3, micro_batch_size=1, slots=4096), gpu_profile)[0]


@pytest.mark.parametrize("request_kwargs, message", [
    (dict(base=replace(Plan(), lookahead=2), max_staleness=0, lookahead_fixed=True), "buffer.lookahead=2 with a staleness bound of 0"),
    (dict(base=Plan(), max_staleness=-1), "must be >= 0"),
])
def test_impossible_cpu_requests_are_refused(cpu_profile, request_kwargs, message):
    with pytest.raises(PlanError, match=message):
        search(Request(**request_kwargs), cpu_profile)


def test_gpus_are_refused_for_a_cpu_profile(cpu_profile):
    with pytest.raises(PlanError, match="--gpus applies to a GPU profile"):
        search(Request(base=Plan(), gpus=8), cpu_profile)


@pytest.mark.parametrize("gpus, nodes, message", [
    (1, 1, "needs --gpus >= 2"),
    (16, 3, "does not divide over --nodes 3"),
    (16, 1, "16 GPUs per node asked, the profile's nodes have 8: use --nodes 2"),
])
def test_impossible_gpu_requests_are_refused(gpu_profile, gpus, nodes, message):
    with pytest.raises(PlanError, match=message):
        search(Request(base=Plan(group_size=8, batch_size=256), gpus=gpus, nodes=nodes), gpu_profile)


def test_a_plan_needing_more_devices_than_given_names_both_numbers(gpu_profile):
    request = Request(base=Plan(), gpus=4)
    why = check_plan(Plan(workers=8, learner_devices=1, group_size=8, batch_size=256, micro_batch_size=1, slots=64,
                          zero_stage=3), request, gpu_profile)
    assert "8 worker(s) + 1 learner device(s) need 9 GPUs; 4 given" in why


def test_overrides_round_trip_through_the_run_config():
    plan = Plan(workers=3, slots=64, batch_size=64, micro_batch_size=16, max_staleness=4, lookahead=2)
    cfg = compose(overrides(plan, gpu=False))
    back = plan_from_config(cfg)
    assert (back.workers, back.slots, back.batch_size, back.micro_batch_size, back.max_staleness, back.lookahead) == \
        (3, 64, 64, 16, 4, 2)
    # a GPU plan: the local launcher's device lists, or the Ray launcher's GPU per actor
    gpu = replace(plan, workers=12, micro_batch_size=4, learner_devices=4, zero_stage=2)
    local = compose(overrides(gpu, gpu=True))
    assert (local.learner.devices, local.rollout.devices) == ([0, 1, 2, 3], list(range(4, 16)))
    assert plan_from_config(local) == gpu
    ray = compose([o for o in overrides(gpu, gpu=True) if "devices" not in o] + ray_overrides(gpu, gpu=True))
    assert ray.launcher == "ray" and (ray.ray.learner.ranks, ray.ray.learner.num_gpus, ray.ray.worker.num_gpus) == (4, 1, 1)
    assert ray.ray.learner.strategy == "STRICT_PACK"  # 4 ranks fit one node of 8
    assert "ray.learner.strategy=PACK" in ray_overrides(replace(gpu, learner_devices=16), gpu=True)


def test_a_profile_of_another_model_or_engine_is_refused_naming_both(cpu_profile):
    check_identity(cpu_profile, compose([]))  # the default run: the tiny model, hf, torch, CPU
    with pytest.raises(ProfileError, match=r"rollout_engine 'hf' \(profile\) vs 'vllm' \(asked\)"):
        check_identity(cpu_profile, compose(["rollout.engine=vllm"]), PROFILE)
    with pytest.raises(ProfileError, match=r"model 'tiny\(hidden 64.*\(profile\) vs 'tiny\(hidden 128"):
        check_identity(cpu_profile, compose(["model.tiny.hidden_size=128"]), PROFILE)


def test_unusable_profiles_say_what_to_do(tmp_path, cpu_profile):
    with pytest.raises(ProfileError, match="does not exist: make one with `rlhf-plan profile"):
        load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ProfileError, match="cannot be read as JSON"):
        load(tmp_path / "bad.json")
    doc = cpu_profile.to_dict()
    doc["learner"]["speed_of_light"] = 1.0
    del doc["sync"]["bytes"]
    (tmp_path / "keys.json").write_text(json.dumps(doc))
    with pytest.raises(ProfileError, match=r"learner: unknown key\(s\) \['speed_of_light'\]"):
        load(tmp_path / "keys.json")
    doc = cpu_profile.to_dict()
    doc["schema"] = 99
    (tmp_path / "schema.json").write_text(json.dumps(doc))
    with pytest.raises(ProfileError, match="schema 99"):
        load(tmp_path / "schema.json")


def test_a_saved_profile_loads_back_equal(tmp_path, cpu_profile, gpu_profile):
    for profile in (cpu_profile, gpu_profile):
        assert load(profile.save(tmp_path / "p.json")) == profile
