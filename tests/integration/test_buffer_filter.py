"""DAPO's group filter against a real redis-server: a filtered group is acked with its admission
budget returned and counted per reason, pacing admits other prompts in its place, learner
batches stay full of unfiltered groups within the staleness bound, and nothing deadlocks, also
when every group is filtered."""

from __future__ import annotations

import pytest

from buffer_clients import Clients
from factories import sample
from rlhf_core.config import BufferConfig
from rlhf_core.dapo import FilterStall, filter_reason
from rlhf_core.records import Prompt

pytestmark = pytest.mark.integration

BATCH, GROUP, STALENESS = 4, 2, 1


def generate(buf: Clients, version: int, rewards_of) -> dict[str, int]:
    """One worker pass: claim what pacing admits, complete each group (filtered when its rewards
    are all equal). Returns how many groups went each way."""
    out = {"appended": 0, "filtered": 0}
    for lease in buf.worker.claim("w", 100):
        rewards = rewards_of(lease.prompt.index)
        group = [sample(lease.prompt.prompt_id, f"g{lease.prompt.index}", i, GROUP, version=version, reward=r)
                 for i, r in enumerate(rewards)]
        why = filter_reason(rewards, [False] * GROUP)
        status = buf.worker.complete_many([buf.worker.prepare(lease, group, filtered=why)])[0]
        out[status] += 1
    return out


def test_filtered_groups_give_their_budget_back_and_batches_stay_full(redis_url):
    buf = Clients.connect(redis_url, "filter", BufferConfig(lookahead=None))
    buf.learner.init_run(batch_size=BATCH, group_size=GROUP, max_staleness=STALENESS)
    buf.producer.enqueue_prompts(Prompt(f"p{i}", "x", index=i) for i in range(200))
    # two prompts in three teach nothing (all rewards equal)
    rewards_of = lambda i: [0.0, 1.0] if i % 3 == 0 else [0.5, 0.5]  # noqa: E731
    version, totals, passes = 0, {"appended": 0, "filtered": 0}, 0
    while version < 6:
        passes += 1
        assert passes < 50, f"no progress: version {version}, {totals}"  # a deadlock would spin here
        for k, n in generate(buf, version, rewards_of).items():
            totals[k] += n
        batch = buf.learner.read_batch("learner", version, BATCH, timeout_s=0.1)
        if batch is None:
            continue
        assert len(batch.samples) == BATCH  # full: the filtered groups took no slot
        assert {int(s.group_id[1:]) % 3 for s in batch.samples} == {0}  # only groups with a signal
        assert batch.staleness["max"] <= STALENESS
        buf.learner.commit(batch)
        version += 1
        buf.learner.set_learner_version(version)
    c = buf.monitor.metrics()["counters"]
    # 6 batches of 2 groups trained: the 12 prompts 0, 3, ..., 33, so at least the 22 between them were filtered
    assert c["groups_filtered"] == c["groups_filtered_zero_variance"] == totals["filtered"] >= 22
    assert c["samples_filtered"] == GROUP * totals["filtered"] and c["groups_filtered_all_truncated"] == 0
    assert c["groups_appended"] == totals["appended"] and c["completions_empty"] == 0
    assert c["prompts_acked"] == totals["appended"] + totals["filtered"]
    assert c["budget_returned"] == GROUP * totals["filtered"]
    buf.close()


def test_when_every_group_is_filtered_generation_goes_on_and_the_stall_is_reported(redis_url):
    buf = Clients.connect(redis_url, "all-filtered", BufferConfig(lookahead=None))
    buf.learner.init_run(batch_size=BATCH, group_size=GROUP, max_staleness=STALENESS)
    buf.producer.enqueue_prompts(Prompt(f"p{i}", "x", index=i) for i in range(100))
    watch = FilterStall(stretch_s=60)
    watch.observe(0.0, buf.monitor.metrics()["counters"])
    # at version 0 pacing admits (STALENESS + 1) * BATCH = 8 samples at a time, but each filtered
    # group returns its budget: the worker keeps claiming, 100 prompts in all, and the learner gets none
    done = sum(generate(buf, 0, lambda i: [1.0, 1.0])["filtered"] for _ in range(60))
    assert done == 100 and buf.learner.read_batch("learner", 0, BATCH, timeout_s=0.1) is None
    msg = watch.observe(61.0, buf.monitor.metrics()["counters"])
    assert msg is not None and "100 groups: zero_variance 100" in msg
    buf.close()
