"""Rollout workers as real child processes (``python -m rollout_workers`` with Hydra overrides,
as ``rlhf-run`` starts them) against a real redis-server and weight server: two workers fill
the buffer, one is SIGKILLed mid-generation and loses nothing, and SIGTERM drains a worker
without leaving a lease behind. The test plays the learner."""

from __future__ import annotations

import signal

import numpy as np
import psutil
import pytest

from worker_helpers import FakeLearner, check_sample, compose, gate_overrides, log_tail, overrides, recompute, spawn_worker, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

START_S = 60  # a child imports torch + transformers: seconds on a busy 2-core machine


@pytest.fixture
def hf_engine(tiny_model_cfg):
    """The hf engine: these tests are about the buffer's leases and a worker process's signals;
    a vLLM worker process (its start, its engine core's death) is test_vllm_processes.py's, and
    each vLLM start costs a minute of the suite's budget here."""
    return tiny_model_cfg, [], START_S


@pytest.fixture
def children(tmp_path):
    """Spawned workers, killed (by PID) if a test leaves one running."""
    procs = {}

    def spawn(override_list, worker_id):
        procs[worker_id] = spawn_worker(override_list, worker_id, tmp_path)
        return procs[worker_id]

    yield spawn
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def alive(proc, worker_id, tmp_path):
    assert proc.poll() is None, f"{worker_id} exited with {proc.returncode}:\n{log_tail(tmp_path, worker_id)}"
    return True


def gated(ov: list[str], gate_file) -> list[str]:
    """``ov`` for a worker that completes exactly one group, then holds the next prompt's lease
    while ``gate_file`` exists (one slot: one group generated and scored at a time)."""
    return ov + ["rollout.slots=1", *gate_overrides(gate_file, free=4)]


