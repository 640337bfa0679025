"""rollout_workers.episodes: many episodes on one engine, token in / token out.

With the tiny model on the real `hf` engine: the policy's tokens are kept exactly as sampled
across turns (ids, behaviour log-probs that a plain forward pass over the whole episode
reproduces, versions). With a scripted engine (fixed replies, no model): the chat template's
tokens between turns, the retokenisation drift counter, and the bad-input table: an environment
that raises, never says done, floods the context or gets an unreadable tool call.
"""

from __future__ import annotations

import asyncio
import copy
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from rlhf_core.config import ConfigError, RolloutConfig
from rlhf_core.models import load_policy, load_tokenizer
from rlhf_core.records import Prompt
from rlhf_core.sampling import response_logprobs
from rollout_workers.engine import GenRequest, SamplingParams, make_result
from rollout_workers.environment import EnvFactory, StepResult
from rollout_workers.episodes import EpisodeRunner
from rollout_workers.hf_engine import HFEngine
from rollout_workers.prompts import PromptRenderer

#: a chat template in the tiny alphabet (no newline): U:<user>|A:<assistant><eos>|T:<tool>| ... A:
TEMPLATE = ("{% if tools %}{{ 'S:<tool_call>|' }}{% endif %}{% for m in messages %}"
            "{% if m.role == 'assistant' %}{{ 'A:' + m.content + eos_token + '|' }}"
            "{% else %}{{ m.role[0]|upper + ':' + m.content + '|' }}{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}{{ 'A:' }}{% endif %}")


@pytest.fixture(scope="module")
def tokenizer(tiny_model_cfg):
    return load_tokenizer(tiny_model_cfg)


@pytest.fixture(scope="module")
def chat_tokenizer(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = TEMPLATE
    return tok


class ScriptedEngine:
    """Answers every request at the next step with ``reply(request, turn) -> text`` (cut at
    ``max_new_tokens``); log-prob -0.5 and version 7 per token."""

    version = 7

    def __init__(self, tokenizer: Any, reply: Callable[[GenRequest, int], str]) -> None:
        self.tokenizer, self.reply = tokenizer, reply
        self.pending: list[GenRequest] = []
        self.aborted: list[str] = []

    def add(self, request: GenRequest) -> None:
        self.pending.append(request)

    def step(self):
        out = []
        for req in self.pending:
            turn = int(req.request_id.rpartition("#")[2])
            ids = self.tokenizer(self.reply(req, turn), add_special_tokens=False)["input_ids"]
            cut = ids[: req.params.max_new_tokens]
            out.append(make_result(req.request_id, req.prompt_ids, cut, [-0.5] * len(cut), [self.version] * len(cut),
                                   "stop" if len(cut) == len(ids) else "length",
                                   self.tokenizer.decode(cut, skip_special_tokens=True)))
        self.pending = []
        return out

    def has_work(self) -> bool:
        return bool(self.pending)

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def runner(engine, tokenizer, env: dict, *, max_turns=4, max_context=64, max_new_tokens=8, timeout_s=10.0, threads=4):
    factory = EnvFactory(RolloutConfig(env=env))
    return EpisodeRunner(engine, tokenizer, PromptRenderer(tokenizer, 32), SamplingParams(max_new_tokens=max_new_tokens),
                         factory, max_turns=max_turns, max_context=max_context, threads=threads, timeout_s=timeout_s)


def run_all(run: EpisodeRunner, prompts: dict[str, Prompt], timeout_s: float = 30.0):
    """Start every episode and drive the loop the worker drives until all have finished."""
    for key, prompt in prompts.items():
        run.start(key, prompt)
    done, deadline = {}, time.monotonic() + timeout_s
    while len(done) < len(prompts):
        assert time.monotonic() < deadline, f"episodes still running: {sorted(set(prompts) - set(done))}"
        if run.engine.has_work():
            for result in run.engine.step():
                run.on_result(result)
        done.update((ep.key, ep) for ep in run.poll(0 if run.engine.has_work() else 0.01))
    return done


def test_policy_tokens_are_kept_exactly_as_sampled_across_turns(tiny_model_cfg, tokenizer):
    torch.manual_seed(0)
    model = load_policy(tiny_model_cfg).eval()
    engine = HFEngine(model, tokenizer, slots=8, max_model_len=64)
    results = {}  # request id -> what the engine returned

    class Recording:  # the real engine, its results kept for the comparison
        def __getattr__(self, name):
            return getattr(engine, name)

        def step(self):
            out = engine.step()
            results.update((r.request_id, r) for r in out)
            return out

    run = runner(Recording(), tokenizer, {"_target_": "rollout_workers.envs.count_up.CountUpHints", "target_len": 4},
                 max_turns=4, max_new_tokens=3)
    done = run_all(run, {f"e{i}": Prompt(f"p{i}", f"{i}:", metadata={"start": i}) for i in range(4)})
    for key, ep in done.items():
        assert ep.error is None and ep.finish_reason == "stop" and len(ep.turns) == 4
        t = ep.transcript
        turns = [results[f"{key}#{k}"] for k in range(4)]
        assert t.policy_segments() == [r.token_ids.tolist() for r in turns]  # the ids as sampled, never re-encoded
        policy = np.asarray(t.mask, dtype=bool)
        assert np.array_equal(np.asarray(t.logprobs)[policy], np.concatenate([r.logprobs for r in turns]))
        # every turn after the first was generated from the whole context before it: prompt + turns + observations
        for k, r in enumerate(turns):
            start = t.turns[k][0]
            assert r.prompt_ids.tolist() == t.prompt_ids + t.response_ids[:start]
        # the learner's view: one forward pass over the episode reproduces the behaviour log-probs
        full = torch.tensor([t.prompt_ids + t.response_ids])
        with torch.no_grad():
            logits = model(input_ids=full).logits[:, len(t.prompt_ids) - 1: -1]
        lp = response_logprobs(logits, full[:, len(t.prompt_ids):], 1.0, 0, 1.0)[0].numpy()
        np.testing.assert_allclose(lp[policy], np.asarray(t.logprobs)[policy], atol=1e-4)
        s = t.to_sample(sample_id=key, prompt_id=key, group_id="g")
        assert s.num_policy_tokens == int(policy.sum()) and s.loss_mask.tolist() == t.mask


class Echo:
    """Answers every turn with its tool-call errors, or ``"ok"``; done after ``turns`` turns."""

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]

    def __init__(self, turns: int = 2) -> None:
        self.turns, self.seen, self.bad = turns, [], False

    def reset(self, prompt):
        self.bad = prompt.text == "bad"  # the misbehaving subclasses misbehave on this prompt only
        return None

    def step(self, turn):
        self.seen.append(turn)
        if len(self.seen) >= self.turns:
            return StepResult(None, 1.0, True)
        return StepResult("; ".join(turn.tool_call_errors) or "ok", None, False)


