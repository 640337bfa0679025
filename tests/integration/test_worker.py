"""The rollout worker in this process against a real redis-server and a real weight server,
with the tiny model: valid samples, behaviour log-prob parity with the published weights,
per-token versions across an in-flight weight update, late joining, reward failures and
over-long prompts in the dead-letter stream, stats for the monitor, release on stop,
abandoning a lease another worker took over, and carrying on with its own expired lease
claimed back after a pause.

The test plays the learner (:class:`worker_helpers.FakeLearner`). Worker processes (SIGKILL,
SIGTERM) are in ``test_worker_processes.py``.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from rlhf_core.records import Prompt, Sample
from rlhf_core.sampling import response_logprobs
from rlhf_core.tasks import count_up_reward
from rollout_workers.weight_follower import WEIGHT_RETRY_S
from rollout_workers.worker import RolloutWorker
from worker_helpers import check_sample, compose_unvalidated, gate_overrides, recompute, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

PARITY_ATOL = 1e-4


def recompute_across_swap(v0, v1, s: Sample, a: int) -> np.ndarray:
    """Behaviour log-probs of a response whose first ``a`` tokens were sampled with v0 and the rest
    with v1, reproduced exactly: the in-flight update keeps the KV cache, so every position fed
    before the swap (prompt + the first a-1 response tokens) was computed by v0, and the positions
    fed after it by v1 on top of that cache."""
    ids = torch.tensor(np.concatenate([s.prompt_ids, s.response_ids]), dtype=torch.long)[None]
    p, r = len(s.prompt_ids), s.num_response_tokens
    tokens = ids[:, p:]
    with torch.no_grad():
        before = v0(input_ids=ids[:, : p + a - 1], use_cache=True)
        after = v1(input_ids=ids[:, p + a - 1 : p + r - 1], past_key_values=before.past_key_values,
                   position_ids=torch.arange(p + a - 1, p + r - 1)[None], use_cache=True)
    logits = torch.cat([before.logits[:, p - 1 :], after.logits], 1)  # [1, r, V]: the logits predicting each token
    return response_logprobs(logits, tokens, 1.0, 0, 1.0)[0].numpy()


def by_prompt(groups: list[list[Sample]]) -> dict[str, list[Sample]]:
    out = {g[0].prompt_id: g for g in groups}
    assert len(out) == len(groups), "two groups for one prompt"
    return out


def test_samples_are_valid_match_published_weights_and_feed_the_monitor(run):
    cfg, learner = run(rollout__temperature=0.8, rollout__top_k=20, rollout__top_p=0.9, rollout__max_new_tokens=12)
    learner.publish(0, seed=1)
    prompts = learner.enqueue(4)
    stats = RolloutWorker(cfg, "w-parity").run(max_prompts=4)
    groups = by_prompt(learner.read_groups(4))
    assert sorted(groups) == sorted(p.prompt_id for p in prompts)
    tok = learner.tokenizer
    v0 = learner.model_at(0)
    worst = off = 0.0
    for p in prompts:
        group = groups[p.prompt_id]
        assert sorted(s.group_index for s in group) == [0, 1, 2, 3] and len({s.group_id for s in group}) == 1
        for s in group:
            check_sample(s, p, tok, group_size=4, max_new_tokens=12, versions={0})
            assert s.versions == [[0, s.num_response_tokens]] and s.worker_id == "w-parity"
            text = tok.decode(s.response_ids.tolist(), skip_special_tokens=True)
            expected = count_up_reward(p.text, text, s.response_ids.tolist(), p.metadata)
            assert s.reward_components == {"count_up": expected}
            assert s.reward == pytest.approx(sum(s.reward_components.values()), abs=1e-12)
            # the learner's recomputation with the published weights and the same sampling settings
            worst = max(worst, float(np.abs(recompute(v0, s, 0.8, 20, 0.9) - s.behaviour_logprobs).max()))
            off = max(off, float(np.abs(recompute(learner.base, s, 0.8, 20, 0.9) - s.behaviour_logprobs).max()))
    assert worst < PARITY_ATOL, f"behaviour log-probs differ from the recomputation by {worst}"
    assert off > 1e-2  # the on-disk weights give other numbers: the pulled version was really used
    n_tokens = sum(s.num_response_tokens for g in groups.values() for s in g)
    assert (stats.prompts, stats.samples, stats.tokens, stats.weight_updates) == (4, 16, n_tokens, 1)
    # what the monitor reads: the worker's consumer record in the buffer
    rec = learner.consumer("w-parity")
    assert (rec["version"], rec["leases"]) == (0, 0)
    st = rec["stats"]
    assert (st["prompts"], st["samples"], st["tokens"], st["version"], st["prompts_rendered"]) == (4, 16, n_tokens, 0, 4)
    assert st["prompts_per_s"] > 0 and st["samples_per_s"] > 0 and st["tokens_per_s"] > 0
    assert st["t_generate"] > 0 and st["t_weights"] > 0 and st["dead_letters"] == 0
    c = learner.counters()
    assert (c["prompts_acked"], c["groups_appended"], c["samples_appended"], c["dead_letters"]) == (4, 4, 16, 0)


def test_weight_update_mid_generation_changes_token_versions_at_the_swap(run):
    cfg, learner = run(rollout__max_new_tokens=200, rollout__max_prompt_tokens=16)
    learner.publish(0, seed=1)
    learner.enqueue(2)  # 2 prompts x 4 = 8 requests = 8 slots: all admitted at the first step
    wt = learner.thread(cfg, "w-swap", max_prompts=2)
    engine = wt.worker.engine
    wt.start()
    wait_for(lambda: engine.num_steps >= 5 or wt.error, 30, "5 decoding steps")
    learner.publish(1, seed=2)  # while the 8 responses are being generated
    wt.join(60)
    samples = [s for g in learner.read_groups(2, learner_version=1) for s in g]
    assert len(samples) == 8
    swapped = [s for s in samples if len(s.versions) == 2]
    assert swapped, f"no response spans the update: {[s.versions for s in samples]}"
    (v_a, a), _ = swapped[0].versions
    assert v_a == 0 and a >= 5  # published after step 5, applied between two steps
    for s in samples:
        n = s.num_response_tokens
        if len(s.versions) == 2:  # every response running at the swap switches after the same token
            assert s.versions == [[0, a], [1, n - a]]
        else:  # finished (EOS) before the swap
            assert s.versions == [[0, n]] and n <= a
    # tokens before the swap were sampled from v0, after it from v1 (on v0's KV cache): the
    # recorded log-probs are exactly those of the distributions the tokens were drawn from
    v0, v1 = learner.model_at(0), learner.model_at(1)
    for s in swapped:
        np.testing.assert_allclose(s.behaviour_logprobs, recompute_across_swap(v0, v1, s, a), rtol=0, atol=PARITY_ATOL)
        assert np.abs(s.behaviour_logprobs[a:] - recompute(v0, s, 1.0, 0, 1.0)[a:]).max() > 1e-2  # not v0 after the swap
    assert (wt.stats.weight_updates, wt.worker.engine.version) == (2, 1)
    assert learner.consumer("w-swap")["version"] == 1


def test_late_joiner_starts_with_the_newest_weights(run):
    cfg, learner = run()
    for v in range(4):
        learner.publish(v, seed=10 + v)
    learner.buffer.learner.set_learner_version(3)
    prompts = learner.enqueue(2)
    stats = RolloutWorker(cfg, "w-late").run(max_prompts=2)
    groups = by_prompt(learner.read_groups(2, learner_version=3))
    v3 = learner.model_at(3)
    for p in prompts:
        for s in groups[p.prompt_id]:
            check_sample(s, p, learner.tokenizer, 4, 8, versions={3})
            assert s.versions == [[3, s.num_response_tokens]]
            np.testing.assert_allclose(s.behaviour_logprobs, recompute(v3, s, 1.0, 0, 1.0), rtol=0, atol=PARITY_ATOL)
    assert stats.weight_updates == 1  # straight to v3, not through 0..2
    assert learner.consumer("w-late")["version"] == 3


def test_reward_failure_and_nan_go_to_dead_letters_and_the_group_goes_on(run, request):
    cfg, learner = run(extra=["~reward.functions.count_up", "+reward.functions.flaky._target_=reward_fns.flaky"])
    learner.publish(0)
    tag = request.node.name
    prompts = [Prompt(f"p-{mode}", f"{i}:", metadata={"fail": mode, "tag": f"{tag}-{mode}"}, index=i)
               for i, mode in enumerate(["raise", "nan", "", "always"])]
    learner.buffer.producer.enqueue_prompts(prompts)
    stats = RolloutWorker(cfg, "w-flaky").run(max_prompts=4)
    groups = by_prompt(learner.read_groups(3))
    # raise / nan: the first scored sample is dead-lettered, the group is completed with the other 3
    assert {pid: len(g) for pid, g in groups.items()} == {"p-raise": 3, "p-nan": 3, "p-": 4}
    assert all(s.reward == 1.0 and s.reward_components == {"flaky": 1.0} for g in groups.values() for s in g)
    dead = learner.buffer.monitor.dead_letters(20)
    assert len(dead) == 2 + 4 and {d["kind"] for d in dead} == {"sample"} and {d["producer"] for d in dead} == {"w-flaky"}
    reasons: dict[str, list[str]] = {}
    for d in dead:
        s = Sample.decode(d["raw"])  # the whole sample is kept for inspection
        assert np.isnan(s.reward) and s.num_response_tokens >= 1
        reasons.setdefault(s.prompt_id, []).append(d["reason"])
        if s.prompt_id in groups:  # the dead-lettered index is the one missing from its group
            assert s.group_index not in {x.group_index for x in groups[s.prompt_id]}
    assert reasons == {
        "p-raise": [f"reward function 'flaky' raised RuntimeError: flaky failure for {tag}-raise"],
        "p-nan": ["reward 'flaky' is not finite (nan)"],
        "p-always": [f"reward function 'flaky' raised RuntimeError: always failing for {tag}-always"] * 4,
    }
    c = learner.counters()
    assert (c["prompts_acked"], c["groups_appended"], c["samples_appended"], c["samples_dead_lettered"]) == (4, 3, 10, 6)
    assert c["budget_returned"] == 4  # p-always produced nothing: its reservation went back
    assert (stats.prompts, stats.prompts_empty, stats.samples, stats.dead_letters) == (3, 1, 10, 6)


def test_too_long_prompt_is_dead_lettered_and_counted(run):
    cfg, learner = run(rollout__max_prompt_tokens=8)
    learner.publish(0)
    learner.buffer.producer.enqueue_prompts([Prompt("p-long", "0123456789abcdefghij"), Prompt("p-ok", "3:", metadata={"start": 3})])
    stats = RolloutWorker(cfg, "w-len").run(max_prompts=2)
    assert [g[0].prompt_id for g in learner.read_groups(1)] == ["p-ok"]
    (dead,) = learner.buffer.monitor.dead_letters(10)
    assert (dead["kind"], dead["producer"]) == ("prompt", "w-len")
    assert dead["reason"].startswith("prompt 'p-long' has 20 tokens, more than rollout.max_prompt_tokens=8")
    assert Prompt.decode(dead["raw"]).text == "0123456789abcdefghij"
    c = learner.counters()
    assert (c["prompts_acked"], c["prompts_dead_lettered"], c["groups_appended"], c["budget_returned"]) == (2, 1, 1, 4)
    st = learner.consumer("w-len")["stats"]
    assert (st["prompts_rejected"], st["prompts_rendered"], st["prompts_empty"], st["dead_letters"]) == (1, 1, 1, 1)
    assert (stats.prompts, stats.prompts_empty) == (1, 1)


def test_too_long_prompt_is_left_truncated_and_counted(run):
    cfg, learner = run(rollout__max_prompt_tokens=8, rollout__prompt_overflow="truncate")
    learner.publish(0)
    learner.buffer.producer.enqueue_prompts([Prompt("p-long", "0123456789abcdefghij")])
    RolloutWorker(cfg, "w-cut").run(max_prompts=1)
    (group,) = learner.read_groups(1)
    assert {tuple(s.prompt_ids.tolist()) for s in group} == {tuple(learner.tokenizer("cdefghij")["input_ids"])}
    assert learner.buffer.monitor.dead_letters(10) == []
    st = learner.consumer("w-cut")["stats"]
    assert (st["prompts_truncated"], st["prompt_tokens_cut"], st["prompts_rejected"]) == (1, 12, 0)


def test_stop_without_grace_releases_unfinished_prompts(run, tmp_path):
    gate_file = tmp_path / "gate"  # closed: no response is scored, so neither prompt can complete
    cfg, learner = run(rollout__max_new_tokens=200, rollout__max_prompt_tokens=16, rollout__shutdown_grace_s=0.0,
                       extra=gate_overrides(gate_file))
    learner.publish(0)
    learner.enqueue(2)
    wt = learner.thread(cfg, "w-stop").start()
    try:
        wait_for(lambda: wt.worker.engine.num_steps >= 3 or wt.error, 30, "3 decoding steps")
        held = learner.leases_of("w-stop")
        assert len(held) == 2  # 8 slots / group of 4: two prompts in flight
        wt.worker.request_stop()
        wait_for(lambda: wt.worker.stats.released == 2 or wt.error, 30, "the unfinished prompts to be released")
    finally:
        gate_file.unlink()  # lets the scoring thread go, so the worker can shut down
    wt.join()
    assert wt.stats.released == 2 and wt.stats.prompts == 0
    assert learner.leases_of("w-stop") == [] and learner.consumer("w-stop")["leases"] == 0
    assert learner.counters()["prompts_released"] == 2
    # released prompts are handed out first, not counted as a failed delivery
    again = learner.buffer.worker.claim("other", 5, block_s=0)
    assert sorted((lease.lease_id, lease.how, lease.delivery_count) for lease in again) == sorted((i, "released", 1) for i in held)


def test_lease_taken_over_by_another_worker_is_abandoned(run, tmp_path):
    # scoring waits at a closed gate, so the heartbeat sees the theft before either group is done
    gate_file = tmp_path / "gate"
    cfg, learner = run(extra=["~reward.functions.count_up", *gate_overrides(gate_file)])
    learner.publish(0)
    prompts = learner.enqueue(2)
    wt = learner.thread(cfg, "w-slow").start()
    try:
        held = wait_for(lambda: len(learner.leases_of("w-slow")) == 2 and learner.leases_of("w-slow"), 30, "two leases")
        stolen, kept = sorted(held)
        # what a reclaim does when a worker looks dead: the prompt now belongs to "thief"
        learner.buffer.redis.xclaim(learner.buffer.keys.prompts, "workers", "thief", 0, [stolen])
        wait_for(lambda: wt.worker.stats.leases_lost == 1 or wt.error, 30, "the heartbeat to notice the lost lease")
        assert learner.leases_of("thief") == [stolen]  # the worker dropped it instead of completing it
        assert stolen not in wt.worker.groups and kept in wt.worker.groups
    finally:
        gate_file.unlink()
    # "thief" never heartbeats: after the lease timeout the prompt comes back, to this worker
    wait_for(lambda: wt.worker.stats.prompts == 2 or wt.error, 30, "both prompts to complete")
    wt.stop()
    groups = by_prompt(learner.read_groups(2))
    assert sorted(groups) == sorted(p.prompt_id for p in prompts)
    assert {g[0].group_id.rsplit(":", 1)[1] for g in groups.values()} == {stolen, kept}
    c = learner.counters()
    assert (c["prompts_acked"], c["prompts_reclaimed"], c["completions_duplicate"], c["groups_appended"]) == (2, 1, 0, 2)
    assert (wt.stats.leases_lost, wt.stats.prompts, wt.stats.duplicates) == (1, 2, 0)


def test_own_expired_lease_claimed_back_goes_on_generating_not_dead_lettered(run):
    """A worker paused past the lease timeout (SIGSTOP, swapping) may, once it runs again, claim
    its own expired lease before anyone else does: the prompt it is still generating comes back
    to it. The chaos test met it as a dead letter ("request id ... is already queued or running")."""
    cfg, learner = run(rollout__max_new_tokens=200, rollout__max_prompt_tokens=16)
    learner.publish(0)
    (prompt,) = learner.enqueue(1)
    wt = learner.thread(cfg, "w-paused")
    engine, paused, resume = wt.worker.engine, threading.Event(), threading.Event()
    step = engine.step

    def pausing_step():  # the process stops before its first decoding step, its requests in the engine
        paused.set()
        resume.wait(60)
        return step()

    engine.step = pausing_step
    wt.start()
    try:
        wait_for(lambda: paused.is_set() or wt.error, 30, "the worker to start generating")
        wt.worker.leases.heartbeat = lambda: None  # a paused process renews nothing
        (lease_id,) = learner.leases_of("w-paused")
        assert engine.has_work() and lease_id in wt.worker.groups
        idle_ms = 1000 * cfg.buffer.lease_timeout_s
        wait_for(lambda: learner.buffer.redis.xpending_range(learner.buffer.keys.prompts, "workers", "-", "+", 1)[0]
                 ["time_since_delivered"] > idle_ms, 30, "the lease to expire")
    finally:
        engine.step = step
        resume.set()
    # running again, with free slots it claims at once: its own expired lease comes back to it.
    # A heartbeat that found the old delivery lost (another worker had reclaimed and released it)
    # may report so as the claim takes it back: that report must not abandon the new delivery.
    claim = wt.worker.leases.buffer.claim

    def claim_as_a_lost_report_lands(*args, **kwargs):
        leases = claim(*args, **kwargs)
        if any(lease.lease_id == lease_id for lease in leases):
            wt.worker.leases._lost.add(lease_id)
        return leases

    wt.worker.leases.buffer.claim = claim_as_a_lost_report_lands
    wait_for(lambda: learner.counters()["prompts_reclaimed"] >= 1 or wt.error, 30, "the worker to claim its own lease")
    del wt.worker.leases.heartbeat  # heartbeating again (else every lease timeout is one more delivery, up to the dead letter)
    done = wait_for(lambda: wt.worker.stats.prompts + wt.worker.stats.prompts_empty + wt.worker.stats.duplicates == 1
                    or wt.error, 60, "the prompt to end")
    assert done is True, wt.error
    wt.stop()
    (group,) = learner.read_groups(1)
    assert group[0].prompt_id == prompt.prompt_id and len(group) == 4
    c = learner.counters()
    # reclaimed once (twice if the heartbeat came back more than a lease timeout after the claim)
    assert (c["prompts_acked"], c["completions_duplicate"], c["dead_letters"]) == (1, 0, 0) and c["prompts_reclaimed"] >= 1
    assert (wt.stats.prompts, wt.stats.dead_letters, wt.stats.leases_lost) == (1, 0, 0)


def test_weight_server_down_generation_goes_on_with_the_current_weights(run, weight_server):
    cfg, learner = run(weight_server__request_timeout_s=0.5)
    learner.publish(0)
    wt = learner.thread(cfg, "w-alone").start()
    wait_for(lambda: wt.worker.weights.has_weights or wt.error, 30, "the first weights")
    weight_server.stop()
    learner.buffer.learner.set_learner_version(1)  # prompts admitted now ask for weights >= v1, which cannot be pulled
    t0 = time.monotonic()
    learner.enqueue(3)
    wait_for(lambda: wt.worker.stats.prompts == 3 or wt.error, 30, "3 prompts generated with v0")
    wt.stop()
    down_s = time.monotonic() - t0
    for group in learner.read_groups(3, learner_version=1):
        assert all(s.versions == [[0, s.num_response_tokens]] for s in group)
    # one failed pull (0.5 s), then a pause of WEIGHT_RETRY_S instead of a 0.5 s stall at every
    # claim or decoding step (a loaded machine may take long enough for one or two retries)
    timeouts = wt.worker.weights.subscriber.stats["timeouts"]
    assert 1 <= timeouts <= 1 + int(down_s / WEIGHT_RETRY_S), (timeouts, down_s)
    assert (wt.stats.weight_updates, wt.worker.engine.version) == (1, 0)


def test_a_heartbeat_whose_stats_fail_still_renews_the_leases(run, caplog):
    # Once: the heartbeat thread builds the stats while the main thread changes what they count, and
    # an exception there (outside the heartbeat's try) ended the thread for good: the worker went on
    # working while its leases expired under it. Now the last stats that built go out.
    cfg, learner = run()
    worker = RolloutWorker(cfg, "w-beat")
    try:
        worker.leases.heartbeat()
        before = learner.buffer.monitor.metrics()["consumers"]["w-beat"]
        worker.score_share = lambda: 1 / 0  # what a stats read racing the main thread would raise
        with caplog.at_level("WARNING", logger="rollout_workers.leases"):
            worker.leases.heartbeat()
        after = learner.buffer.monitor.metrics()["consumers"]["w-beat"]
        assert after["last_seen"] > before["last_seen"] and after["stats"] == before["stats"]
        assert "its stats failed (ZeroDivisionError: division by zero); heartbeating with the last ones" in caplog.text
    finally:
        for part in (worker.scoring, worker.engine, worker.weights, worker.leases.buffer):
            part.close()


def test_reference_logprobs_computed_on_the_worker(run):
    cfg, learner = run(rollout__ref_logprobs_on="worker", rollout__temperature=0.9)
    learner.publish(0, seed=1)  # the policy moved away from the reference (the on-disk weights)
    prompts = learner.enqueue(2)
    RolloutWorker(cfg, "w-ref").run(max_prompts=2)
    groups = by_prompt(learner.read_groups(2))
    for p in prompts:
        for s in groups[p.prompt_id]:
            assert s.ref_logprobs is not None and s.ref_logprobs.shape == (s.num_response_tokens,)
            # what the learner would compute with its reference model and the rollout's sampling settings
            np.testing.assert_allclose(s.ref_logprobs, recompute(learner.base, s, 0.9, 0, 1.0), rtol=0, atol=PARITY_ATOL)
            assert np.abs(s.ref_logprobs - s.behaviour_logprobs).max() > 1e-2


@pytest.mark.parametrize("setting, message", [
    ("buffer.url=null", "rlhf-worker needs buffer.url=redis://host:port"),
    ("weight_server.address=null", "rlhf-worker needs weight_server.address=tcp://host:port"),
    ("buffer.run_id=auto", "rlhf-worker needs buffer.run_id=<the run id that rlhf-run printed>"),
])
def test_run_worker_refuses_an_incomplete_config_before_building_anything(tiny_model_cfg, setting, message):
    from rlhf_core.config import ConfigError
    from rollout_workers.worker import run_worker

    base = ["buffer.url=redis://127.0.0.1:1/0", "buffer.run_id=r", "weight_server.address=tcp://127.0.0.1:1",
            "weight_server.pub_address=tcp://127.0.0.1:2"]
    cfg = compose_unvalidated(base + [setting])
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        run_worker(cfg, "w-config", install_signals=False)


def test_threads_follow_omp_num_threads_else_one(monkeypatch):
    from rollout_workers.worker import _set_threads

    before = torch.get_num_threads()
    try:
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        assert _set_threads() == 2 and torch.get_num_threads() == 2
        monkeypatch.delenv("OMP_NUM_THREADS")
        assert _set_threads() == 1 and torch.get_num_threads() == 1
        monkeypatch.setenv("OMP_NUM_THREADS", "lots")
        assert _set_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_a_reward_that_always_fails_stops_the_worker_with_its_error(run):
    # once: every group dead-lettered for ever (313,000 log lines in 2 minutes) and nothing trained
    from rollout_workers.rewards import RewardFailing

    cfg, learner = run(extra=["~reward.functions.count_up", "+reward.functions.boom._target_=reward_fns.boom",
                              "reward.failure_window=8"])
    learner.publish(0)
    learner.enqueue(6)
    with pytest.raises(RewardFailing) as err:
        RolloutWorker(cfg, "w-boom").run(max_prompts=6)
    message = str(err.value)
    assert "of the last 8 samples could not be scored" in message
    assert "reward function 'boom' raised ValueError: boom" in message
    c = learner.counters()
    assert c["samples_dead_lettered"] >= 8 and c["samples_appended"] == 0  # what it scored is accounted for


def test_when_most_prompts_are_too_long_the_worker_stops_with_the_reason(run):
    # once: every prompt was dead-lettered one by one and the run idled with nothing to train on
    from rollout_workers.groups import PromptsRejected

    cfg, learner = run(rollout__max_prompt_tokens=8)
    learner.publish(0)
    learner.buffer.producer.enqueue_prompts([Prompt(f"p-long-{i}", "0123456789abcdefghij") for i in range(20)])
    with pytest.raises(PromptsRejected) as err:
        RolloutWorker(cfg, "w-long").run(max_prompts=20)
    assert "16 of the last 16 prompts were rejected" in str(err.value)
    assert "more than rollout.max_prompt_tokens=8" in str(err.value)
    assert learner.counters()["prompts_dead_lettered"] == 16


# What Llama-2/Mistral/Gemma chat templates do with a system turn or roles that do not alternate.
ALTERNATING_TEMPLATE = (
    "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")


def test_prompt_the_chat_template_refuses_is_dead_lettered_and_the_others_claimed_with_it_go_on(run):
    # once: jinja2.TemplateError killed the worker, leaving the whole claim pending; restarted
    # workers took the bad prompt first again until the good ones were dead-lettered with it
    cfg, learner = run(rollout__slots=16)  # 4 prompts of 4: one claim takes them all
    learner.publish(0)
    bad = Prompt("p-bad", "", messages=[{"role": "user", "content": "1:"}, {"role": "user", "content": "2:"}])
    good = [Prompt(f"p-{i}", f"{i}:", metadata={"start": i}) for i in range(3)]
    learner.buffer.producer.enqueue_prompts([bad, *good])  # the bad one first: the others come after it in the claim
    wt = learner.thread(cfg, "w-tmpl")
    wt.worker.tokenizer.chat_template = ALTERNATING_TEMPLATE  # the renderer's tokenizer: what a chat model carries
    wt.start()
    wait_for(lambda: wt.worker.stats.prompts == 3 or wt.error, 60, "the 3 good prompts to complete")
    assert wt.error is None and wt.thread.is_alive()
    (dead,) = learner.buffer.monitor.dead_letters(10)
    assert (dead["kind"], dead["producer"], Prompt.decode(dead["raw"]).prompt_id) == ("prompt", "w-tmpl", "p-bad")
    assert dead["reason"] == ("prompt 'p-bad' could not be rendered: TemplateError: "
                              "Conversation roles must alternate user/assistant/user/assistant/...")
    groups = by_prompt(learner.read_groups(3))
    assert sorted(groups) == ["p-0", "p-1", "p-2"]
    for p in good:
        ids = learner.tokenizer(f"user: {p.text}\nassistant: ", add_special_tokens=False)["input_ids"]
        assert len(groups[p.prompt_id]) == 4 and all(s.prompt_ids.tolist() == ids for s in groups[p.prompt_id])
    # it goes on working: a prompt enqueued now is generated too
    learner.buffer.producer.enqueue_prompts([Prompt("p-later", "5:", metadata={"start": 5})])
    wait_for(lambda: wt.worker.stats.prompts == 4 or wt.error, 60, "the later prompt to complete")
    wt.stop()
    assert (wt.stats.prompts, wt.stats.prompts_empty, wt.stats.dead_letters, wt.stats.released) == (4, 1, 1, 0)
    assert learner.leases_total() == 0
    c = learner.counters()
    assert (c["prompts_acked"], c["prompts_dead_lettered"], c["groups_appended"]) == (5, 1, 4)


def test_a_failure_between_claim_and_start_releases_the_prompts_not_started(run):
    # one claim of 20 prompts; the 16th rejection stops the worker (PromptsRejected) before it
    # reaches the last 4: they were left pending until the lease timeout, and then reclaimed
    from rollout_workers.groups import PromptsRejected

    cfg, learner = run(rollout__slots=80, rollout__max_prompt_tokens=8)
    learner.publish(0)
    learner.buffer.producer.enqueue_prompts([Prompt(f"p-long-{i}", "0123456789abcdefghij") for i in range(20)])
    worker = RolloutWorker(cfg, "w-fail")
    with pytest.raises(PromptsRejected, match="16 of the last 16 prompts were rejected"):
        worker.run()
    assert learner.leases_of("w-fail") == []  # given back (pending under the buffer's "released" consumer)
    c = learner.counters()
    assert (c["prompts_dead_lettered"], c["prompts_released"]) == (16, 4)
    assert worker.stats.released == 4
    # released, not expired: handed out at once to the next claimer, not counted as a failed delivery
    again = learner.buffer.worker.claim("other", 20, block_s=0)
    assert len(again) == 4 and {(lease.how, lease.delivery_count) for lease in again} == {("released", 1)}
