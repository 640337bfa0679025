"""The planner's discrete-event kernel and pipeline simulation: sharing arithmetic, pacing's
bound at every simulated instant, conservation of samples, staleness within the bound, seeds."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import pytest

from rlhf_run.plan.des import CPU, SLEEP, STEPS, WAIT, Kernel, Signal
from rlhf_run.plan.profile import load
from rlhf_run.plan.records import Plan
from rlhf_run.plan.simulate import Simulation, simulate

PROFILE = Path(__file__).parent / "data" / "plan_profile_cpu.json"


@pytest.fixture(scope="module")
def profile():
    return load(PROFILE)


# ---- the kernel ------------------------------------------------------------------------------


def _job(kernel, work, done, name):
    def proc():
        yield CPU, work
        done[name] = kernel.now

    kernel.spawn(proc(), name)


def test_two_busy_threads_on_two_cores_each_run_contention_times_slower():
    k = Kernel("cpu", cores=2, contention=1.35)
    done = {}
    _job(k, 1.0, done, "a")
    _job(k, 1.0, done, "b")
    k.run(10)
    # both busy the whole time: 1 s of work at 1 / 1.35 per second
    assert done == pytest.approx({"a": 1.35, "b": 1.35})


def test_three_threads_share_two_cores_and_rates_change_when_one_ends():
    k = Kernel("cpu", cores=2, contention=1.5)
    done = {}
    _job(k, 0.5, done, "short")
    _job(k, 1.0, done, "a")
    _job(k, 1.0, done, "b")
    k.run(10)
    # three busy: each gets 2/3 of a core, slowed 1.5x -> 4/9 work per second; the short job
    # (0.5) ends at 1.125 s. Then two busy: 1/1.5 per second for the remaining 0.5 -> +0.75 s
    assert done["short"] == pytest.approx(1.125)
    assert done["a"] == pytest.approx(1.875) and done["b"] == pytest.approx(1.875)


def test_background_load_takes_its_share():
    k = Kernel("cpu", cores=2, contention=1.0, background=1.0)
    done = {}
    _job(k, 1.0, done, "a")
    _job(k, 1.0, done, "b")
    k.run(10)
    # two of ours + one background thread on two cores: 2/3 of a core each
    assert done["a"] == pytest.approx(1.5)


def test_four_busy_threads_on_two_cores_follow_processor_sharing():
    """More busy threads than cores: each gets cores / threads of a core, and the rates change
    as jobs end (4 -> 3 -> 2 threads), as the kernel's fair scheduler shares them."""
    k = Kernel("cpu", cores=2, contention=1.0)
    done = {}
    for name, work in (("a", 0.5), ("b", 1.0), ("c", 2.0), ("d", 2.0)):
        _job(k, work, done, name)
    k.run(10)
    # 4 busy at 1/2 a core: a's 0.5 ends at 1.0 (everyone has done 0.5); 3 busy at 2/3: b's
    # remaining 0.5 takes 0.75 (ends 1.75, c and d at 1.0); 2 busy on 2 cores: 1.0 more, at 2.75
    assert done == pytest.approx({"a": 1.0, "b": 1.75, "c": 2.75, "d": 2.75})


def _woken(k, at, work, out):
    """A thread that waits for a signal fired at ``at`` (by a timer), then computes ``work``."""
    sig = Signal()

    def proc():
        yield WAIT, sig, None
        out["woke"] = k.now
        yield CPU, work
        out["done"] = k.now

    k.spawn(proc(), "woken")
    k.call_at(at, lambda: k.fire(sig))


def test_a_thread_woken_while_the_cores_are_busy_waits_for_one():
    k = Kernel("cpu", cores=2, contention=1.0, handoff=0.001, handoff_busy=0.002)
    done, out = {}, {}
    _job(k, 10.0, done, "a")
    _job(k, 10.0, done, "b")
    _woken(k, 1.0, 0.3, out)
    k.run(20)
    # fired at 1.0 with both cores busy: it is the one runnable thread beyond the cores, so it
    # waits 1 ms + 2 ms; then three threads share two cores (2/3 each): 0.3 of work takes 0.45 s
    assert out["woke"] == pytest.approx(1.003)
    assert out["done"] == pytest.approx(1.453)
    # a and b did 1.003 alone, 0.3 beside it, and the rest (8.697) alone again
    assert done["a"] == pytest.approx(1.453 + 8.697)