def test_the_chat_templates_tokens_go_between_turns_and_drift_is_counted(chat_tokenizer):
    engine = ScriptedEngine(chat_tokenizer, lambda req, turn: f"x{turn}" + chat_tokenizer.eos_token)
    run = runner(engine, chat_tokenizer, {"_target_": "test_episodes.Echo", "turns": 3})
    ep = run_all(run, {"e": Prompt("p", "hi")})["e"]
    t = ep.transcript
    # the prompt, the policy's "x0<eos>", then "|U:ok|A:" written by the template (mask 0), and so on
    assert chat_tokenizer.decode(t.prompt_ids) == "S:<tool_call>|U:hi|A:"
    assert chat_tokenizer.decode(t.response_ids) == "x0<eos>|U:ok|A:x1<eos>|U:ok|A:x2<eos>"
    assert [chat_tokenizer.decode(s) for s in t.policy_segments()] == ["x0<eos>", "x1<eos>", "x2<eos>"]
    assert sum(t.mask) == 9 and run.stats.drift == 0 and ep.env_reward == 1.0
    # a template that renders history otherwise (here: it trims the assistant's text) no longer
    # matches the ids trained on: counted, and the episode still trains on the sampled ids
    chat_tokenizer.chat_template = TEMPLATE.replace("m.content + eos_token", "m.content|trim + eos_token")
    try:
        engine = ScriptedEngine(chat_tokenizer, lambda req, turn: f" y{turn}" + chat_tokenizer.eos_token)
        run = runner(engine, chat_tokenizer, {"_target_": "test_episodes.Echo", "turns": 3})
        ep = run_all(run, {"e": Prompt("p", "hi")})["e"]
    finally:
        chat_tokenizer.chat_template = TEMPLATE
    assert run.stats.drift == 2 and ep.drift_turns == 2
    assert [chat_tokenizer.decode(s) for s in ep.transcript.policy_segments()] == [" y0<eos>", " y1<eos>", " y2<eos>"]


