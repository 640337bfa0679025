"""The rollout worker running multi-turn episodes, against a real redis-server and weight server
with the tiny model (the test plays the learner, :class:`worker_helpers.FakeLearner`): an
environment that raises fails its episode alone (dead-lettered with the reason, the rest of the
group appended, the worker goes on), and a weight update between two turns of running episodes
gives each policy token the version that sampled it while the environment's tokens follow the
rules of :mod:`rlhf_core.episode` (loss mask 0, log-prob 0, not counted by staleness).

The environments are named by dotted path (``test_worker_episodes.<class>``), as a user names theirs.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from rlhf_core.records import Prompt, Sample, rle_encode
from rollout_workers.environment import StepResult
from rollout_workers.worker import RolloutWorker
from worker_helpers import recompute, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

PARITY_ATOL = 1e-4


class Turns:
    """Answers ``"|x"`` after each turn; done with reward 1.0 after ``turns`` turns."""

    def __init__(self, turns: int = 3) -> None:
        self.turns = turns

    def reset(self, prompt: Prompt) -> None:
        self.prompt = prompt
        return None

    def step(self, turn) -> StepResult:
        if turn.index + 1 >= self.turns:
            return StepResult(None, 1.0, True)
        return StepResult("|x", None, False)


_failed: set[str] = set()
_lock = threading.Lock()


class Flaky(Turns):
    """The first episode of a prompt whose metadata says ``fail`` raises: in ``reset`` (``reset``)
    or in the second ``step`` (``step``), once per ``metadata["tag"]`` in this process."""

    def _first(self, prompt: Prompt, where: str) -> bool:
        if prompt.metadata.get("fail") != where:
            return False
        with _lock:
            first = prompt.metadata["tag"] not in _failed
            _failed.add(prompt.metadata["tag"])
        return first

    def reset(self, prompt: Prompt) -> None:
        if self._first(prompt, "reset"):
            raise ConnectionError(f"sandbox for {prompt.prompt_id} did not start\nsecond line")
        return super().reset(prompt)

    def step(self, turn) -> StepResult:
        if turn.index == 1 and self._first(self.prompt, "step"):
            raise RuntimeError(f"the tool's backend is down for {self.prompt.prompt_id}\nsecond line")
        return super().step(turn)


class Gated(Turns):
    """``Turns``, whose first ``step`` waits while the file ``gate`` exists (at most 30 s)."""

    def __init__(self, gate: str, turns: int = 3) -> None:
        super().__init__(turns)
        self.gate = Path(gate)

    def step(self, turn) -> StepResult:
        deadline = time.monotonic() + 30
        while turn.index == 0 and self.gate.exists():
            if time.monotonic() > deadline:
                raise TimeoutError("the test never opened the gate")
            time.sleep(0.005)
        return super().step(turn)


class Floods(Turns):
    """Never done: answers every turn with ``"zzzzzz"``."""

    def step(self, turn) -> StepResult:
        return StepResult("zzzzzz", None, False)


def env_overrides(env: str, **kwargs) -> list[str]:
    return [f"rollout.env._target_=test_worker_episodes.{env}", *(f"+rollout.env.{k}='{v}'" for k, v in kwargs.items())]


def test_an_environment_that_raises_fails_its_episode_alone_and_the_worker_goes_on(run, request):
    cfg, learner = run(rollout__max_new_tokens=2, rollout__max_turns=3, extra=env_overrides("Flaky"))
    learner.publish(0)
    tag = request.node.name
    prompts = [Prompt(f"p-{mode or 'ok'}{i}", f"{i}:", metadata={"fail": mode, "tag": f"{tag}-{i}"}, index=i)
               for i, mode in enumerate(["step", "reset", "", ""])]
    learner.buffer.producer.enqueue_prompts(prompts)  # 2 groups of 4 fill the 8 slots: the last two start after the failures
    stats = RolloutWorker(cfg, "w-env").run(max_prompts=4)
    groups = {g[0].prompt_id: g for g in learner.read_groups(4)}
    assert {pid: len(g) for pid, g in groups.items()} == {"p-step0": 3, "p-reset1": 3, "p-ok2": 4, "p-ok3": 4}
    for g in groups.values():
        for s in g:
            assert (s.finish_reason, s.reward, s.reward_components, s.metadata["turns"]) == ("stop", 1.0, {"env": 1.0}, 3)
            assert s.num_policy_tokens >= 3 and s.loss_mask is not None
    dead = learner.buffer.monitor.dead_letters(20)
    assert len(dead) == 2 and {(d["kind"], d["producer"]) for d in dead} == {("sample", "w-env")}
    by_prompt = {}
    for d in dead:
        s = Sample.decode(d["raw"])  # the episode is kept for inspection, reward NaN
        assert np.isnan(s.reward) and s.group_index not in {x.group_index for x in groups[s.prompt_id]}
        by_prompt[s.prompt_id] = (d["reason"], s)
    reason, s = by_prompt["p-step0"]  # failed after two policy turns: its tokens are in the dead letter
    assert reason.startswith("environment test_worker_episodes.Flaky.step() failed: "
                             "RuntimeError: the tool's backend is down for p-step0 | second line (at ")
    assert "test_worker_episodes.py" in reason and s.num_policy_tokens >= 2
    reason, s = by_prompt["p-reset1"]  # failed before its first turn: an empty record
    assert reason.startswith("environment test_worker_episodes.Flaky.reset() failed: "
                             "ConnectionError: sandbox for p-reset1 did not start | second line (at ")
    assert s.num_response_tokens == 0
    c = learner.counters()
    assert (c["prompts_acked"], c["groups_appended"], c["samples_appended"], c["samples_dead_lettered"]) == (4, 4, 14, 2)
    assert (stats.prompts, stats.samples, stats.dead_letters) == (4, 14, 2)
    st = learner.consumer("w-env")["stats"]
    assert (st["episodes_failed"], st["episodes_stop"], st["dead_letters"]) == (2, 14, 2)


def test_a_weight_update_between_turns_versions_each_policy_token(run, tmp_path):
    gate = tmp_path / "gate"
    gate.touch()  # every episode's first step waits here until v1 is applied
    cfg, learner = run(rollout__max_new_tokens=3, rollout__max_turns=3, rollout__max_prompt_tokens=8,
                       extra=env_overrides("Gated", gate=gate))
    learner.publish(0, seed=1)
    learner.enqueue(2)  # 2 prompts x 4 = 8 episodes
    wt = learner.thread(cfg, "w-turns", max_prompts=2).start()
    worker = wt.worker
    try:
        wait_for(lambda: worker.episodes.stats.turns >= 8 or wt.error, 30, "the first turn of all 8 episodes")
        assert worker.episodes.stats.turns == 8  # all of them at the gate, none past it
        learner.publish(1, seed=2)
        wait_for(lambda: worker.engine.version == 1 or wt.error, 30, "v1 to be applied while the episodes wait")
    finally:
        gate.unlink()
    wt.join(60)
    samples = [s for g in learner.read_groups(2, learner_version=1) for s in g]
    assert len(samples) == 8
    v0, v1 = learner.model_at(0), learner.model_at(1)
    off = off_v1 = 0.0
    for s in samples:
        assert s.finish_reason == "stop" and s.metadata["turns"] == 3
        policy, versions = s.policy_mask(), s.token_versions()
        # the policy turns are the runs of mask 1: the first sampled with v0, the next two with v1
        starts = np.flatnonzero(policy & ~np.concatenate([[False], policy[:-1]]))
        assert policy[0] and len(starts) == 3, s.loss_mask
        turn_of = np.cumsum(np.isin(np.arange(len(policy)), starts)) - 1  # the turn each token follows
        assert (versions[policy] == np.where(turn_of[policy] == 0, 0, 1)).all(), s.versions
        assert (np.diff(versions) >= 0).all() and s.newest_version == 1
        # a token the policy did not sample: version of the policy token before it, log-prob 0
        last_policy = np.maximum.accumulate(np.where(policy, np.arange(len(policy)), 0))
        assert (versions[~policy] == versions[last_policy][~policy]).all()
        assert (s.behaviour_logprobs[~policy] == 0).all()
        lp = s.behaviour_logprobs[policy]
        assert np.isfinite(lp).all() and (lp <= 0).all()
        # staleness counts policy tokens only: the oldest is turn 1's v0; policy tokens re-labelled
        # newer while the environment's keep theirs move it, the environment's tokens do not
        assert s.oldest_version == 0
        bumped = dataclasses.replace(s, versions=rle_encode(versions + policy))
        assert bumped.oldest_version == 1 and bumped.token_versions()[~policy].min() == 0
        # each policy token's log-prob is that of the weights its version names, on the K/V the
        # engine kept: turn 1's (all but its last token, never fed) was written by v0, and the
        # turns after the update reuse it (the episode's oldest token is v0: its staleness counts
        # from there already); v1 prefilled and decoded the rest
        v0_kv = len(s.prompt_ids) + int(policy[: starts[1]].sum()) - 1
        before, after = policy & (versions == 0), policy & (versions == 1)
        np.testing.assert_allclose(s.behaviour_logprobs[before], recompute(v0, s, 1.0, 0, 1.0)[before],
                                   rtol=0, atol=PARITY_ATOL)
        np.testing.assert_allclose(s.behaviour_logprobs[after], recompute(v1, s, 1.0, 0, 1.0, (v0, v0_kv))[after],
                                   rtol=0, atol=PARITY_ATOL)
        off = max(off, float(np.abs(s.behaviour_logprobs[after] - recompute(v0, s, 1.0, 0, 1.0)[after]).max()))
        off_v1 = max(off_v1, float(np.abs(s.behaviour_logprobs[after] - recompute(v1, s, 1.0, 0, 1.0)[after]).max()))
    assert off > 1e-2  # the tokens after the update were really sampled from other weights than v0's
    assert off_v1 > 10 * PARITY_ATOL  # ... and on v0's K/V: the check above tells the two apart
    assert (wt.stats.weight_updates, worker.engine.version) == (2, 1)


def test_a_short_prompt_does_not_stretch_the_response_past_the_episode_budget(run):
    # once: the runner stopped at the context (max_prompt_tokens + budget) only, so the room a
    # short prompt left went to the response and the buffer refused the sample as too long
    cfg, learner = run(rollout__max_new_tokens=2, rollout__max_turns=10, rollout__max_prompt_tokens=16,
                       rollout__max_episode_tokens=12,
                       extra=[*env_overrides("Floods"), "+reward.functions.c._target_=reward_fns.constant"])
    learner.publish(0)
    learner.enqueue(1)  # "0:": 2 tokens, 14 short of max_prompt_tokens
    RolloutWorker(cfg, "w-budget").run(max_prompts=1)
    (group,) = learner.read_groups(1)
    assert learner.buffer.monitor.dead_letters(10) == [] and len(group) == 4
    for s in group:  # turns of 1-2 tokens, answers of 6: cut at the budget (an answer leaves one token free)
        assert s.finish_reason == "length" and 11 <= s.num_response_tokens <= 12, (s.finish_reason, s.versions)