def test_a_thread_woken_with_a_core_free_waits_the_free_hand_off_only():
    k = Kernel("cpu", cores=2, contention=1.0, handoff=0.001, handoff_busy=0.002)
    done, out = {}, {}
    _job(k, 10.0, done, "a")
    _woken(k, 1.0, 0.3, out)
    k.run(20)
    assert out["woke"] == pytest.approx(1.001)
    assert out["done"] == pytest.approx(1.301)  # two threads, two cores: full speed


def test_other_jobs_demand_counts_in_the_wait_for_a_core():
    # one of ours busy and 3 other runnable threads on 2 cores: the woken thread is the third
    # beyond the cores (1 + 3 + 1 - 2), 3 x 2 ms on top of the 1 ms
    k = Kernel("cpu", cores=2, contention=1.0, background=3.0, handoff=0.001, handoff_busy=0.002)
    done, out = {}, {}
    _job(k, 10.0, done, "a")
    _woken(k, 1.0, 0.1, out)
    k.run(30)
    assert out["woke"] == pytest.approx(1.007)
    # then 2 of ours + 3 others on 2 cores: 0.4 of a core each, 0.1 of work takes 0.25 s
    assert out["done"] == pytest.approx(1.257)


def test_device_mode_runs_every_process_at_full_speed():
    k = Kernel("device")
    done = {}
    for name in "abc":
        _job(k, 2.0, done, name)
    k.run(10)
    assert done == pytest.approx({"a": 2.0, "b": 2.0, "c": 2.0})


def test_interrupted_steps_end_after_the_step_in_progress():
    k = Kernel("device")
    out = {}

    def stepper():
        out["steps"] = yield STEPS, 10, 0.1
        out["t"] = k.now

    proc = k.spawn(stepper(), "stepper")
    k.call_at(0.25, lambda: k.interrupt(proc))  # inside the third step (0.2 .. 0.3)
    k.run(10)
    assert out == {"steps": 3, "t": pytest.approx(0.3)}


def test_wait_returns_true_when_fired_and_false_on_timeout():
    k = Kernel("device")
    sig, out = Signal(), []

    def waiter(timeout):
        out.append((timeout, (yield WAIT, sig, timeout), k.now))

    def firer():
        yield SLEEP, 1.0
        k.fire(sig)

    k.spawn(waiter(0.5), "short")
    k.spawn(waiter(5.0), "long")
    k.spawn(firer(), "firer")
    k.run(10)
    assert out == [(0.5, False, 0.5), (5.0, True, 1.0)]


# ---- the pipeline ----------------------------------------------------------------------------

GRID = [
    Plan(workers=1, max_staleness=0, lookahead=0),
    Plan(workers=1, max_staleness=2, lookahead=1),
    Plan(workers=2, max_staleness=2, lookahead=2),
    Plan(workers=3, max_staleness=4, lookahead=None, slots=16),
    Plan(workers=3, max_staleness=1, lookahead=1, slots=128, batch_size=64, micro_batch_size=32),
    Plan(workers=2, max_staleness=4, lookahead=4, slots=8, batch_size=16, micro_batch_size=16),
]


@pytest.mark.parametrize("plan", GRID, ids=lambda p: f"w{p.workers}-s{p.max_staleness}-la{p.lookahead}-slots{p.slots}")
@pytest.mark.parametrize("background", [0.0, 1.5])
def test_invariants_hold_at_every_simulated_instant(profile, plan, background):
    sim = Simulation(profile, plan, seed=3, background=background)
    result = sim.run(updates=120, warmup=10, check=True)
    assert sim.violations == []
    assert result.updates == 120
    # pacing: never more admitted than (ahead + version + 1) batches
    assert result.max_admitted_over_bound <= 0
    # every group generated with weights at least its lease's version
    assert result.min_version_margin >= 0
    # conservation, at the end: admitted = generated + in flight; generated = trained + dropped + left
    assert result.samples_generated == result.samples_trained + result.samples_dropped + result.samples_in_buffer
    assert result.samples_trained == 120 * plan.batch_size
    # staleness of what was trained within the bound
    assert len(result.staleness_hist) <= plan.max_staleness + 1
    assert sum(result.staleness_hist) == (120 - 10) * plan.batch_size