class Raises(Echo):
    def step(self, turn):
        if self.bad:
            raise RuntimeError("the tool's backend is down\nsecond line")
        return super().step(turn)


class NeverDone(Echo):
    def step(self, turn):
        return ("more", None, False) if self.bad else super().step(turn)  # a tuple works too


class Floods(Echo):
    def step(self, turn):
        return StepResult("z" * 100, None, False) if self.bad else super().step(turn)


class BadShape(Echo):
    def step(self, turn):
        return 42 if self.bad else super().step(turn)


class Slow(Echo):
    def step(self, turn):
        if self.bad:
            time.sleep(1.0)
        return super().step(turn)


def test_the_bad_input_table(chat_tokenizer, tokenizer):
    """Each row: the episode whose environment misbehaves ends as the table says, and the episode
    beside it on the same engine finishes as usual."""
    def one(env, tok=tokenizer, reply="ab", **kw):
        engine = ScriptedEngine(tok, lambda req, turn: reply)
        run = runner(engine, tok, {"_target_": f"test_episodes.{env}"}, max_turns=3, **kw)
        done = run_all(run, {"bad": Prompt("p", "bad"), "good": Prompt("q", "good")})
        assert (done["good"].finish_reason, done["good"].error, done["good"].env_reward) == ("stop", None, 1.0)
        return done["bad"], run

    ep, run = one("Raises")  # dead-lettered with the exception's first lines
    assert ep.finish_reason is None and "Raises.step() failed: RuntimeError: the tool's backend is down" in ep.error
    assert "second line" in ep.error and "test_episodes.py" in ep.error and run.stats.failed == 1
    ep, run = one("NeverDone")  # ended at max_turns
    assert ep.finish_reason == "max_turns" and len(ep.turns) == 3 and ep.error is None
    ep, run = one("Floods", max_context=40)  # the observation is cut to the context: length
    assert ep.finish_reason == "length" and len(ep.transcript) == 40 - 1 and run.stats.observations_cut == 1
    ep, _ = one("BadShape")
    assert "answered badly" in ep.error and "return a StepResult" in ep.error
    ep, run = one("Slow", timeout_s=0.3)  # past rollout.env_timeout_s: that episode fails
    assert "rollout.env_timeout_s=0.3" in ep.error and run.calls.timeouts == 1
    ep, run = one("CancelledMidCall")  # an async call ended in CancelledError: once, the worker's loop died of it
    assert ep.finish_reason is None and "cancelled" in ep.error and run.stats.failed == 1
    # a tool call the parser cannot read: the environment is told (an error observation), nothing crashes
    ep, run = one("Echo", tok=chat_tokenizer, reply='<tool_call>{"name": oops</tool_call>',
                  max_new_tokens=40, max_context=200)
    assert ep.error is None and ep.finish_reason == "stop" and run.stats.tool_call_errors == 4
    assert "tool call 0 is not valid JSON" in ep.env.seen[0].tool_call_errors[0]
    assert "T:tool call 0 is not valid JSON" in chat_tokenizer.decode(ep.transcript.response_ids)


class AsyncEcho(Echo):
    """The same with ``async def``: both run on the runner's event loop."""

    async def reset(self, prompt):
        await asyncio.sleep(0.01)
        return "hi again"

    async def step(self, turn):
        await asyncio.sleep(0.01)
        return Echo.step(self, turn)


class CancelledMidCall(AsyncEcho):
    async def reset(self, prompt):
        return Echo.reset(self, prompt)

    async def step(self, turn):
        if self.bad:  # it awaited a sub-request that something else cancelled
            raise asyncio.CancelledError()
        return await AsyncEcho.step(self, turn)


class Busy(Echo):
    def step(self, turn):
        time.sleep(0.3)  # a tool's work
        return super().step(turn)


def test_the_time_limit_counts_from_when_a_call_runs_not_from_its_wait_for_a_thread(tokenizer):
    # 8 episodes of 2 steps of 0.3 s on 2 threads: the last steps wait about 2 s for a thread.
    # Counted from their submission, those failed a 1 s limit that no call came near.
    run = runner(ScriptedEngine(tokenizer, lambda req, turn: "ab"), tokenizer, {"_target_": "test_episodes.Busy"},
                 timeout_s=1.0, threads=2)
    done = run_all(run, {f"e{i}": Prompt(f"p{i}", "hi") for i in range(8)})
    assert [ep.error for ep in done.values()] == [None] * 8 and run.calls.timeouts == 0


