"""Plan search and profiles: only feasible plans come back, impossible requests are refused with
what to change, profiles of another model or engine are refused, overrides round-trip."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from rlhf_run.plan.bounds import learner_bound, upper_bound
from rlhf_run.plan.cli import compose
from rlhf_run.plan.profile import ProfileError, check_identity, load
from rlhf_run.plan.records import Plan
from rlhf_run.plan.scale import published_7b
from rlhf_run.plan.search import (
    PlanError,
    Request,
    candidates,
    check_plan,
    memory_problems,
    overrides,
    plan_from_config,
    ray_overrides,
    search,
    spans_nodes,
    tightest_staleness,
)
from rlhf_run.plan.simulate import same_run, simulate

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


def test_micro_batches_fit_the_minibatch_and_every_printed_plan_passes_the_runs_checks(cpu_profile, capsys):
    # experiment=ppo trains each batch of 32 in 2 minibatches of 16: the search proposed
    # learner.micro_batch_size=32, which rlhf-run refuses ('must be between 1 and the minibatch size 16')
    from rlhf_core.config import validate
    from rlhf_run.plan import cli

    request = Request(base=Plan(workers=1, group_size=1, num_minibatches=2, max_staleness=0, lookahead=0),
                      max_staleness=0, max_workers=1)
    assert sorted({r.plan.micro_batch_size for r in search(request, cpu_profile, top=100, updates=30)}) == [8, 16]
    assert check_plan(replace(request.base, micro_batch_size=32), request, cpu_profile) == [
        "learner.micro_batch_size 32 is outside 1..16 (the minibatch: learner.batch_size / learner.num_minibatches)"]
    with pytest.raises(SystemExit) as exit_:
        cli.main(["search", "--profile", str(PROFILE), "--max-workers", "1", "--max-staleness", "0", "--updates", "30",
                  "--top", "8", "--json", "experiment=ppo"])
    assert exit_.value.code == 0, capsys.readouterr().err
    plans = json.loads(capsys.readouterr().out)
    assert len(plans) == 8
    for p in plans:
        validate(compose(["experiment=ppo", *p["overrides"]]))


def test_a_fixed_lookahead_is_searched_alone(cpu_profile):
    request = Request(base=replace(Plan(), lookahead=1), max_staleness=2, max_workers=1, lookahead_fixed=True)
    assert {p.lookahead for p in candidates(request, cpu_profile)} == {1}
    assert {p.max_staleness for p in candidates(request, cpu_profile)} == {1, 2}


def test_gpu_search_respects_devices_and_memory(gpu_profile):
    base = Plan(group_size=8, batch_size=256, micro_batch_size=1, checkpoint_every=1000, reward_batch_size=64)
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


def test_branch_and_bound_returns_the_exhaustive_searchs_best_on_four_gpus(gpu_profile):
    # 4 GPUs, batch 256, staleness <= 1, 10 simulated updates (a window of 10 - 2 - 5 = 3 cycles).
    # The learner takes 2 GPUs (one cannot hold 7.6 B parameters' states), with the fastest ZeRO
    # stage and micro-batch that fit (ZeRO-3, 4): 12 plans = workers {1, 2} x slots {64, 128} x
    # (staleness, lookahead) in {(0, 0), (1, 0), (1, 1)}. Learner bound, every plan: a cycle is the update
    # (17.84 s: 256 x 1,190 tokens x 6 x 7.6e9 FLOP at 40% of 989 TFLOP/s on 2 GPUs, + ZeRO-3's
    # traffic) + read 0.13 + per_update 0.02 + snapshot 0.03 = 18.02 s (the 0.31 s send overlaps):
    # 3 x 256 / (17.99 + 0.03 + 2 x 18.02) = 14.20 samples/s. Rollout: a batch's longest response
    # (4,095 steps at >= 6.99 ms) takes 28.6 s; with lookahead 0 nothing overlaps it: snapshot 0.03
    # + send 0.31 + pull 0.31 + 28.6 + read and update 17.97 = 47.3 s a version, 256 / 47.3 x 1.10
    # (the chain's margin) = 5.96 samples/s for the plans with lookahead 0 (5.29 for one worker with
    # 64 slots, whose 256 x 135 ms = 34.6 s of work outlasts the 28.6); lookahead 1 halves the chain
    # (23.6 s; 26.6 s for that worker): 256 / 26.6 x 1.10 = 7.56. The three others with lookahead 1 are
    # bounded by 256 / 23.6 x 1.10 = 11.9: simulated, they train 7.46 (1 x 128), 8.17 (2 x 64) and
    # 9.12 samples/s (2 x 128), and the 9 plans left are ruled out (5.96, 7.56 < 9.12).
    base = Plan(group_size=8, batch_size=256, micro_batch_size=1, checkpoint_every=1000, lookahead=1, reward_batch_size=64)
    request = Request(base=base, gpus=4, nodes=1, max_staleness=1, batch_sizes=(256,))
    cache: dict = {}
    everything = search(request, gpu_profile, top=12, updates=10, exhaustive=True, cache=cache)
    stats: dict = {}
    pruned = search(request, gpu_profile, top=1, updates=10, stats=stats)
    assert len(everything) == stats["candidates"] == 12
    assert pruned[0].plan == everything[0].plan and pruned[0].result == everything[0].result
    assert (pruned[0].plan.workers, pruned[0].plan.slots, pruned[0].plan.lookahead) == (2, 128, 1)
    assert pruned[0].result.trained_samples_per_s == pytest.approx(9.12, abs=0.01)
    assert stats["simulated"] == 3 and stats["exact"] and stats["gap"] == 0.0
    for r in everything:  # the bound holds for every plan; the learner's part is a proof
        assert r.result.trained_samples_per_s <= upper_bound(r.plan, gpu_profile, 10, 5) * (1 + 1e-9)
        assert learner_bound(r.plan, gpu_profile, 10, 5) == pytest.approx(14.204, abs=1e-3)
    # capped at one simulation, the search says how much faster a plan left could still be: 11.9 / its rate - 1
    capped: dict = {}
    first = search(request, gpu_profile, top=1, updates=10, stats=capped, simulate_at_most=1)[0]
    assert capped["simulated"] == 1 and not capped["exact"]
    assert capped["gap"] == pytest.approx(11.916 / first.result.trained_samples_per_s - 1, abs=1e-3) and capped["gap"] > 0.3
    # the cache makes a second search free
    again: dict = {}
    search(request, gpu_profile, top=1, updates=10, stats=again, cache=cache)
    assert again["simulated"] == 0 and again["exact"]


def test_a_run_that_dropped_nothing_replays_for_a_looser_staleness_bound(cpu_profile):
    plan = Plan(workers=1, max_staleness=2, lookahead=1)
    run = simulate(cpu_profile, plan, updates=60, warmup=10)
    assert run.samples_dropped == 0 and run.max_lag_seen <= 2
    looser = replace(plan, max_staleness=4)
    assert same_run(plan, run, looser)
    assert simulate(cpu_profile, looser, updates=60, warmup=10) == run  # the bound never acted: the same events
    assert not same_run(plan, run, replace(plan, lookahead=2))  # pacing differs
    assert tightest_staleness(looser, run).max_staleness == max(1, run.max_lag_seen)


def test_learner_bound_is_reached_by_a_learner_bound_plan(gpu_profile):
    # eight workers three batches ahead of a two-GPU learner: it never waits, and its rate is the bound
    plan = Plan(workers=8, slots=128, batch_size=256, micro_batch_size=4, group_size=8, max_staleness=3, lookahead=3,
                learner_devices=2, zero_stage=3, checkpoint_every=1000, reward_batch_size=64)
    run = simulate(gpu_profile, plan, updates=12, warmup=5)
    assert run.learner_idle_frac == pytest.approx(0.0, abs=1e-9)
    assert run.trained_samples_per_s == pytest.approx(learner_bound(plan, gpu_profile, 12, 5), rel=1e-9)


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


def test_the_planner_refuses_what_the_run_refuses(capsys):
    # learner.checkpoint_every=0 passed, the learner then checkpointed after every update and the
    # simulator never: the planner now takes the run's config through rlhf-run's own checks
    from rlhf_run.plan import cli

    for command in ("simulate", "search"):
        with pytest.raises(SystemExit) as exit_:
            cli.main([command, "--profile", str(PROFILE), "learner.checkpoint_every=0"])
        assert exit_.value.code == 2 and "learner.checkpoint_every must be >= 1 update, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("setting", ["buffer.max_reuse=4", "buffer.sampling=uniform", "buffer.samples_per_insert=1"])
def test_a_replay_config_is_refused_until_the_simulator_models_it(capsys, setting):
    # the simulator trains each group once, in order; plan_from_config dropped the replay settings
    # and buffer.max_reuse=4 buffer.sampling=uniform printed the FIFO run's prediction
    from rlhf_run.plan import cli

    with pytest.raises(PlanError, match=r"models a FIFO buffer only; this config runs it in replay mode \(buffer.max_reuse="):
        plan_from_config(compose([setting]))
    for command in (["simulate", "--profile", str(PROFILE)], ["search", "--profile", str(PROFILE)], ["profile"]):
        with pytest.raises(SystemExit) as exit_:
            cli.main([*command, setting])
        assert exit_.value.code == 2 and "replay mode" in capsys.readouterr().err


def test_a_plan_over_several_nodes_is_printed_with_the_ray_command_only(tmp_path, gpu_profile, capsys):
    # --gpus 16 --nodes 2: the local launcher runs every role on its one machine, whose 8 GPUs
    # rollout.devices=[8,...,15] do not name; it printed that command as 'run the best plan'
    import re

    from rlhf_run.plan import cli

    profile = replace(gpu_profile, source={**gpu_profile.source, "overrides": list(cli.PUBLISHED_OVERRIDES)})
    path = str(profile.save(tmp_path / "p7b.json"))
    request = Request(base=plan_from_config(compose(list(cli.PUBLISHED_OVERRIDES))), gpus=16, nodes=2)
    assert spans_nodes(replace(request.base, workers=8, learner_devices=1), request)
    assert not spans_nodes(replace(request.base, workers=7, learner_devices=1), request)
    search_args = ["search", "--profile", path, "--gpus", "16", "--nodes", "2", "--updates", "8", "--max-simulations", "2"]
    with pytest.raises(SystemExit) as exit_:
        cli.main([*search_args, "--top", "1"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and "run the best plan" not in out and "devices=" not in out, out
    needs = int(re.search(r"the best plan needs (\d+) GPUs, more than a node's 8: run it on a Ray cluster:\n  rlhf-run ",
                          out).group(1))
    assert needs > 8 and "launcher=ray" in out
    with pytest.raises(SystemExit):
        cli.main([*search_args, "--top", "3", "--json"])
    for p in json.loads(capsys.readouterr().out):  # the local launcher's overrides only where they fit a node
        fits = p["plan"]["workers"] + p["plan"]["learner_devices"] <= 8
        assert (p["overrides"] is not None) == fits and "launcher=ray" in p["ray_overrides"]


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


def test_the_calibration_fits_decoding_against_the_context_of_the_rows_still_decoding(monkeypatch):
    """A decoding step costs base + per_row * rows + per_ctx_token * (context of its rows). The
    context of finished responses stayed in the count, so late steps of a wave, with few rows
    left, were fitted against rows long gone: per-context cost 2.7x too low with lengths 2 .. 32.
    An engine whose step costs exactly 1 ms + 0.01 ms a row + 1 us a context token, on a fake
    CPU clock, is fitted back to those numbers."""
    import itertools
    from types import SimpleNamespace

    import rollout_workers.engine_factory as EF
    from rlhf_core.config import Config
    from rlhf_run.plan import measure

    base, per_row, per_ctx, lengths = 1e-3, 1e-5, 1e-6, [2, 4, 8, 16, 32]
    clock = [0.0]

    class Engine:
        def __init__(self) -> None:
            self.rows, self.seq = [], itertools.count()

        def add(self, req):
            self.rows.append({"req": req, "tokens": 0, "len": lengths[next(self.seq) % len(lengths)]})

        def has_work(self):
            return bool(self.rows)

        def num_active(self):
            return len(self.rows)

        def num_waiting(self):
            return 0

        def step(self):
            clock[0] += base + per_row * len(self.rows) + per_ctx * sum(len(r["req"].prompt_ids) + r["tokens"]
                                                                        for r in self.rows)
            for r in self.rows:
                r["tokens"] += 2 if r["tokens"] == 0 else 1  # the prefill pass samples one, its decode another
            done = [r for r in self.rows if r["tokens"] >= r["len"]]
            self.rows = [r for r in self.rows if r["tokens"] < r["len"]]
            return [SimpleNamespace(request_id=r["req"].request_id, prompt_ids=r["req"].prompt_ids, num_tokens=r["len"])
                    for r in done]

        def close(self):
            pass

    monkeypatch.setattr(EF, "make_engine", lambda *a, **k: Engine())
    monkeypatch.setattr(measure.time, "thread_time", lambda: clock[0])
    gen, _ = measure.measure_generation(Config(), reps=1)
    assert (gen.decode_base, gen.decode_per_row, gen.decode_per_ctx_token) == pytest.approx((base, per_row, per_ctx),
                                                                                          rel=1e-6)


def test_a_profile_from_a_run_finds_the_checkpoint_after_its_metrics_line(tmp_path):
    """The learner writes update u's line, then checkpoints (u % checkpoint_every == 0), then waits:
    the checkpoint is in the gap between rows u and u + 1. The gaps that end at row u were taken,
    and checkpoint_s came out 0.0, also on the stored run (its gaps after updates 30, 40 and 50
    are 60-80 ms against 1-20 ms elsewhere)."""
    import json
    import shutil

    from rlhf_run.plan.fromrun import profile_from_run

    run = Path(__file__).parents[1] / "integration" / "data" / "plan_run"
    assert profile_from_run(run).learner.checkpoint_s > 0.02
    shutil.copytree(run, tmp_path / "run")
    path = tmp_path / "run" / "metrics.jsonl"
    # the stored run checkpoints every 10 updates; a clock where each update waits 20 ms, computes
    # 10 ms and spends 5 ms besides, and the one after a checkpointed update also the checkpoint's 80 ms
    t, rows = 1000.0, []
    for r in (json.loads(line) for line in path.read_text().splitlines()):
        u = r["learner/updates"]
        t += 0.020 + 0.010 + 0.005 + (0.080 if u > 1 and (u - 1) % 10 == 0 else 0.0)
        rows.append({**r, "time": t, "learner/time_wait_s": 0.020, "learner/time_compute_s": 0.010})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    fitted = profile_from_run(tmp_path / "run").learner
    assert fitted.per_update == pytest.approx(0.005, abs=1e-6)
    assert fitted.checkpoint_s == pytest.approx(0.080, abs=1e-6)


def test_a_profile_from_a_run_counts_decoding_batches_as_the_learners_read(tmp_path):
    """A run's rows with ``learner/time_read_s``: the read moves out of the per-update rest into
    ``read_per_sample`` (the stored run predates the metric: its read was in the waits)."""
    import json
    import shutil

    from rlhf_run.plan.fromrun import profile_from_run

    run = Path(__file__).parents[1] / "integration" / "data" / "plan_run"
    before = profile_from_run(run).learner
    assert before.read_per_sample == 0.0
    shutil.copytree(run, tmp_path / "run")
    path = tmp_path / "run" / "metrics.jsonl"
    # every update decoded its 32 samples in 3.2 ms (1e-4 s each), taken from its wait
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rows = [{**r, "learner/time_read_s": 0.0032, "learner/time_wait_s": r["learner/time_wait_s"] - 0.0032} for r in rows]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    after = profile_from_run(tmp_path / "run").learner
    assert after.read_per_sample == pytest.approx(1e-4)
    # the time between updates is the same: what was the wait's is the read's, the rest unchanged
    assert after.per_update == pytest.approx(before.per_update)


def test_a_profile_from_a_run_takes_the_prompt_length_the_learner_recorded(tmp_path):
    """``learner/num_tokens`` counts response (policy) tokens only: the prompt length derived as
    tokens / batch - response length came out 0, floored to 1, whatever the prompts were. The
    learner records the batch's mean prompt length; the profile takes it, and fits the update's
    cost against prompt + response tokens, the tokens its cost model charges."""
    import json
    import shutil

    from rlhf_core import metric_names as M
    from rlhf_run.plan.fromrun import profile_from_run

    run = Path(__file__).parents[1] / "integration" / "data" / "plan_run"
    # the stored run predates the metric: its prompt length is unknown, rollout.max_prompt_tokens (64) bounds it
    assert profile_from_run(run).generation.prompt_tokens.mean() == 64
    shutil.copytree(run, tmp_path / "run")
    path = tmp_path / "run" / "metrics.jsonl"
    # prompts of 20 or 30 tokens (alternating); each update computes 2 ms + 10 us per token trained:
    # update 1 (num_samples 32, response mean 5.84375, prompts 30): 32 * (30 + 5.84375) = 1147 tokens -> 13.47 ms
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for r in rows:
        r[M.PROMPT_LEN_MEAN] = 20.0 if r[M.UPDATES] % 2 == 0 else 30.0
        r[M.TIME_COMPUTE_S] = 0.002 + 1e-5 * r[M.NUM_SAMPLES] * (r[M.PROMPT_LEN_MEAN] + r["reward/response_len_mean"])
    assert rows[0][M.TIME_COMPUTE_S] == pytest.approx(0.01347)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    profile = profile_from_run(tmp_path / "run")
    assert profile.generation.prompt_tokens.mean() == 25  # the mean of 20 and 30 over the rows after the warm-up
    lc = profile.learner
    assert (lc.update_base, lc.update_per_token) == pytest.approx((0.002, 1e-5), rel=1e-6)
    assert lc.update_s(32, 1147.0, 32) == pytest.approx(0.01347)


def test_a_run_config_that_is_not_a_map_is_refused(tmp_path):
    from rlhf_run.plan.fromrun import _config

    (tmp_path / "run_config.yaml").write_text("- a\n- b\n")
    with pytest.raises(ProfileError, match="is not a map of config sections"):
        _config(tmp_path)