def test_the_invariant_check_sees_a_pacing_violation(profile):
    """The check itself can fail: a simulation whose claims ignore the budget is caught."""
    sim = Simulation(profile, Plan(workers=2, max_staleness=0, lookahead=0), seed=0)

    def greedy(w, capacity):
        sim.admitted += capacity * sim.plan.group_size
        sim.claimed += capacity * sim.plan.group_size
        return capacity

    sim.claim = greedy
    sim.run(updates=10, check=True)
    assert any("bound" in v for _, v in sim.violations)


def test_same_seed_same_result_and_the_seed_matters(profile):
    plan = Plan(workers=2, max_staleness=2, lookahead=1)
    a, b = simulate(profile, plan, updates=150, seed=1), simulate(profile, plan, updates=150, seed=1)
    assert a.to_dict() == b.to_dict()
    c = simulate(profile, plan, updates=150, seed=2)
    assert c.trained_samples_per_s != a.trained_samples_per_s  # other response lengths, other timing


def test_sync_trains_fresh_samples_and_waits_for_generation(profile):
    sync = simulate(profile, Plan(workers=1, max_staleness=0, lookahead=0), updates=200)
    async_ = simulate(profile, Plan(workers=1, max_staleness=2, lookahead=1), updates=200)
    assert sync.staleness_hist == [sync.samples_trained - 20 * 32]
    assert sync.learner_idle_frac > 0.3  # generation and training take turns
    # overlapping them is faster (bench/e2e.py measures 1.8x on two cores) at staleness ~1
    assert async_.trained_samples_per_s > 1.3 * sync.trained_samples_per_s
    assert 0.9 <= async_.staleness_mean <= 1.0


def _with_handoff(profile, free, busy):
    return replace(profile, machine=replace(profile.machine, handoff_s=free, handoff_busy_s=busy))


def test_a_sync_update_pays_every_hand_off_on_its_critical_path(profile):
    """Staleness 0: learner and worker take turns, so each hand-off of one update's chain is
    waited for: the learner's publish thread woken, the publish (to the weight server and the
    buffer's version: 2 round trips), the idle worker woken, its claim and pull (2 round trips),
    its scoring thread woken, its 2 ms sleep while only scoring is left, the append (a round
    trip), the learner woken by it (its read request went out before: not on the path):
    1 + 4 + 1 + 4 + 1 + 1 + 2 + 1 = 15 hand-offs. With 1 ms each and a core free for all of
    them (one worker: at most two of ours busy at once), an update takes about 15 ms longer."""
    plan = Plan(workers=1, max_staleness=0, lookahead=0)
    base = simulate(profile, plan, updates=200)
    slow = simulate(_with_handoff(profile, 0.001, 0.0), plan, updates=200)
    per_update = lambda r: plan.batch_size / r.trained_samples_per_s  # noqa: E731
    assert 0.014 <= per_update(slow) - per_update(base) <= 0.016
    # asynchronous, the learner's batch is mostly there: far less of it shows
    aplan = Plan(workers=2, max_staleness=2, lookahead=1)
    a0, a1 = simulate(profile, aplan, updates=200), simulate(_with_handoff(profile, 0.001, 0.0), aplan, updates=200)
    assert per_update(a1) - per_update(a0) < 0.5 * (per_update(slow) - per_update(base))