def next_answers(calls, timeout_s: float = 10.0):
    """The next answers :meth:`EnvCalls.poll` gives (failing after ``timeout_s`` without any)."""
    deadline = time.monotonic() + timeout_s
    while not (got := calls.poll(block_s=0.02)):
        assert time.monotonic() < deadline, "no answer: the call is lost (or the event loop gone)"
    return got


def test_a_call_abandoned_past_its_time_limit_still_holds_its_thread(tokenizer):
    # 1 thread: a call past the limit is abandoned (its episode fails), but a Python thread cannot
    # be stopped, so the next call waits for that thread. Once it was counted as running, not
    # queued, and the worker claimed more episodes for environment threads that were not free.
    run = runner(ScriptedEngine(tokenizer, lambda req, turn: "ab"), tokenizer, {"_target_": "test_episodes.Echo"},
                 timeout_s=0.05, threads=1)
    release = threading.Event()
    try:
        run.calls.submit("stuck", release.wait)
        assert [(key, type(exc)) for key, _, exc in next_answers(run.calls)] == [("stuck", TimeoutError)]
        run.calls.submit("next", lambda: "ok")
        assert (run.waiting_for_env(), run.queued_for_env()) == (1, 1)  # waits for the abandoned call's thread
    finally:
        release.set()
    assert next_answers(run.calls) == [("next", "ok", None)] and run.queued_for_env() == 0
    run.close()


def test_an_async_call_that_raises_system_exit_fails_alone_and_the_event_loop_goes_on(tokenizer):
    # raised inside the event loop, SystemExit ended its thread: every later async call waited for ever
    run = runner(ScriptedEngine(tokenizer, lambda req, turn: "ab"), tokenizer, {"_target_": "test_episodes.Echo"})

    async def leaves(code):
        raise SystemExit(code)

    async def answers():
        await asyncio.sleep(0)
        return "ok"

    run.calls.submit("exits", leaves, 3)
    ((key, value, exc),) = next_answers(run.calls)
    assert (key, value, type(exc), exc.code) == ("exits", None, SystemExit, 3)
    run.calls.submit("plain, returning a coroutine", lambda: leaves(4))
    ((key, _, exc),) = next_answers(run.calls)
    assert (key, type(exc)) == ("plain, returning a coroutine", SystemExit)
    run.calls.submit("next", answers)
    assert next_answers(run.calls) == [("next", "ok", None)]
    run.close()


def test_async_environments_run_on_the_event_loop(tokenizer):
    run = runner(ScriptedEngine(tokenizer, lambda req, turn: "ab"), tokenizer, {"_target_": "test_episodes.AsyncEcho"})
    done = run_all(run, {f"e{i}": Prompt(f"p{i}", "hi") for i in range(3)})
    assert all((ep.finish_reason, ep.env_reward, len(ep.turns)) == ("stop", 1.0, 2) for ep in done.values())
    assert tokenizer.decode(done["e0"].transcript.prompt_ids) == "hi again"
    assert tokenizer.decode(done["e0"].transcript.response_ids) == "abokab"


def test_environment_constructor_arguments_are_checked_at_start_up():
    with pytest.raises(ConfigError, match=r"test_episodes.Echo\(colour=...\) does not fit its constructor"):
        EnvFactory(RolloutConfig(env={"_target_": "test_episodes.Echo", "colour": "red"}))


def test_closing_the_calls_ends_a_thread_waiting_on_the_event_loop():
    # a plain method that returned a coroutine waits for it on its pool thread: stopping the event
    # loop under it left that thread waiting for ever, and the worker's exit, which joins the
    # pool's threads, with it
    from rollout_workers.episodes import EnvCalls

    calls = EnvCalls(threads=1, timeout_s=None)
    running = threading.Event()

    async def step():
        running.set()
        await asyncio.Event().wait()  # it would answer, later, on a loop still running

    calls.submit("e", lambda: step())
    assert running.wait(10)
    calls.close()
    ((key, _, exc),) = next_answers(calls)
    assert key == "e" and exc is not None