@pytest.mark.timeout(720)  # two children start one after the other
def test_two_workers_fill_the_buffer_and_a_killed_one_loses_nothing(redis_url, weight_server, hf_engine, children, tmp_path):
    model_cfg, engine_ov, start_s = hf_engine
    # a lease outlives a heartbeat missed on a loaded machine: nothing is reclaimed before the kill
    ov = overrides(redis_url, "two-workers", weight_server, model_cfg, buffer__lease_timeout_s=10.0,
                   rollout__slots=4, rollout__max_new_tokens=32, rollout__max_prompt_tokens=16, extra=engine_ov)
    learner = FakeLearner(compose(ov))
    try:
        learner.publish(0, seed=1)
        prompts = learner.enqueue(24)
        # w-a alone first, so it gets prompts however slowly it starts; it completes one group and
        # then holds one lease for good (its gate never opens): the state to kill it in
        a = children(gated(ov, tmp_path / "gate-a"), "w-a")
        wait_for(lambda: alive(a, "w-a", tmp_path) and learner.consumer_stats_prompts("w-a") == 1
                 and learner.leases_of("w-a"), start_s, "w-a to complete one group and hold the next lease")
        b = children(ov, "w-b")
        wait_for(lambda: alive(b, "w-b", tmp_path) and learner.consumer_stats_prompts("w-b") >= 1, start_s,
                 "w-b to complete a group")
        orphans = learner.leases_of("w-a")
        assert len(orphans) == 1 and learner.consumer_stats_prompts("w-a") == 1  # still stuck at its gate
        helpers = psutil.Process(a.pid).children(recursive=True)  # vllm: its engine core and model worker
        a.send_signal(signal.SIGKILL)  # mid-scoring, holding the lease
        assert a.wait(10) == -signal.SIGKILL
        wait_for(lambda: not [p for p in helpers if p.is_running() and p.status() != psutil.STATUS_ZOMBIE], 60,
                 "w-a's helper processes to exit with it")
        assert learner.leases_of("w-a") == orphans  # frozen: w-a can no longer complete or heartbeat
        wait_for(lambda: alive(b, "w-b", tmp_path) and learner.counters()["prompts_acked"] == 24, 90,
                 "w-b to complete every prompt, w-a's included")

        groups = {g[0].prompt_id: g for g in learner.read_groups(24)}
        assert sorted(groups) == sorted(p.prompt_id for p in prompts)  # exactly one group per prompt
        c = learner.counters()
        assert (c["groups_appended"], c["samples_appended"], c["completions_duplicate"]) == (24, 96, 0)
        assert c["prompts_reclaimed"] == len(orphans) and learner.leases_total() == 0
        # group ids end with the lease (prompt stream) id
        orphan_prompts = {pid for pid, g in groups.items() if g[0].group_id.rsplit(":", 1)[1] in orphans}
        assert len(orphan_prompts) == len(orphans)
        producers = {}
        v0 = learner.model_at(0)
        for p in prompts:
            group = groups[p.prompt_id]
            assert sorted(s.group_index for s in group) == [0, 1, 2, 3]
            assert len({s.worker_id for s in group}) == 1
            producers[p.prompt_id] = group[0].worker_id
            for s in group:
                check_sample(s, p, learner.tokenizer, group_size=4, max_new_tokens=32, versions={0})
                np.testing.assert_allclose(s.behaviour_logprobs, recompute(v0, s, 1.0, 0, 1.0), rtol=0, atol=1e-4)
        assert sorted(producers.values()).count("w-a") == 1  # w-a's one group made it; w-b made the rest
        assert all(producers[pid] == "w-b" for pid in orphan_prompts)  # the survivor finished w-a's prompts
        # w-b's own accounting, as the monitor reads it (its heartbeat runs every 0.5 s)
        mine = [s for g in groups.values() for s in g if s.worker_id == "w-b"]
        wait_for(lambda: learner.consumer("w-b")["stats"]["prompts"] == len(mine) // 4, 5, "w-b's next heartbeat")
        rec = learner.consumer("w-b")
        assert (rec["version"], rec["stats"]["samples"], rec["stats"]["tokens"]) == (
            0, len(mine), sum(s.num_response_tokens for s in mine))
        assert rec["stats"]["tokens_per_s"] > 0 and rec["stats"]["weight_updates"] == 1
        b.send_signal(signal.SIGTERM)
        assert b.wait(30) == 0, log_tail(tmp_path, "w-b")
    finally:
        learner.close()


@pytest.mark.timeout(480)
def test_sigterm_finishes_in_flight_prompts_and_leaves_no_lease(redis_url, weight_server, hf_engine, children, tmp_path):
    model_cfg, engine_ov, start_s = hf_engine
    ov = overrides(redis_url, "sigterm", weight_server, model_cfg, extra=engine_ov)
    gate_file = tmp_path / "gate"
    learner = FakeLearner(compose(ov))
    try:
        learner.publish(0)
        learner.enqueue(12)
        w = children(gated(ov, gate_file), "w-term")  # one group done, then caught with a prompt in flight
        held = wait_for(lambda: alive(w, "w-term", tmp_path) and learner.consumer_stats_prompts("w-term") == 1
                        and learner.leases_of("w-term"), start_s, "w-term to complete one group and hold the next lease")
        assert len(held) == 1
        w.send_signal(signal.SIGTERM)
        wait_for(lambda: "stop requested" in log_tail(tmp_path, "w-term", 200), 30, "w-term to take the signal")
        gate_file.unlink()  # the prompt in flight may finish now, within the grace period
        assert w.wait(30) == 0, log_tail(tmp_path, "w-term")
        assert learner.leases_of("w-term") == [] and learner.leases_total() == 0  # no lease left behind
        c = learner.counters()
        # every prompt it claimed was completed within the grace period: none released, none pending
        assert c["prompts_acked"] == c["prompts_claimed"] and c["prompts_released"] == 0
        # one before the gate, one held at the signal, none after it
        assert (c["prompts_claimed"], c["prompts_waiting"]) == (2, 10)
        groups = learner.read_groups(c["prompts_acked"])
        done = {g[0].group_id.rsplit(":", 1)[1] for g in groups}
        assert set(held) <= done  # the prompts held when SIGTERM arrived were finished, not dropped
        rec = learner.consumer("w-term")
        assert rec["leases"] == 0 and rec["stats"]["prompts"] == len(groups) and rec["stats"]["released"] == 0
    finally:
        learner.close()