def test_the_wait_for_a_core_grows_with_the_threads_beyond_the_cores(profile):
    """Oversubscribed (3 workers beside the learner on 2 cores, or other jobs' demand): the same
    plan is slower the more threads wait for a core at each hand-off; the cost per hand-off
    beyond the cores adds nothing while a core is free (one thread busy, nothing else)."""
    plan = Plan(workers=3, max_staleness=4, lookahead=1)
    busy = _with_handoff(profile, 0.0, 0.0005)
    r0 = simulate(profile, plan, updates=150).trained_samples_per_s
    r1 = simulate(busy, plan, updates=150).trained_samples_per_s
    r2 = simulate(busy, plan, updates=150, background=2.0).trained_samples_per_s
    r2_free = simulate(profile, plan, updates=150, background=2.0).trained_samples_per_s
    assert r1 < r0 and r2 < r2_free
    assert r2 / r2_free < r1 / r0  # more runnable beyond the cores: each hand-off waits longer


def test_one_worker_gains_from_lookahead_two_with_two_batches_of_slots(profile):
    # docs/architecture.md (Lookahead): with lookahead 1 a single worker waits for every publish
    # and pull; lookahead 2 and 64 slots decode both admitted batches in one wave
    one = simulate(profile, Plan(workers=1, slots=32, lookahead=1), updates=300)
    two = simulate(profile, Plan(workers=1, slots=64, lookahead=2), updates=300)
    assert two.trained_samples_per_s > one.trained_samples_per_s
    assert two.staleness_mean > 1.5


def test_a_simulated_hour_of_the_default_task_takes_seconds(profile):
    t0 = time.process_time()
    sim = Simulation(profile, Plan())  # the default run: 2 workers, 32 slots, lookahead 1, staleness 2
    result = sim.run(updates=10**9, max_sim_s=600.0)
    cpu = time.process_time() - t0
    assert result.sim_s == pytest.approx(600.0)
    assert result.samples_trained > 600 * 500  # ~1,000 samples/s on this profile
    assert cpu < 5.0, f"10 simulated minutes took {cpu:.1f} s of CPU (an hour: {6 * cpu:.0f} s)"


def test_gpu_plans_use_one_device_per_process():
    from rlhf_run.plan.scale import published_7b

    profile = published_7b("nccl")
    plan = Plan(workers=8, slots=128, batch_size=256, micro_batch_size=1, group_size=8, max_staleness=2, lookahead=2,
                learner_devices=8, zero_stage=2, checkpoint_every=1000, reward_batch_size=64)
    sim = Simulation(profile, plan)
    result = sim.run(updates=12, warmup=2, check=True)
    assert sim.violations == []
    assert result.trained_samples_per_s > 0
    more = simulate(profile, replace(plan, workers=16), updates=12, warmup=2)
    assert more.trained_samples_per_s > result.trained_samples_per_s  # generation-bound: more rollout GPUs help


def test_the_published_checkpoint_is_written_by_the_learners_nodes_together():
    """16 bytes/parameter (fp32 master weights and Adam's two moments), each of the learner's
    nodes writing its share at 2 GB/s. It was 16 p / 2 GB/s / 4 for every plan: four nodes' time
    for a learner on one node or on eight."""
    from rlhf_run.plan.scale import published_7b

    lc = published_7b().learner
    one = 16 * 7.6e9 / 2e9  # 60.8 s: one node writes all of it
    assert lc.checkpoint_time(1, 8) == lc.checkpoint_time(8, 8) == pytest.approx(one)
    assert lc.checkpoint_time(9, 8) == pytest.approx(one / 2)  # 9 devices span 2 nodes
    assert lc.checkpoint_time(64, 8) == pytest.approx(one / 8)  # 7.6 s


def test_other_jobs_demand_is_found_from_the_cores_they_used_even_far_beyond_the_cores(profile):
    """A loaded machine (load average 20 on 2 cores): other jobs used 1.8 cores during a run of the
    default plan; the demand under which the simulated run leaves them that much is ~20 runnable
    threads (processor sharing: 1.8 of 2 cores against our ~2 busy), beyond the bisection's
    first bracket of 6."""
    from rlhf_run.plan.simulate import background_demand

    demand, sim = background_demand(profile, Plan(), 1.8, updates=100, warmup=20)
    assert demand > 6
    assert sim.background_cores_used == pytest.approx(1.8, abs=0.02)
    assert background_demand(profile, Plan(), 0.0, updates=100, warmup=20)[0] == 0.0  # a quiet machine
