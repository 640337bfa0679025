"""rlhf-gateway driven by the official `openai` client: a real worker (tiny model) serves the
calls through a real Redis, sessions become samples the learner reads.

One worker thread and one gateway serve the whole module (each test has its own session ids;
groups are read back by name). The tiny model writes random characters, so nothing here
depends on what it writes: only on shapes, counts, token ids and the protocol. Three ways make
a behaviour deterministic without depending on the model's text: a test that needs a call to
stay in flight holds the worker's engine (:class:`Hold`: the worker keeps looping, taking calls
and seeing cancellations, but decodes nothing); a tool call, which the random model never
writes, is a reply the test scripts (:class:`Scripted`); stop strings are picked from a greedy
(temperature 0) reply, which is the same every time for the same prompt."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from rlhf_core.records import Sample

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

MODEL = "tiny"
VERSION = 1  # the policy version the fake learner publishes: every sampled token carries it
GROUP = 2  # the run's group size (and the gateway's)
KEY = "k" * 24  # the API key of the gateway with keys
SETTINGS = ["gateway.enabled=true", "gateway.port=0", "data.source=none", "gateway.session_ttl_s=60",
            "gateway.max_tokens=32", "gateway.max_n=2", "gateway.max_request_bytes=8192", f"algo.group_size={GROUP}",
            "rollout.max_new_tokens=8", "rollout.max_episode_tokens=128", "rollout.max_prompt_tokens=384",
            "model.tiny.max_position_embeddings=512"]  # a context of 512 tokens: a tools prompt and three turns fit
CONTEXT = 512


class Hold:
    """While set, the worker's engine decodes nothing (``step`` returns no results): a call taken
    meanwhile stays in flight for as long as the test wants, deterministically, whatever the
    random model would write. The worker's loop goes on (takes calls, sees cancellations)."""

    def __init__(self, engine: Any) -> None:
        self.event = threading.Event()
        self.let_through = 0  # steps still run while held (a call a few tokens into its reply)
        self._step = engine.step
        engine.step = self.step

    def step(self) -> list:
        if self.event.is_set():
            if self.let_through <= 0:
                time.sleep(0.005)
                return []
            self.let_through -= 1
        return self._step()

    def __enter__(self) -> Hold:
        self.event.set()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.event.clear()


class Scripted:
    """Replies the test writes instead of the random model, for calls the worker takes while
    ``replies`` holds some (one each, in order): the call is decoded as usual and its result's
    tokens replaced, when it finishes, by the reply's ids and EOS (log-prob -1 each). What the
    random model would never write (a tool call) then goes through the worker, the gateway and
    the client like any reply."""

    def __init__(self, engine: Any, tokenizer: Any) -> None:
        self.tokenizer, self.replies = tokenizer, collections.deque()
        self._add, self._step = engine.add, engine.step
        self._mine: dict[str, str] = {}
        self.max_new_tokens: list[int] = []  # of every gateway call the engine got, in order
        engine.add, engine.step = self.add, self.step

    def add(self, request: Any) -> None:
        if request.request_id.startswith("gw/"):
            self.max_new_tokens.append(request.params.max_new_tokens)
        if request.request_id.startswith("gw/") and self.replies:
            self._mine[request.request_id] = self.replies.popleft()
        self._add(request)

    def step(self) -> list:
        from rollout_workers.engine import make_result

        out = []
        for r in self._step():
            text = self._mine.pop(r.request_id, None)
            if text is not None:
                ids = [*self.tokenizer(text, add_special_tokens=False)["input_ids"], self.tokenizer.eos_token_id]
                r = make_result(r.request_id, r.prompt_ids, ids, [-1.0] * len(ids), [VERSION] * len(ids), "stop", text)
            out.append(r)
        return out


def worker_stats(learner: Any, worker_id: str) -> dict[str, Any]:
    return learner.buffer.monitor.metrics()["consumers"].get(worker_id, {}).get("stats", {})


@dataclass
class Served:
    cfg: Any
    learner: Any
    worker: Any
    hold: Hold
    script: Scripted
    url: str
    client: Any
    tokenizer: Any
    read: dict[str, list] = field(default_factory=dict)  # groups read from the buffer, by group name

    def chat(self, session: str | None = None, group: str | None = None, **kwargs: Any) -> Any:
        headers = {k: v for k, v in (("X-Session-Id", session), ("X-Group-Id", group)) if v}
        kwargs.setdefault("messages", [{"role": "user", "content": "hi"}])
        kwargs.setdefault("model", MODEL)
        return self.client.chat.completions.create(extra_headers=headers, **kwargs)

    def reward(self, session: str, reward: Any, **body: Any) -> httpx.Response:
        return httpx.post(f"{self.url}/rl/sessions/{session}/reward", json={"reward": reward, **body}, timeout=10)

    def stats(self) -> dict[str, int]:
        return httpx.get(f"{self.url}/rl/stats", timeout=10).json()

    def worker_stats(self) -> dict[str, Any]:
        """The worker's last heartbeat (what rlhf-monitor shows)."""
        return worker_stats(self.learner, "w0")

    def group(self, name: str, timeout_s: float = 20.0) -> list:
        """The samples of the group ``name`` appended (by any test: others are kept for theirs)."""
        deadline = time.monotonic() + timeout_s
        while name not in self.read:
            left = deadline - time.monotonic()
            assert left > 0, f"group {name!r} did not reach the buffer within {timeout_s} s (read: {sorted(self.read)})"
            batch = self.learner.buffer.learner.read_batch("learner", VERSION, GROUP, timeout_s=min(left, 1.0))
            for g in batch.groups if batch is not None else []:
                samples = batch.samples[g.start:g.end]
                self.read[samples[0].prompt_id.removeprefix("gw:")] = samples
        return self.read.pop(name)


@pytest.fixture(scope="module")
def infra(tmp_path_factory, tiny_model_cfg):
    """A Redis and a weight server for the module."""
    from rlhf_core.config import WeightServerConfig
    from servers import RedisServer
    from weight_server import WeightServer

    redis = RedisServer(tmp_path_factory.mktemp("gateway") / "redis", appendonly=False).start()
    try:
        with WeightServer(WeightServerConfig()) as ws:
            yield redis, ws
    finally:
        redis.stop()


def _cfg(infra, tiny_model_cfg, run_id: str, *extra: str) -> Any:
    from worker_helpers import compose, overrides

    redis, ws = infra
    return compose(overrides(redis.url, run_id, ws, tiny_model_cfg, extra=[*SETTINGS, *extra]))


@contextlib.contextmanager
def _serve(infra, tiny_model_cfg, run_id: str, worker_id: str, wrap: Callable[[Any, Any], Any],
           *extra: str) -> Iterator[tuple[Any, Any, Any, Any, Any]]:
    """A run of this module's kind (``extra``: more settings): the test plays the learner, one
    worker thread, the gateway in this process (one gateway per run). ``wrap(engine, tokenizer)``
    wraps the worker's engine before it starts; yields ``(cfg, learner, worker thread, gateway
    server (started), what wrap returned)``; stops them all after."""
    from gateway.server import GatewayServer
    from worker_helpers import FakeLearner, WorkerThread

    cfg = _cfg(infra, tiny_model_cfg, run_id, *extra)
    with contextlib.ExitStack() as stack:  # stopped in reverse order, whatever fails on the way
        learner = FakeLearner(cfg)
        stack.callback(learner.close)
        learner.publish(VERSION)
        wt = WorkerThread(cfg, worker_id)
        stack.callback(wt.halt)
        wrapped = wrap(wt.worker.engine, learner.tokenizer)
        wt.start()
        server = GatewayServer(cfg)
        stack.callback(server.stop)
        server.start()
        yield cfg, learner, wt, server, wrapped


@contextlib.contextmanager
def _run(infra, tiny_model_cfg, run_id: str, worker_id: str, wrap: Callable[[Any, Any], Any],
         *extra: str) -> Iterator[tuple[Any, Any, Any, str, Any]]:
    """:func:`_serve`, yielding the gateway's url in place of its server."""
    with _serve(infra, tiny_model_cfg, run_id, worker_id, wrap, *extra) as (cfg, learner, wt, server, wrapped):
        yield cfg, learner, wt, server.url, wrapped


@pytest.fixture(scope="module")
def served(infra, tiny_model_cfg):
    """The module's run (:func:`_run`), its engine held by :class:`Hold` and :class:`Scripted` on demand."""
    from gateway.sessions import PLAIN_TEMPLATE

    def wrap(engine: Any, tokenizer: Any) -> tuple[Hold, Scripted]:
        return Hold(engine), Scripted(engine, tokenizer)

    with _run(infra, tiny_model_cfg, "gw-tests", "w0", wrap) as run:
        cfg, learner, wt, url, (hold, script) = run
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60)
        tokenizer = learner.tokenizer
        tokenizer.chat_template = PLAIN_TEMPLATE  # what the gateway renders with (the tiny tokenizer has none)
        try:
            yield Served(cfg, learner, wt, hold, script, url, client, tokenizer)
        finally:
            hold.event.clear()
            client.close()
    assert wt.error is None, wt.error


def token_ids(tokenizer: Any, logprobs: Any) -> list[int]:
    """The ids of a reply from its ``logprobs`` (the tiny tokenizer's tokens are single characters
    or its special tokens: ``convert_tokens_to_ids`` inverts them exactly)."""
    tokens = [t.token for t in logprobs.content] if hasattr(logprobs, "content") else logprobs.tokens
    return tokenizer.convert_tokens_to_ids(tokens)


def render(tokenizer: Any, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         **({"tools": tools} if tools else {}))
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def versions_of(sample: Any) -> list[tuple[int, int]]:
    return [tuple(v) for v in sample.versions]


def check_added(tokenizer: Any, turn_ids: list[int], added_ids: list[int], text: str) -> None:
    """What the template put between a sampled turn and the next call: the EOS closing the turn
    (unless the turn ended with it), then ``text`` (the agent's message and the next generation
    prompt). Exactly so when the turn's text re-renders as sampled; a turn with special tokens
    inside (the random model samples <pad> now and then) takes the template's other path, whose
    turn end is reconstructed: only the message is checked then."""
    eos = tokenizer.eos_token_id
    if set(turn_ids[:-1]) & set(tokenizer.all_special_ids):
        assert tokenizer.decode(added_ids, skip_special_tokens=False).endswith(text)
    else:
        closing = tokenizer(("" if turn_ids[-1] == eos else tokenizer.eos_token) + text,
                            add_special_tokens=False)["input_ids"]
        assert added_ids == closing


# ---------------------------------------------------------------------------------------------- sessions to samples


def test_a_multi_turn_chat_session_becomes_one_sample_token_in_token_out(served):
    tok = served.tokenizer
    restarted, drifted = served.stats()["sessions_restarted"], served.stats()["retokenisation_drift"]
    messages = [{"role": "system", "content": "count"}, {"role": "user", "content": "from 3"}]
    first = served.chat("mt", "g-mt", messages=messages, max_tokens=6, logprobs=True)
    assert first.choices[0].finish_reason in ("stop", "length") and first.model == MODEL
    ids1 = token_ids(tok, first.choices[0].logprobs)
    lp1 = [t.logprob for t in first.choices[0].logprobs.content]
    assert first.usage.completion_tokens == len(ids1) and 1 <= len(ids1) <= 6
    assert first.choices[0].message.content == tok.decode(ids1, skip_special_tokens=True)
    prompt = render(tok, messages)
    assert first.usage.prompt_tokens == len(prompt)

    messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "go on"}]
    second = served.chat("mt", messages=messages, max_tokens=5, logprobs=True)
    ids2 = token_ids(tok, second.choices[0].logprobs)
    lp2 = [t.logprob for t in second.choices[0].logprobs.content]
    # the context is the first call's prompt, its sampled ids as sampled, then the user's turn
    added = second.usage.prompt_tokens - len(prompt) - len(ids1)
    assert added >= len(" [user] go on [assistant] ")
    assert served.stats()["sessions_restarted"] == restarted

    partner = served.chat("mt-partner", "g-mt", max_tokens=2)
    r = served.reward("mt", 0.5)
    assert r.status_code == 200, r.text
    assert r.json() == {"session": "mt", "group": "g-mt", "reward": 0.5, "status": "waiting_for_group", "samples": 0}
    r = served.reward("mt-partner", {"format": -1.0, "length": 0.25})
    assert r.status_code == 200 and r.json()["status"] == "appended" and r.json()["samples"] == 2, r.text

    group = served.group("g-mt")
    by_session = {s.metadata["session"]: s for s in group}
    s = by_session["mt"]
    assert s.prompt_ids.tolist() == prompt
    response = s.response_ids.tolist()
    assert len(response) == len(ids1) + added + len(ids2)
    assert response[:len(ids1)] == ids1 and response[len(response) - len(ids2):] == ids2
    check_added(tok, ids1, response[len(ids1):len(ids1) + added], " [user] go on [assistant] ")
    assert s.loss_mask.tolist() == [1] * len(ids1) + [0] * added + [1] * len(ids2)
    assert s.behaviour_logprobs.tolist() == pytest.approx(lp1 + [0.0] * added + lp2, abs=1e-5)
    assert versions_of(s) == [(VERSION, len(response))]
    assert (s.reward, s.reward_components) == (0.5, {})
    assert s.metadata["turns"] == 2 and s.worker_id == "gateway" and s.finish_reason == second.choices[0].finish_reason
    # drift (checked on a thread while the second call ran): the conversation's rendering, tokenised,
    # against the second call's context (the tiny model may sample a token its text does not render)
    drift = int(render(tok, messages) != [*prompt, *response[:len(ids1) + added]])
    assert s.metadata["retokenisation_drift"] == drift and served.stats()["retokenisation_drift"] == drifted + drift
    p = by_session["mt-partner"]
    assert (p.reward, p.reward_components) == (-0.75, {"format": -1.0, "length": 0.25})
    assert p.num_response_tokens == partner.usage.completion_tokens and p.loss_mask.all()
    assert {x.group_id for x in group} == {group[0].group_id} and sorted(x.group_index for x in group) == [0, 1]
    assert {x.group_size for x in group} == {2}


def test_a_reply_the_template_cannot_render_back_counts_as_drift_checked_beside_the_call(served):
    # The scripted reply holds a <pad> that the reply's text (special tokens skipped) does not
    # have: the next call's context keeps the sampled ids, and its drift check (on a thread while
    # that call is generated) finds the conversation's rendering, tokenised, without it.
    tok = served.tokenizer
    before = served.stats()["retokenisation_drift"]
    served.script.replies.append(f"1{tok.pad_token}2")
    messages = [{"role": "user", "content": "count"}]
    first = served.chat("drift", "g-drift", messages=messages, max_tokens=8)
    assert first.choices[0].message.content == "12"
    messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "on"}]
    second = served.chat("drift", messages=messages, max_tokens=2)
    assert served.stats()["retokenisation_drift"] == before + 1
    # the context keeps the <pad>, so every later call drifts too: counted at once, no check run
    messages += [second.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
    served.chat("drift", messages=messages, max_tokens=2)
    assert served.stats()["retokenisation_drift"] == before + 2
    served.chat("drift-partner", "g-drift", max_tokens=2)  # the run's groups have 2 sessions
    assert served.reward("drift", 1.0).status_code == 200 and served.reward("drift-partner", 0.0).status_code == 200
    sample = {x.metadata["session"]: x for x in served.group("g-drift")}["drift"]
    assert sample.metadata["retokenisation_drift"] == 2
    assert tok.pad_token_id in sample.response_ids.tolist()  # trained on the ids as sampled


TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
    "a": {"type": "integer"}, "b": {"type": "integer"}}}}}]


def run_tool(call: Any) -> str:
    try:
        args = json.loads(call.function.arguments or "{}")
        return str(int(args.get("a", 0)) + int(args.get("b", 0)))
    except (ValueError, TypeError, AttributeError) as exc:
        return f"error: {exc}"


async def agent(client: Any, session: str, group: str, task: str) -> list[Any]:
    """A tool-using agent loop as users write them; returns its replies."""
    messages: list[Any] = [{"role": "user", "content": task}]
    replies = []
    for _ in range(3):
        reply = await client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=6,
                                                     extra_headers={"X-Session-Id": session, "X-Group-Id": group})
        replies.append(reply)
        message = reply.choices[0].message
        messages.append(message)  # the client's own object, as the OpenAI docs' loops do
        if message.tool_calls:
            for call in message.tool_calls:
                messages.append({"role": "tool", "tool_call_id": call.id, "content": run_tool(call)})
        else:
            messages.append({"role": "user", "content": "use add"})
    return replies


def test_tool_using_agents_run_concurrently_and_their_sessions_become_a_group(served):
    restarted = served.stats()["sessions_restarted"]

    async def main() -> list[list[Any]]:
        async with openai.AsyncOpenAI(base_url=served.url, api_key="none", max_retries=0, timeout=60) as client:
            runs = await asyncio.gather(agent(client, "ag-0", "g-agents", "add 2 and 3"),
                                        agent(client, "ag-1", "g-agents", "add 4 and 5"))
            for i in range(2):
                r = await client.post(f"/rl/sessions/ag-{i}/reward", cast_to=httpx.Response, body={"reward": float(i)})
                assert r.status_code == 200
            return runs

    runs = asyncio.run(main())
    assert served.stats()["sessions_restarted"] == restarted  # every call extended its session
    group = {s.metadata["session"]: s for s in served.group("g-agents")}
    assert set(group) == {"ag-0", "ag-1"}
    for i, replies in enumerate(runs):
        s = group[f"ag-{i}"]
        assert s.reward == float(i) and s.metadata["turns"] == 3
        assert all(r.choices[0].finish_reason in ("stop", "length", "tool_calls") for r in replies)
        # the prompt is the tools and the task; every reply's tokens are trained, nothing else
        assert s.prompt_ids.tolist() == render(served.tokenizer, [{"role": "user", "content": f"add {2 + 2 * i} and "
                                                                   f"{3 + 2 * i}"}], TOOLS)
        assert int(s.loss_mask.sum()) == sum(r.usage.completion_tokens for r in replies)
        assert replies[0].usage.prompt_tokens == len(s.prompt_ids)
        last = replies[-1].usage
        assert len(s.prompt_ids) + s.num_response_tokens == last.prompt_tokens + last.completion_tokens
        for a, b in zip(replies, replies[1:]):  # each call's context grew by the reply and what the agent added
            assert b.usage.prompt_tokens > a.usage.prompt_tokens + a.usage.completion_tokens


CALL = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'


def test_a_tool_call_goes_to_the_client_and_its_result_into_the_session(served):
    tok = served.tokenizer
    restarted = served.stats()["sessions_restarted"]
    messages: list[Any] = [{"role": "user", "content": "add 1 and 2"}]
    served.script.replies.append("sure " + CALL)
    first = served.chat("tools", "g-tools", messages=messages, tools=TOOLS)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "sure"
    (call,) = choice.message.tool_calls
    assert (call.type, call.function.name, json.loads(call.function.arguments)) == ("function", "add", {"a": 1, "b": 2})
    sampled = [*tok("sure " + CALL, add_special_tokens=False)["input_ids"], tok.eos_token_id]
    assert first.usage.completion_tokens == len(sampled)
    # the agent runs the tool and sends the client's own message object back with the result
    messages += [choice.message, {"role": "tool", "tool_call_id": call.id, "content": run_tool(call)}]
    second = served.chat("tools", messages=messages, tools=TOOLS, max_tokens=3)
    assert served.stats()["sessions_restarted"] == restarted  # the echoed tool call matched the one returned
    added = second.usage.prompt_tokens - first.usage.prompt_tokens - len(sampled)
    # streamed, with tools: the call comes as a tool_calls delta
    served.script.replies.append(CALL)
    chunks = list(served.chat("tools-stream", messages=messages[:1], tools=TOOLS, stream=True))
    calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert [(tc.index, tc.function.name, json.loads(tc.function.arguments)) for tc in calls] == [(0, "add", {"a": 1, "b": 2})]
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]

    assert served.reward("tools", 1.0).status_code == 200
    assert served.reward("tools-partner", 0.0).status_code == 404  # no call yet
    served.chat("tools-partner", "g-tools", max_tokens=1)
    assert served.reward("tools-partner", 0.0).json()["status"] == "appended"
    s = {x.metadata["session"]: x for x in served.group("g-tools")}["tools"]
    assert s.prompt_ids.tolist() == render(tok, messages[:1], TOOLS)
    response = s.response_ids.tolist()
    assert response[:len(sampled)] == sampled and s.behaviour_logprobs[:len(sampled)].tolist() == [-1.0] * len(sampled)
    check_added(tok, sampled, response[len(sampled):len(sampled) + added], " [tool] 3 [assistant] ")
    assert s.loss_mask.tolist() == [1] * len(sampled) + [0] * added + [1] * second.usage.completion_tokens


def test_a_last_call_without_tools_goes_on_with_its_session(served):
    # Once: a call whose tools differed from its session's restarted the session, so the common
    # agent pattern "tools while working, none for the last answer" trained only the last call
    tok = served.tokenizer
    restarted = served.stats()["sessions_restarted"]
    messages: list[Any] = [{"role": "user", "content": "add 1 and 2"}]
    served.script.replies.append(CALL)
    first = served.chat("last-plain", messages=messages, tools=TOOLS)
    (call,) = first.choices[0].message.tool_calls
    messages += [first.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": run_tool(call)},
                 {"role": "user", "content": "now answer"}]
    # the model still sees the tools; what it writes comes back as text (the session's 128 tokens hold 14 more)
    served.script.replies.append("<tool_call>{}")
    last = served.chat("last-plain", messages=messages)
    assert served.stats()["sessions_restarted"] == restarted
    assert (last.choices[0].finish_reason, last.choices[0].message.tool_calls) == ("stop", None)
    assert last.choices[0].message.content == "<tool_call>{}"
    assert served.reward("last-plain", 1.0).json()["status"] == "appended"
    (sample,) = served.group("last-plain")
    assert sample.metadata["turns"] == 2 and sample.prompt_ids.tolist() == render(tok, messages[:1], TOOLS)
    assert int(sample.loss_mask.sum()) == first.usage.completion_tokens + last.usage.completion_tokens


def test_n_choices_make_sessions_of_one_group(served):
    raw = served.client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "two ways"}], n=2, max_tokens=4, logprobs=True,
        extra_headers={"X-Session-Id": "pair"})
    assert raw.headers["x-session-id"] == "pair"
    reply = raw.parse()
    assert [c.index for c in reply.choices] == [0, 1]
    ids = [token_ids(served.tokenizer, c.logprobs) for c in reply.choices]
    assert reply.usage.completion_tokens == len(ids[0]) + len(ids[1])
    r = served.reward("pair/1", 1.0)
    assert r.json()["status"] == "waiting_for_group" and r.json()["group"] == "pair"
    r = served.reward("pair/0", 0.0)
    assert r.json() == {"session": "pair/0", "group": "pair", "reward": 0.0, "status": "appended", "samples": 2}
    group = served.group("pair")
    assert [s.metadata["session"] for s in group] == ["pair/1", "pair/0"] and [s.reward for s in group] == [1.0, 0.0]
    assert [s.response_ids.tolist() for s in group] == [ids[1], ids[0]]
    assert group[0].prompt_ids.tolist() == group[1].prompt_ids.tolist()
    assert group[0].group_id == group[1].group_id and [s.group_index for s in group] == [0, 1]
    # the session of one choice goes on by its own id
    assert served.reward("pair", 1.0).status_code == 404


def test_completions_continue_a_session_from_its_sampled_ids(served):
    tok = served.tokenizer
    first = served.client.completions.create(model=MODEL, prompt="Q: 1+1 =", max_tokens=5, logprobs=1,
                                             extra_headers={"X-Session-Id": "cm", "X-Group-Id": "g-cm"})
    ids1 = token_ids(tok, first.choices[0].logprobs)
    assert first.usage.prompt_tokens == len("Q: 1+1 =") and first.usage.completion_tokens == len(ids1)
    text = "Q: 1+1 =" + first.choices[0].text + " Q: 2+2 ="
    second = served.client.completions.create(model=MODEL, prompt=text, max_tokens=3, user="cm")  # `user` names it too
    assert second.usage.prompt_tokens == len("Q: 1+1 =") + len(ids1) + len(" Q: 2+2 =")
    other = served.client.completions.create(model=MODEL, prompt=[10, 11, 12], max_tokens=2, user="cm-other")
    assert other.usage.prompt_tokens == 3
    assert served.reward("cm", 1.0).json()["status"] == "waiting_for_group"
    assert served.reward("cm-other", 0.0, group="g-cm").json()["status"] == "appended"  # the reward names the group
    s = {x.metadata["session"]: x for x in served.group("g-cm")}
    cm = s["cm"]
    assert cm.prompt_ids.tolist() == tok("Q: 1+1 =", add_special_tokens=False)["input_ids"]
    n2 = second.usage.completion_tokens
    assert cm.response_ids.tolist()[:len(ids1)] == ids1
    assert cm.loss_mask.tolist() == [1] * len(ids1) + [0] * len(" Q: 2+2 =") + [1] * n2
    assert s["cm-other"].prompt_ids.tolist() == [10, 11, 12]


def test_a_call_without_max_tokens_gets_gateway_max_tokens_within_the_context_left(served):
    # Once: it got rollout.max_new_tokens (6 by default): agents that name no max_tokens saw 6-token replies
    served.chat("no-max")
    assert served.script.max_new_tokens[-1] == 32  # gateway.max_tokens (rollout.max_new_tokens is 8)
    long = served.chat("no-max-long", messages=[{"role": "user", "content": "y" * (CONTEXT - 40)}])
    assert served.script.max_new_tokens[-1] == CONTEXT - long.usage.prompt_tokens < 32  # what the context holds


def test_a_session_without_a_group_is_appended_as_it_is_rewarded(served):
    # Once: a group of one waited gateway.session_ttl_s for more sessions before it was appended
    reply = served.chat("lone", max_tokens=3)
    r = served.reward("lone", 0.25)
    assert r.status_code == 200 and (r.json()["status"], r.json()["samples"]) == ("appended", 1), r.text
    (sample,) = served.group("lone")
    assert (sample.reward, sample.group_size, sample.num_response_tokens) == (0.25, 1, reply.usage.completion_tokens)


def test_the_docs_example_agent_runs_twice(served):
    # Once: its session ids were fixed, so a second run was refused (409: rewarded already)
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "gateway.md").read_text()
    code = doc.split("## A user's existing agent, trained\n\n```python\n", 1)[1].split("```", 1)[0]
    assert code.count("http://127.0.0.1:8000/v1") == 2
    before = served.stats()["sessions_rewarded"]
    for _ in range(2):
        exec(compile(code.replace("http://127.0.0.1:8000/v1", served.url), "docs/gateway.md", "exec"), {})
    assert served.stats()["sessions_rewarded"] == before + 8


def test_a_call_without_a_session_id_gets_a_fresh_one(served):
    raw = served.client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=1)
    sid = raw.headers["x-session-id"]
    assert sid.startswith("s-") and len(sid) > 10
    raw2 = served.client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=1)
    assert raw2.headers["x-session-id"] != sid
    raw3 = served.client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=1, user="by-user-field")
    assert raw3.headers["x-session-id"] == "by-user-field"


# ---------------------------------------------------------------------------------------------- streaming


def test_a_streamed_chat_reply_is_the_reply_in_pieces(served):
    tok = served.tokenizer
    restarted = served.stats()["sessions_restarted"]
    stream = served.chat("st", messages=[{"role": "user", "content": "stream"}], max_tokens=12, stream=True,
                         stream_options={"include_usage": True}, logprobs=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c for c in chunks if c.choices and c.choices[0].delta.content]
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason in ("stop", "length")
    ids = token_ids(tok, finals[0].choices[0].logprobs)
    text = "".join(c.choices[0].delta.content for c in content)
    assert text == tok.decode(ids, skip_special_tokens=True)  # what a plain call returns for these ids
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ids)
    assert chunks[-1].usage.prompt_tokens == len(render(tok, [{"role": "user", "content": "stream"}]))
    assert len({c.id for c in chunks}) == 1 and all(c.object == "chat.completion.chunk" for c in chunks)

    # the same on the wire: server-sent events ending with [DONE]; the session goes on from the streamed ids
    body = {"model": MODEL, "messages": [{"role": "user", "content": "stream"},
                                         {"role": "assistant", "content": text}, {"role": "user", "content": "more"}],
            "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{served.url}/chat/completions", json=body, headers={"X-Session-Id": "st"},
                      timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    assert "usage" not in json.loads(events[-2].removeprefix("data: "))  # not asked for
    assert served.stats()["sessions_restarted"] == restarted  # the second call went on from the streamed ids


def test_a_streamed_completion_ends_with_its_usage(served):
    stream = served.client.completions.create(model=MODEL, prompt="abc", max_tokens=6, stream=True,
                                              stream_options={"include_usage": True}, user="st-cmpl")
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(reasons) == 1 and chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == 3
    assert 1 <= chunks[-1].usage.completion_tokens <= 6 and len(text) <= chunks[-1].usage.completion_tokens


PROBES = ["abc", "Q: 1+1 =", "hello", "x", "7 8 9", "The", "zz", "[user] hi", "9", "what"]


def greedy_stop(reply_text: Any) -> tuple[str, str, int]:
    """``(prompt, reply, j)``: a prompt whose greedy reply (temperature 0: the same each time) has at
    ``j`` >= 1 a character not seen before it, so ``stop=[reply[j]]`` cuts the reply to ``reply[:j]``
    exactly. The random model's replies vary by prompt; one of the probes always qualifies."""
    for prompt in PROBES:
        text = reply_text(prompt)
        for j in range(1, len(text)):
            if text[j] not in text[:j] and text[j].strip():
                return prompt, text, j
    raise AssertionError(f"no greedy reply of {PROBES} has two different characters: is temperature=0 greedy?")


def test_a_stop_string_cuts_a_chat_reply_and_its_stream_and_the_session_goes_on(served):
    tok = served.tokenizer
    n = iter(range(1000))

    def reply_text(prompt: str) -> str:
        return served.chat(f"probe-chat-{next(n)}", messages=[{"role": "user", "content": prompt}], max_tokens=8,
                           temperature=0).choices[0].message.content

    prompt, text, j = greedy_stop(reply_text)
    messages = [{"role": "user", "content": prompt}]
    restarted = served.stats()["sessions_restarted"]
    cut = served.chat("stop-chat", messages=messages, max_tokens=8, temperature=0, stop=[text[j]], logprobs=True)
    ids = token_ids(tok, cut.choices[0].logprobs)
    assert (cut.choices[0].message.content, cut.choices[0].finish_reason) == (text[:j], "stop")
    assert text[j] in tok.decode(ids[-1:])  # the token that wrote the stop string was sampled (and is trained on)
    # streamed: no piece of the stop string reaches the client
    stream = served.chat("stop-stream", messages=messages, max_tokens=8, temperature=0, stop=[text[j]], stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text[:j]
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    # the agent goes on with the reply it got: the session keeps the sampled ids (stop string included)
    messages += [cut.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
    second = served.chat("stop-chat", messages=messages, max_tokens=2)
    assert served.stats()["sessions_restarted"] == restarted
    if not set(ids) & set(tok.all_special_ids):
        closing = tok(tok.eos_token + " [user] more [assistant] ", add_special_tokens=False)["input_ids"]
        assert second.usage.prompt_tokens == cut.usage.prompt_tokens + len(ids) + len(closing)


def _completion_probe(served: Served) -> tuple[str, str, int]:
    n = iter(range(1000))
    return greedy_stop(lambda p: served.client.completions.create(
        model=MODEL, prompt=p, max_tokens=8, temperature=0, user=f"probe-cmpl-{next(n)}").choices[0].text)


def test_a_completion_cut_by_a_stop_string_goes_on_when_the_agent_writes_the_stop_string_back(served):
    """ReAct-style: stop=["Observation:"], the agent appends "Observation: <result>" itself."""
    prompt, text, j = _completion_probe(served)
    first = served.client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stop=[text[j]],
                                             user="react")
    assert (first.choices[0].text, first.choices[0].finish_reason) == (text[:j], "stop")
    restarted = served.stats()["sessions_restarted"]
    second = served.client.completions.create(model=MODEL, prompt=prompt + text[:j + 1] + " seen", max_tokens=2,
                                              user="react")
    assert served.stats()["sessions_restarted"] == restarted
    assert second.usage.prompt_tokens == len(prompt) + first.usage.completion_tokens + len(" seen")


def test_a_completion_cut_by_a_stop_string_goes_on_from_the_text_the_client_got(served):
    prompt, text, j = _completion_probe(served)
    first = served.client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stop=[text[j]],
                                             user="cmpl-stop")
    assert first.choices[0].text == text[:j]
    restarted = served.stats()["sessions_restarted"]
    served.client.completions.create(model=MODEL, prompt=prompt + first.choices[0].text + " more", max_tokens=2,
                                     user="cmpl-stop")
    assert served.stats()["sessions_restarted"] == restarted


def _aborted(served: Any, before: int) -> bool:
    """The worker of ``served`` (a :class:`Served`, or a function giving its stats) aborted a call
    since it had aborted ``before``, and runs nothing."""
    w = served() if callable(served) else served.worker_stats()
    return w.get("gateway_aborted", 0) > before and w.get("active", 1) == 0 and w.get("waiting", 1) == 0 \
        and w.get("gateway_running", 1) == 0


def test_a_client_that_goes_away_mid_stream_gets_its_call_aborted(served):
    from servers import wait_for

    before, stats = served.worker_stats().get("gateway_aborted", 0), served.stats()
    with served.hold:
        stream = served.chat("gone", messages=[{"role": "user", "content": "long"}], max_tokens=32, stream=True)
        first = next(iter(stream))
        assert first.choices[0].delta.role == "assistant"
        # the worker has taken the call and holds it
        wait_for(lambda: served.worker_stats().get("gateway_running") == 1, 10, "the worker to take the call", 0.1)
        stream.close()  # the client goes away
        wait_for(lambda: _aborted(served, before), 15, "the worker to abort the call and free its slot", 0.1)
    after = served.stats()
    assert after["calls_aborted"] == stats["calls_aborted"] + 1 and after["calls_running"] == 0
    assert after["calls_failed"] == stats["calls_failed"] + 1
    # the session is as before the call (none: it was its first); the gateway and worker go on
    assert served.reward("gone", 1.0).status_code == 404
    reply = served.chat("gone", max_tokens=2)
    assert reply.choices[0].finish_reason in ("stop", "length")


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_a_client_that_times_out_on_a_plain_call_gets_it_aborted(served):
    from servers import wait_for

    before, calls_aborted = served.worker_stats().get("gateway_aborted", 0), served.stats()["calls_aborted"]
    impatient = openai.OpenAI(base_url=served.url, api_key="none", max_retries=0, timeout=0.5)
    errors = _Records()
    logging.getLogger("uvicorn.error").addHandler(errors)  # uvicorn's loggers do not propagate to pytest's
    try:
        with served.hold:
            with pytest.raises(openai.APITimeoutError):
                impatient.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                  max_tokens=32, extra_headers={"X-Session-Id": "impatient"})
            wait_for(lambda: _aborted(served, before), 15, "the worker to abort the call of the client that left", 0.1)
            wait_for(lambda: served.stats()["calls_running"] == 0, 5, "the gateway to finish the request", 0.1)
    finally:
        logging.getLogger("uvicorn.error").removeHandler(errors)
        impatient.close()
    assert served.stats()["calls_aborted"] == calls_aborted + 1
    # a client leaving is no server error (no "Exception in ASGI application" with a traceback)
    assert [r.getMessage() for r in errors.records] == []
    assert served.chat("impatient", max_tokens=1).usage.completion_tokens == 1


def test_a_call_no_worker_finishes_in_time_fails_with_503_and_is_cancelled(infra, tiny_model_cfg):
    from servers import wait_for

    with _run(infra, tiny_model_cfg, "gw-impatient", "w-impatient", lambda engine, _: Hold(engine),
              "gateway.call_timeout_s=1") as (_, learner, _, url, hold):
        stats = lambda: worker_stats(learner, "w-impatient")  # noqa: E731
        with hold:
            t0 = time.monotonic()
            r = httpx.post(f"{url}/chat/completions", content=_chat_body(), headers={"X-Session-Id": "late"}, timeout=30)
            assert r.status_code == 503 and r.headers["retry-after"] == "2", r.text
            assert r.json()["error"]["code"] == "timeout" and 1 <= time.monotonic() - t0 < 10
            wait_for(lambda: _aborted(stats, 0), 15, "the worker to abort the timed-out call", 0.1)
        stats = httpx.get(f"{url}/rl/stats", timeout=10).json()
        assert (stats["calls_aborted"], stats["calls_failed"], stats["sessions_open"]) == (1, 1, 0)
        r = httpx.post(f"{url}/chat/completions", content=_chat_body(), headers={"X-Session-Id": "late"}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1


def test_a_call_whose_gateway_is_gone_is_aborted_at_once(served):
    # A gateway that died (or stopped) leaves its calls queued or running; the gateway started
    # after it has an id of its own, so nobody would read their tokens. The worker sees nobody
    # listening on the call's channel at its next check and aborts the call instead of sampling
    # all of its max_tokens (held here: it would run for ever; nobody cancels it).
    import redis.asyncio as aioredis

    from buffer.gateway import CallQueue, GatewayCall
    from servers import wait_for

    keys = served.learner.buffer.keys
    call = GatewayCall(call_id="orphan-call", reply_to="gateway-that-died", prompt_ids=[5, 6, 7], max_tokens=32)

    async def submit() -> None:  # as that gateway pushed it, before it died
        client = aioredis.Redis.from_url(served.cfg.buffer.url)
        try:
            await CallQueue(client, keys).submit([call])
        finally:
            await client.aclose()

    before = served.worker_stats().get("gateway_aborted", 0)
    with served.hold:
        asyncio.run(submit())
        wait_for(lambda: _aborted(served, before), 15, "the worker to abort the call of a gateway that is gone", 0.1)
    assert served.chat("after-orphan", max_tokens=1).usage.completion_tokens == 1  # the slot is free again


@pytest.mark.parametrize("restarted", [False, True], ids=["silent", "restarted-under-its-name"])
def test_a_call_whose_worker_dies_fails_with_503_before_the_call_timeout(infra, tiny_model_cfg, restarted):
    # A worker that dies holding a call never answers it: the gateway knows which worker holds it
    # (the worker says so when it queues the call) and fails it once that worker has been silent
    # for buffer.lease_timeout_s (2 s here), or at once when a process of its name started after
    # it queued the call (rlhf-run restarts a crashed worker-<i> as worker-<i>), not after
    # gateway.call_timeout_s (120 s)
    from servers import wait_for
    from worker_helpers import WorkerThread

    settings = ("buffer.lease_timeout_s=2", "buffer.heartbeat_interval_s=0.5")
    run_id = f"gw-dead-{restarted}".lower()
    with _run(infra, tiny_model_cfg, run_id, "w-dead", lambda engine, _: Hold(engine), *settings) as run, run[4]:
        cfg, _, wt, url, _ = run
        assert cfg.gateway.call_timeout_s >= 100
        out: dict[str, Any] = {}

        def call() -> None:
            out["response"] = httpx.post(f"{url}/chat/completions", content=_chat_body(), timeout=60,
                                         headers={"X-Session-Id": "orphan"})

        caller = threading.Thread(target=call, daemon=True)
        caller.start()
        wait_for(lambda: len(wt.worker.gateway) == 1, 30, "the worker to hold the call", 0.05)
        t0 = time.monotonic()
        wt.worker.leases.stop()  # the worker goes silent, as a killed one does; its engine holds the call
        successor = WorkerThread(cfg, "w-dead").start() if restarted else None  # heartbeats under the same name
        try:
            caller.join(30)
            r = out["response"]
            assert r.status_code == 503 and r.headers["retry-after"] == "2", r.text
            assert r.json()["error"]["code"] == "worker_stopped" and "w-dead" in r.json()["error"]["message"]
            assert time.monotonic() - t0 < 15
            stats = httpx.get(f"{url}/rl/stats", timeout=10).json()
            assert (stats["calls_failed"], stats["sessions_open"]) == (1, 0)  # the session is as before the call: none
        finally:
            if successor is not None:
                successor.stop()


def test_the_cancellation_marks_of_calls_no_worker_will_end_do_not_pile_up(infra, tiny_model_cfg):
    # A worker that dies holding calls never ends them, so nothing takes their marks out of
    # P gw:cancel (nor of a call whose cancellation lands after its final chunk): the hash grew
    # by one field per such call for the whole run. A mark older than gateway.call_timeout_s is
    # for a call nobody waits for any more, and goes.
    from gateway.server import GatewayServer
    from servers import wait_for
    from worker_helpers import FakeLearner

    cfg = _cfg(infra, tiny_model_cfg, "gw-cancel-marks", "gateway.call_timeout_s=2")
    learner = FakeLearner(cfg)
    server = GatewayServer(cfg)
    url = server.start()
    redis, keys, n = learner.buffer.redis, learner.buffer.keys, 4
    try:
        learner.buffer.worker.heartbeat("w-ghost")  # a worker that takes the calls and dies with them
        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            codes = list(pool.map(lambda i: httpx.post(f"{url}/chat/completions", content=_chat_body(), timeout=30,
                                                       headers={"X-Session-Id": f"ghost-{i}"}).status_code, range(n)))
        redis.delete(keys.gw_calls)  # ... taken by the worker that died
        assert codes == [503] * n
        wait_for(lambda: redis.hlen(keys.gw_cancel) == n, 5, "the cancellations of the timed-out calls", 0.02)
        wait_for(lambda: redis.hlen(keys.gw_cancel) == 0, 10, "the marks of calls nobody waits for to go", 0.1)
    finally:
        server.stop()
        learner.close()


class Stuck:
    """While blocked, the worker's main thread stops inside the engine's next step (a long
    decoding step, a long prefill): what its taker thread fetches meanwhile waits in its inbox."""

    def __init__(self, engine: Any) -> None:
        self.gate, self.inside = threading.Event(), threading.Event()
        self.gate.set()
        self._step = engine.step
        engine.step = self.step

    def step(self) -> list:
        if not self.gate.is_set():
            self.inside.set()
            self.gate.wait()
        return self._step()


def test_a_call_still_in_a_dead_workers_inbox_fails_with_503_before_the_call_timeout(infra, tiny_model_cfg):
    # A worker's taker thread fetches calls while its main thread is in a decoding step; they wait
    # in its inbox until the step ends. The gateway learns which worker holds a call as it is
    # fetched, so a worker that dies then takes the call with it and the gateway fails it once
    # the worker is silent for buffer.lease_timeout_s (2 s), not after gateway.call_timeout_s
    from servers import wait_for

    settings = ("buffer.lease_timeout_s=2", "buffer.heartbeat_interval_s=0.5", "gateway.call_timeout_s=60")
    with _run(infra, tiny_model_cfg, "gw-dead-inbox", "w-inbox", lambda engine, _: Stuck(engine), *settings) as run:
        cfg, _, wt, url, stuck = run
        out: dict[str, Any] = {}

        def call(name: str) -> None:
            out[name] = httpx.post(f"{url}/chat/completions", content=_chat_body(max_tokens=8), timeout=60,
                                   headers={"X-Session-Id": name})

        stuck.gate.clear()
        callers = [threading.Thread(target=call, args=("running",), daemon=True)]
        callers[0].start()
        stuck.inside.wait(30)  # the first call is in the engine, the main thread inside a step
        callers.append(threading.Thread(target=call, args=("fetched",), daemon=True))
        callers[1].start()
        channel = wt.worker.gateway.channel
        wait_for(lambda: len(channel.inbox) == 1, 30, "the taker thread to fetch the second call", 0.05)
        t0 = time.monotonic()
        wt.worker.leases.stop()  # the worker goes silent, as a killed one does
        try:
            for c in callers:
                c.join(30)
            for name in ("running", "fetched"):
                r = out[name]
                assert r.status_code == 503 and r.json()["error"]["code"] == "worker_stopped", (name, r.text)
            assert time.monotonic() - t0 < 15
        finally:
            stuck.gate.set()


@pytest.mark.parametrize("stream,fault", [(False, "restarted"), (True, "restarted"), (False, "cut"), (False, "down")],
                         ids=["plain-redis-restarted", "streamed-redis-restarted", "plain-channel-cut", "plain-redis-down"])
def test_a_call_running_when_the_channel_from_the_workers_drops_fails_with_503_at_once_and_the_next_is_served(
        infra, tiny_model_cfg, tmp_path, stream, fault):
    # The workers' chunks reach the gateway over Redis pub/sub, which keeps nothing for a
    # subscriber that is away: a chunk published while the gateway's channel was down is lost,
    # and a call whose final chunk was lost would wait for gateway.call_timeout_s (60 s here).
    # Every call running when the channel drops or reconnects fails at once with a retryable 503
    # (its session as before the call), the worker aborts it (the cancellation is sent once Redis
    # is back), and the next call is served. Redis restarted (SIGKILL, then its append-only file),
    # only the channel's connection cut (redis-py reconnects it within the read that failed), or
    # Redis down for a while: meanwhile calls and /health answer 503 (never 500), and the
    # streamed call's failure is an error event
    import signal

    import redis as redis_py

    from servers import RedisServer, wait_for

    redis = RedisServer(tmp_path / "redis").start()  # its own Redis (append-only): the test kills it
    try:
        with _run((redis, infra[1]), tiny_model_cfg, f"gw-redis-{stream}-{fault}".lower(), "w-redis",
                  lambda engine, _: Hold(engine), "gateway.call_timeout_s=60") as run:
            cfg, learner, wt, url, hold = run
            out: dict[str, Any] = {}

            def call() -> None:
                with httpx.Client(timeout=60) as client:
                    with client.stream("POST", f"{url}/chat/completions", content=_chat_body(stream=stream),
                                       headers={"X-Session-Id": "across"}) as r:
                        out["response"], out["body"] = r, r.read().decode()

            with hold:
                caller = threading.Thread(target=call, daemon=True)
                caller.start()
                wait_for(lambda: len(wt.worker.gateway) == 1, 30, "the worker to hold the call", 0.05)
                t0 = time.monotonic()
                if fault == "cut":
                    with redis_py.Redis.from_url(redis.url) as admin:
                        assert admin.client_kill_filter(_type="pubsub") == 1
                elif fault == "restarted":
                    redis.restart()  # SIGKILL, then the same port and append-only file
                else:
                    redis.stop(signal.SIGKILL)
                caller.join(30)
                took = time.monotonic() - t0
                if fault == "down":
                    time.sleep(1.1)  # past the gateway's 1 s cache of the live workers: it would ask Redis
                    for stream_it in (False, True):
                        r = httpx.post(f"{url}/chat/completions", content=_chat_body(stream=stream_it), timeout=30,
                                       headers={"X-Session-Id": "meanwhile"})
                        assert r.status_code == 503 and r.headers["retry-after"] == "2", r.text
                        assert r.json()["error"]["code"] == "channel_lost", r.text
                    r = httpx.get(url.removesuffix("/v1") + "/health", timeout=30)
                    assert r.status_code == 503 and r.json()["status"] == "channel_lost", r.text
                    redis.start(port=redis.port)
                # still held: the call ends only by its cancellation, which may have met Redis down
                wait_for(lambda: len(wt.worker.gateway) == 0, 30, "the worker to abort the call", 0.1)
            r, body = out["response"], out["body"]
            if stream:  # the stream had begun (200): the error is its last event
                assert r.status_code == 200 and '"code": "channel_lost"' in body, body
            else:
                assert r.status_code == 503 and r.headers["retry-after"] == "2", body
                assert json.loads(body)["error"]["code"] == "channel_lost", body
            assert took < 15, took
            assert wt.worker.gateway.stats["gateway_aborted"] == 1
            stats = httpx.get(f"{url}/rl/stats", timeout=10).json()
            assert (stats["calls_failed"], stats["calls_aborted"], stats["sessions_open"]) == (1, 1, 0), stats
            # by code (rlhf-monitor shows them): the call that ran, and the two refused while Redis was down
            assert stats["errors_channel_lost"] == (3 if fault == "down" else 1), stats
            health = url.removesuffix("/v1") + "/health"  # 503 channel_lost until the gateway is subscribed again
            wait_for(lambda: httpx.get(health, timeout=10).status_code == 200, 30, "the gateway's channel back", 0.1)
            r = httpx.post(f"{url}/chat/completions", content=_chat_body(), headers={"X-Session-Id": "after"}, timeout=30)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1, r.text
            assert wt.error is None, wt.error
    finally:
        redis.stop()


def test_a_redis_that_stops_answering_gets_503s_not_hangs_and_the_gateway_goes_on_after(infra, tiny_model_cfg, tmp_path):
    # Redis stopped (SIGSTOP: a hung server, or a network path that drops packets): a command
    # fails within the gateway's Redis socket timeout (at most gateway.call_timeout_s, 4 s here),
    # so the call running then, a new call and /health answer 503, then all goes on once it answers.
    # The running call answers within one socket timeout of the stop (its next look at Redis, or
    # its deadline) plus its 1 s wait: once its cancellation, sent to the silent Redis too, held
    # its answer for a second timeout (8-9 s)
    import os
    import signal

    from servers import RedisServer, wait_for

    redis = RedisServer(tmp_path / "redis", appendonly=False).start()  # its own Redis: the test stops it
    try:
        with _run((redis, infra[1]), tiny_model_cfg, "gw-silent", "w-silent", lambda engine, _: Hold(engine),
                  "gateway.call_timeout_s=4") as run:
            cfg, learner, wt, url, hold = run
            health = url.removesuffix("/v1") + "/health"
            out: dict[str, httpx.Response] = {}

            def running() -> None:
                out["running"] = httpx.post(f"{url}/chat/completions", content=_chat_body(), timeout=30)
                out["answered_at"] = time.monotonic()

            with hold:
                caller = threading.Thread(target=running, daemon=True)
                caller.start()
                wait_for(lambda: len(wt.worker.gateway) == 1, 30, "the worker to hold the call", 0.05)
                os.kill(redis.pid, signal.SIGSTOP)
                try:
                    t0 = time.monotonic()
                    new = httpx.post(f"{url}/chat/completions", content=_chat_body(), timeout=30)
                    probe = httpx.get(health, timeout=30)
                    caller.join(30)
                    took = time.monotonic() - t0
                finally:
                    os.kill(redis.pid, signal.SIGCONT)
                for r in (new, out["running"]):
                    assert r.status_code == 503 and r.headers["retry-after"] == "2", r.text
                    assert r.json()["error"]["code"] in ("unavailable", "timeout"), r.text
                assert new.json()["error"]["code"] == "unavailable", new.text
                assert probe.status_code == 503 and probe.json()["status"] == "unavailable", probe.text
                assert took < 15, took
                assert out["answered_at"] - t0 < 7, out["answered_at"] - t0  # about 5 s
            wait_for(lambda: httpx.get(health, timeout=10).status_code == 200, 30, "the gateway's health back", 0.1)
            r = httpx.post(f"{url}/chat/completions", content=_chat_body(), timeout=30)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1, r.text
            assert wt.error is None, wt.error
    finally:
        redis.stop()


def test_a_worker_stopping_aborts_its_running_calls_and_counts_what_they_sampled(infra, tiny_model_cfg):
    # A call two engine steps into its reply when the worker stops: aborted, and what it sampled
    # counts as generated (the worker's tokens equal its calls' tokens, as in the run's summary)
    from servers import wait_for

    calls: list[threading.Thread] = []
    with _run(infra, tiny_model_cfg, "gw-stop", "w-stop", lambda engine, _: Hold(engine)) as run, run[4]:
        _, _, wt, url, hold = run
        gw = wt.worker.gateway
        for _ in range(5):  # the random model may end a reply within its first two steps
            done = gw.stats["gateway_done"]
            hold.let_through = 2  # prefill (the first token), one decoding step (the second)
            call = threading.Thread(target=httpx.post, args=(f"{url}/chat/completions",),
                                    kwargs=dict(content=_chat_body(max_tokens=32), timeout=60), daemon=True)
            call.start()
            calls.append(call)
            wait_for(lambda done=done: hold.let_through == 0 or gw.stats["gateway_done"] > done, 30, "the call's first two steps")
            if wait_for(lambda done=done: (len(gw) == 1 and "held") or (gw.stats["gateway_done"] > done and "done"), 10,
                        "the call held or done") == "held":
                break
        else:
            pytest.fail("5 replies ended within two engine steps")
        wt.stop()
    for call in calls:
        call.join(30)
    assert wt.error is None, wt.error
    assert gw.stats["gateway_aborted"] == 1 and gw.stats["gateway_tokens"] >= 2
    assert wt.stats.tokens == gw.stats["gateway_tokens"]


def test_a_session_takes_one_call_at_a_time(served):
    from servers import wait_for

    with served.hold:
        stream = served.chat("busy", messages=[{"role": "user", "content": "a"}], max_tokens=4, stream=True)
        assert next(iter(stream)).choices[0].delta.role == "assistant"
        wait_for(lambda: served.stats()["calls_running"] == 1, 10, "the call to be running", 0.1)
        with pytest.raises(openai.ConflictError) as info:
            served.chat("busy", messages=[{"role": "user", "content": "a"}], max_tokens=1)
        assert "has a call running" in info.value.message
        r = served.reward("busy", 1.0)
        assert r.status_code == 409 and "call running" in r.json()["error"]["message"]
    # let go: the call finishes, then the session is the agent's again
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    served.chat("busy", messages=[{"role": "user", "content": "a"}, {"role": "assistant", "content": text},
                                  {"role": "user", "content": "b"}], max_tokens=1)
    assert served.reward("busy", 1.0).status_code == 200


def test_two_calls_of_one_session_sent_together_one_is_served_the_other_gets_409(infra, tiny_model_cfg):
    # A call may wait for Redis before it starts (the live workers, read again once a second); a
    # second call of its session arriving meanwhile must not pass the session's busy check too:
    # one is served, the other refused, and the session holds one turn
    from servers import wait_for

    with _serve(infra, tiny_model_cfg, "gw-together", "w-together", lambda engine, _: Hold(engine)) as run:
        server, hold = run[3], run[4]
        url = server.url
        gw, asking, answer = server.gateway, [], threading.Event()
        read = gw.router.workers.live

        async def live_once_both_ask() -> dict[str, float]:  # Redis's answer comes once both calls wait for it
            asking.append(1)
            await asyncio.to_thread(answer.wait, 30)
            return await read()

        gw.router.workers.live = live_once_both_ask
        answers: list[httpx.Response] = []

        def call() -> None:
            answers.append(httpx.post(f"{url}/chat/completions", content=_chat_body(max_tokens=2), timeout=30,
                                      headers={"X-Session-Id": "together"}))

        calls = [threading.Thread(target=call, daemon=True) for _ in range(2)]
        try:
            with hold:  # the served call stays in flight while the other is answered
                for t in calls:
                    t.start()
                wait_for(lambda: len(asking) == 2, 30, "both calls to wait for Redis", 0.01)
                answer.set()
                wait_for(lambda: answers, 10, "the second call's answer while the first runs", 0.02)
                refused = answers[0]
                assert refused.status_code == 409 and "has a call running" in refused.json()["error"]["message"], refused.text
            for t in calls:
                t.join(30)
            assert [r.status_code for r in answers] == [409, 200], [r.text for r in answers]
            assert gw.sessions.sessions["together"].turns == 1
            assert httpx.get(f"{url}/rl/stats", timeout=10).json()["sessions_restarted"] == 0
        finally:
            answer.set()


def test_the_stats_say_where_a_calls_time_went(served):
    # A call held in the worker's engine for 0.5 s after it got there: the stats' engine phase
    # holds those 0.5 s, no phase is negative, and the phases add up to no more than the client
    # waited (they run from the request's arrival to the worker's answer reaching the gateway).
    from servers import wait_for

    before = served.stats()["call_phases_s"]
    out: dict[str, Any] = {}

    def call() -> None:
        t0 = time.monotonic()
        served.chat("timed", messages=[{"role": "user", "content": "t"}], max_tokens=2)
        out["waited_s"] = time.monotonic() - t0

    with served.hold:
        client = threading.Thread(target=call, daemon=True)
        client.start()
        wait_for(lambda: len(served.worker.worker.gateway) == 1, 15, "the worker to queue the call in its engine", 0.01)
        time.sleep(0.5)
    client.join(30)
    after = served.stats()["call_phases_s"]
    phases = {k: after[k] - before[k] for k in ("gateway_in_s", "to_worker_s", "engine_s", "to_gateway_s")}
    assert after["calls"] == before["calls"] + 1
    assert all(v >= 0 for v in phases.values()), phases
    assert phases["engine_s"] >= 0.5 and sum(phases.values()) <= out["waited_s"], (phases, out)


def _gateway_process(cfg_overrides: list[str], out: Any) -> tuple[Any, str]:
    """``rlhf-gateway`` in its own process (so it can be SIGKILLed), once it serves: (process, base url)."""
    import subprocess
    import sys

    from servers import wait_for

    out.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", *cfg_overrides, f"run.output_dir={out}",
                             f"hydra.run.dir={out / 'hydra'}", "hydra.output_subdir=null"],
                            stdout=subprocess.DEVNULL, stderr=(out / "gateway.log").open("wb"))

    def serving() -> str | None:
        assert proc.poll() is None, f"the gateway exited with {proc.returncode}: {(out / 'gateway.log').read_text()[-2000:]}"
        return json.loads((out / "gateway.json").read_text())["url"] if (out / "gateway.json").exists() else None

    return proc, wait_for(serving, 120, "the gateway to serve", 0.1)


@pytest.mark.timeout(300)  # two gateway processes start (each imports torch and loads the tokenizer)
def test_a_gateway_killed_with_a_group_half_rewarded_loses_no_reward(infra, tiny_model_cfg, tmp_path):
    """A reward the gateway acknowledged is kept in the buffer: SIGKILL the gateway while its
    group waits for more sessions, start another, and the group is completed there and appended
    once, with the first gateway's session in it (whose reward cannot be posted twice)."""
    import signal

    from worker_helpers import FakeLearner, WorkerThread, overrides

    redis, ws = infra
    settings = overrides(redis.url, "gw-crash", ws, tiny_model_cfg, extra=[*SETTINGS])
    cfg = _cfg(infra, tiny_model_cfg, "gw-crash")
    learner = FakeLearner(cfg)
    learner.publish(VERSION)
    wt = WorkerThread(cfg, "w-crash")
    wt.start()
    procs = []
    try:
        def session(url: str, sid: str) -> None:
            with openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60) as client:
                client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": sid}], max_tokens=4,
                                               extra_headers={"X-Session-Id": sid, "X-Group-Id": "crash"})

        proc, url = _gateway_process(settings, tmp_path / "first")
        procs.append(proc)
        session(url, "c/0")
        session(url, "c/1")  # never rewarded: lost with the gateway (nothing is trained from it)
        r = httpx.post(f"{url}/rl/sessions/c/0/reward", json={"reward": 0.5}, timeout=10)
        assert r.status_code == 200 and r.json()["status"] == "waiting_for_group", r.text
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        proc, url = _gateway_process(settings, tmp_path / "second")
        procs.append(proc)
        stats = httpx.get(f"{url}/rl/stats", timeout=10).json()
        assert (stats["rewards_recovered"], stats["groups_waiting"]) == (1, 1)
        r = httpx.post(f"{url}/rl/sessions/c/0/reward", json={"reward": 0.5}, timeout=10)
        assert r.status_code == 409 and "rewarded already" in r.json()["error"]["message"]
        assert httpx.post(f"{url}/rl/sessions/c/1/reward", json={"reward": 1.0}, timeout=10).status_code == 404
        session(url, "c/2")
        r = httpx.post(f"{url}/rl/sessions/c/2/reward", json={"reward": 1.0}, timeout=10)
        assert r.status_code == 200 and r.json()["status"] == "appended" and r.json()["samples"] == 2, r.text
        batch = learner.buffer.learner.read_batch("learner", VERSION, GROUP, timeout_s=10)
        assert batch is not None and batch.group_sizes == [GROUP]
        assert [(s.metadata["session"], s.reward) for s in batch.samples] == [("c/0", 0.5), ("c/2", 1.0)]
        assert learner.buffer.learner.read_batch("learner", VERSION, GROUP, timeout_s=0.5) is None  # once
        assert learner.buffer.gateway.rewarded_kept() == {}
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(15)
        wt.worker.request_stop()
        wt.worker.request_stop()
        wt.thread.join(15)
        learner.close()
    assert wt.error is None, wt.error


# ---------------------------------------------------------------------------------------------- refusals


def _raw(served: Served, path: str, content: bytes | None = None, **kwargs: Any) -> httpx.Response:
    return httpx.post(f"{served.url}{path}", content=content, timeout=10, **kwargs)


def _chat_body(**change: Any) -> bytes:
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1, **change}).encode()


BAD = {
    "malformed JSON": ("/chat/completions", b'{"model": "tiny", "messages": [', 400, "invalid_json"),
    "not an object": ("/chat/completions", b"[1, 2]", 400, "invalid_json"),
    "unknown model": ("/chat/completions", _chat_body(model="gpt-4o"), 400, "model_not_found"),
    "prompt over the context": ("/chat/completions", _chat_body(messages=[{"role": "user", "content": "y" * CONTEXT}]),
                                400, "context_length_exceeded"),
    "completion prompt over the context": ("/completions", json.dumps({"model": MODEL, "prompt": "z" * CONTEXT}).encode(),
                                           400, "context_length_exceeded"),
    "token ids out of the vocabulary": ("/completions", json.dumps({"model": MODEL, "prompt": [1, 10_000]}).encode(),
                                        400, "invalid_value"),
    "n over the cap": ("/chat/completions", _chat_body(n=3), 400, "over_cap"),
    "max_tokens over the cap": ("/chat/completions", _chat_body(max_tokens=33), 400, "over_cap"),
    "body over max_request_bytes": ("/chat/completions", _chat_body(messages=[{"role": "user", "content": "w" * 9000}]),
                                    413, "request_too_large"),
    "unknown session's reward": ("/rl/sessions/nobody/reward", b'{"reward": 1}', 404, "session"),
    "reward not a number": ("/rl/sessions/nobody/reward", b'{"reward": "high"}', 400, "invalid_value"),
    "reward an integer too large for a float": ("/rl/sessions/nobody/reward", b'{"reward": 1' + b"0" * 400 + b"}",
                                                400, "invalid_value"),
    "reward component too large for a float": ("/rl/sessions/nobody/reward", b'{"reward": {"a": 1' + b"0" * 400 + b"}}",
                                               400, "invalid_value"),
    "reward components summing past a float": ("/rl/sessions/nobody/reward", b'{"reward": {"a": 1e308, "b": 1e308}}',
                                               400, "invalid_value"),
    "integer of more digits than JSON is read with": ("/rl/sessions/nobody/reward", b'{"reward": 1' + b"0" * 5000 + b"}",
                                                      400, "invalid_json"),
    # (under the cap of 8192 bytes; Python's JSON reader raises RecursionError past ~1000 levels)
    "JSON nested deeper than Python reads": ("/chat/completions", b"[" * 8000, 400, "invalid_json"),
    "a reward nested deeper than Python reads": ("/rl/sessions/nobody/reward", b'{"reward": ' + b"[" * 8000, 400,
                                                 "invalid_json"),
    "temperature too large for a float": ("/chat/completions", _chat_body(temperature=10 ** 400), 400, "invalid_value"),
    "tool_calls not a list": ("/chat/completions", _chat_body(messages=[
        {"role": "assistant", "content": "x", "tool_calls": 5}, {"role": "user", "content": "y"}]), 400, "invalid_value"),
    "a tool call's function not an object": ("/chat/completions", _chat_body(messages=[
        {"role": "assistant", "content": "x", "tool_calls": [{"function": "add"}]}, {"role": "user", "content": "y"}]),
        400, "invalid_value"),
    "unknown endpoint": ("/embeddings", b"{}", 404, None),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_requests_get_the_openai_error_shape_and_the_gateway_stays_up(served, case):
    path, body, status, code = BAD[case]
    r = _raw(served, path, body, headers={"Content-Type": "application/json", "X-Session-Id": f"bad-{case}"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "code", "param"} and err["message"] and err["type"]
    assert err["code"] == code
    # the gateway goes on, and a refused first call leaves no session behind
    reply = served.chat(f"bad-{case}", max_tokens=1)
    assert reply.usage.completion_tokens == 1


def _connect(served: Served) -> socket.socket:
    url = httpx.URL(served.url)
    sock = socket.create_connection((url.host, url.port), timeout=10)
    return sock


def test_a_request_head_over_its_cap_is_refused_before_it_is_all_read(served):
    # Once: httptools buffers a request's headers without a limit, before any key is checked:
    # one connection sending a 200 MB header took the gateway from 583 to 829 MB
    with contextlib.closing(_connect(served)) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Pad: ")
        with contextlib.suppress(OSError):  # the gateway may close the connection while this is sent
            for _ in range(16):
                sock.sendall(b"a" * 64 * 1024)
        reply = sock.recv(1024)
    assert reply.startswith(b"HTTP/1.1 431 ") and b"the request line and headers" in reply, reply
    assert served.chat(max_tokens=1).usage.completion_tokens == 1  # the gateway goes on


@pytest.mark.parametrize("pieces", [1, 70])
def test_a_request_head_over_its_cap_is_refused_in_one_write_as_in_many(served, pieces):
    # Once: only the reads that left a head incomplete were counted, so a 70 KB header sent in one
    # write (the read that completes the head) was served, and in 1 KB writes refused
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 70_000 + b"\r\n\r\n"
    size = -(-len(head) // pieces)
    with contextlib.closing(_connect(served)) as sock:
        with contextlib.suppress(OSError):  # the gateway may close the connection while this is sent
            for i in range(0, len(head), size):
                sock.sendall(head[i:i + size])
        reply = sock.recv(1024)
    assert reply.startswith(b"HTTP/1.1 431 "), reply
    # a head under the cap is served, and a body sent with it in one write is not counted as head
    body = json.dumps({"reward": 1.0, "pad": "b" * 6_000}).encode()
    with contextlib.closing(_connect(served)) as sock:
        sock.sendall(b"POST /v1/rl/sessions/nobody/reward HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"X-Pad: " + b"a" * 60_000 + b"\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        reply = sock.recv(1024)
    assert reply.startswith(b"HTTP/1.1 404 ") and b"no session 'nobody'" in reply, reply


def test_a_request_head_that_does_not_arrive_in_time_is_answered_408(served, monkeypatch):
    # Once: a connection that sent its headers a byte at a time, or nothing, was held for good
    # (uvicorn sets no limit; the key is checked after the headers): enough of them use up the
    # gateway's file descriptors
    from gateway import server

    monkeypatch.setattr(server, "HEAD_TIMEOUT_S", 0.5)
    with contextlib.closing(_connect(served)) as silent, contextlib.closing(_connect(served)) as slow:
        slow.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        t0 = time.monotonic()
        for sock in (silent, slow):
            reply = sock.recv(1024)
            assert reply.startswith(b"HTTP/1.1 408 ") and b"took over 0.5 s" in reply, reply
            assert sock.recv(1024) == b""  # closed
        assert time.monotonic() - t0 < 5
    # a client that sends its request at once is served on the same settings, twice on one connection
    with contextlib.closing(_connect(served)) as sock:
        for _ in range(2):
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert sock.recv(4096).startswith(b"HTTP/1.1 200 ")
            time.sleep(0.7)  # longer than the head's limit, between requests: only a head is timed


def test_a_client_that_goes_away_while_sending_its_body_is_counted_not_a_server_error(served, caplog):
    # Once: starlette's ClientDisconnect went up through the gateway: a traceback in its log
    before = served.stats().get("errors_client_gone", 0)
    with caplog.at_level(logging.ERROR), contextlib.closing(_connect(served)) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        time.sleep(0.2)
    wait = time.monotonic() + 10
    while served.stats().get("errors_client_gone", 0) == before:
        assert time.monotonic() < wait, f"not counted; the log says: {caplog.text}"
        time.sleep(0.05)
    assert "Exception in ASGI application" not in caplog.text


def test_the_openai_client_raises_its_own_errors_for_refusals(served):
    with pytest.raises(openai.BadRequestError) as info:
        served.chat(model="gpt-4o")
    assert info.value.status_code == 400 and info.value.code == "model_not_found" and info.value.param == "model"
    with pytest.raises(openai.BadRequestError) as info:
        served.chat(n=3)
    assert info.value.code == "over_cap" and info.value.param == "n"
    with pytest.raises(openai.BadRequestError) as info:
        served.chat("long", messages=[{"role": "user", "content": "y" * CONTEXT}])
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        served.client.post("/rl/sessions/nobody/reward", cast_to=httpx.Response, body={"reward": 1.0})
    models = served.client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_reward_components_are_a_bounded_set_of_names(served):
    # Once: one reward of 1 MB could carry 60,000 components, each a learner metric reward/<name>
    # (and a Prometheus gauge for the rest of the run), and every reward could bring new ones
    served.chat("parts", "g-parts", max_tokens=1)
    many = served.reward("parts", {f"c{i}": 0.0 for i in range(65)})
    assert many.status_code == 400 and many.json()["error"]["param"] == "reward", many.text
    assert "64 distinct component names" in many.json()["error"]["message"]
    long = served.reward("parts", {"x" * 65: 1.0})
    assert long.status_code == 400 and "1-64 characters" in long.json()["error"]["message"], long.text
    # a component "mean" was written over the learner's own reward/mean (the batch's reward)
    taken = served.reward("parts", {"mean": 1.0, "correct": 1.0})
    assert taken.status_code == 400 and "'mean' are the learner's own reward/<stat>" in taken.json()["error"]["message"]
    ok = served.reward("parts", {"correct": 1.0, "format": -0.25})
    assert ok.status_code == 200 and ok.json()["reward"] == 0.75, ok.text
    served.chat("parts-2", "g-parts", max_tokens=1)
    assert served.reward("parts-2", {"correct": 0.0}).status_code == 200
    assert [s.reward_components for s in served.group("g-parts")] == [{"correct": 1.0, "format": -0.25}, {"correct": 0.0}]


def test_a_group_id_is_at_most_200_characters_in_the_header_as_in_the_reward(served):
    # Once: the header's was not checked (60,000 characters went into the group's sample ids)
    with pytest.raises(openai.BadRequestError) as info:
        served.chat("long-group", "g" * 201, max_tokens=1)
    assert info.value.param == "X-Group-Id" and "at most 200 characters" in info.value.message


def test_a_session_is_rewarded_once(served):
    served.chat("once", "g-once", max_tokens=1)
    assert served.reward("once", 1.0).status_code == 200
    again = served.reward("once", 1.0)
    assert again.status_code == 409 and again.json()["error"]["type"] == "conflict_error"
    # a call on a rewarded session is refused too: the agent must start another
    with pytest.raises(openai.ConflictError):
        served.chat("once", max_tokens=1)
    # its group completes with another session
    served.chat("once-2", "g-once", max_tokens=1)
    assert served.reward("once-2", 0.0).json()["status"] == "appended"
    assert {s.metadata["session"] for s in served.group("g-once")} == {"once", "once-2"}


def test_with_filter_groups_a_group_whose_rewards_are_all_equal_is_filtered_as_the_runs_own_are(infra, tiny_model_cfg):
    """algo.filter_groups (DAPO's dynamic sampling) holds for agents' groups as for the run's own:
    a group whose rewards are all equal teaches nothing, so it is not appended (its kept rewards
    are deleted, the buffer counts it per reason) and takes no batch slot."""
    with _run(infra, tiny_model_cfg, "gw-filter", "wf", lambda engine, tokenizer: None, "algo.filter_groups=true") as run:
        cfg, learner, _, url, _ = run
        with openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60) as client:
            for sid in ("same/0", "same/1", "mixed/0", "mixed/1"):
                client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                               extra_headers={"X-Session-Id": sid, "X-Group-Id": sid.split("/")[0]})

        def reward(sid: str, value: float) -> dict:
            r = httpx.post(f"{url}/rl/sessions/{sid}/reward", json={"reward": value}, timeout=10)
            assert r.status_code == 200, r.text
            return r.json()

        assert reward("same/0", 1.0)["status"] == "waiting_for_group"
        assert reward("same/1", 1.0) == {"session": "same/1", "group": "same", "reward": 1.0, "status": "filtered",
                                         "samples": 0}
        assert reward("mixed/0", 1.0)["status"] == "waiting_for_group"
        assert reward("mixed/1", 0.0)["status"] == "appended"
        stats = httpx.get(f"{url}/rl/stats", timeout=10).json()
        assert (stats["groups_filtered"], stats["samples_filtered"], stats["groups_appended"]) == (1, 2, 1)
        counters = learner.buffer.monitor.metrics()["counters"]
        assert (counters["groups_filtered_zero_variance"], counters["groups_external"]) == (1, 1)
        assert learner.buffer.gateway.rewarded_kept() == {}  # the filtered group's kept rewards went with it
        batch = learner.buffer.learner.read_batch("learner", VERSION, GROUP, timeout_s=5.0)
        assert [s.metadata["session"] for s in batch.samples] == ["mixed/0", "mixed/1"]
        assert learner.buffer.learner.read_batch("learner", VERSION, GROUP, timeout_s=0.2) is None


def test_a_second_gateway_of_a_live_run_is_refused_and_takes_nothing_of_it(served, infra, tiny_model_cfg, tmp_path):
    # Once: a second rlhf-gateway started by hand against a live run took up the first one's kept
    # rewards (its groups then filled in two places) and wrote its own gateway.json over the first's
    from gateway.server import GatewayServer
    from rlhf_core.errors import UserError

    served.chat("two/a0", "two", max_tokens=1)
    assert served.reward("two/a0", 1.0).json()["status"] == "waiting_for_group"
    with pytest.raises(UserError) as info:
        GatewayServer(_cfg(infra, tiny_model_cfg, "gw-tests"), tmp_path)  # the same run
    message = str(info.value)
    assert message.startswith("gateway gateway-") and "serves run gw-tests" in message and "\n" not in message
    assert "one gateway per run; stop that one first (one that died frees the run within 5 s)" in message
    assert not (tmp_path / "gateway.json").exists() and served.stats()["rewards_recovered"] == 0
    served.chat("two/a1", "two", max_tokens=1)
    assert served.reward("two/a1", 0.0).json()["status"] == "appended"
    assert [s.metadata["session"] for s in served.group("two")] == ["two/a0", "two/a1"]
    assert served.learner.buffer.gateway.rewarded_kept() == {}


def test_a_reward_the_buffer_cannot_keep_is_refused_with_503_and_may_be_posted_again(infra, tiny_model_cfg):
    from buffer.connection import BufferUnavailable

    with _serve(infra, tiny_model_cfg, "gw-unkept", "w-unkept", lambda engine, _: None) as (_, learner, _, server, _):
        url, keep, failures = server.url, server.gateway.buffer.keep_rewarded, []

        def failing(*args):
            if not failures:  # stored, but the reply never came: the gateway cannot know it was kept
                failures.append(keep(*args))
                raise BufferUnavailable("redis is restarting")
            return keep(*args)

        server.gateway.buffer.keep_rewarded = failing
        with openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60) as client:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                           extra_headers={"X-Session-Id": "unkept", "X-Group-Id": "unkept"})
        r = httpx.post(f"{url}/rl/sessions/unkept/reward", json={"reward": 1.0}, timeout=10)
        assert r.status_code == 503 and r.headers["retry-after"] == "2" and "post it again" in r.json()["error"]["message"]
        assert httpx.get(f"{url}/rl/stats", timeout=10).json()["sessions_rewarded"] == 0
        r = httpx.post(f"{url}/rl/sessions/unkept/reward", json={"reward": 1.0}, timeout=10)
        assert r.status_code == 200 and r.json()["status"] == "waiting_for_group", r.text
        assert len(failures) == 1
        kept = [Sample.decode(raw) for raw in learner.buffer.gateway.rewarded_kept().values()]
        assert [s.metadata["session"] for s in kept].count("unkept") == 1  # the second post overwrote the first


def test_a_call_redis_does_not_take_is_answered_503_not_500(infra, tiny_model_cfg):
    # Redis away for a moment before the gateway's channel noticed (the push of the call fails
    # after the client's retries): a retryable 503, as an error event once a stream has begun,
    # the session as before the call, no traceback
    import redis as redis_py

    async def refused(calls: Any) -> None:
        raise redis_py.exceptions.ConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")

    with _serve(infra, tiny_model_cfg, "gw-untaken", "w-untaken", lambda engine, _: None) as (_, _, _, server, _):
        url = server.url
        server.gateway.router.calls.submit = refused
        r = httpx.post(f"{url}/chat/completions", content=_chat_body(), headers={"X-Session-Id": "untaken"}, timeout=30)
        assert r.status_code == 503 and r.headers["retry-after"] == "2", r.text
        assert r.json()["error"]["code"] == "unavailable" and "retry" in r.json()["error"]["message"], r.text
        r = httpx.post(f"{url}/chat/completions", content=_chat_body(stream=True), headers={"X-Session-Id": "untaken"},
                       timeout=30)
        assert r.status_code == 200 and '"code": "unavailable"' in r.text and "[DONE]" not in r.text, r.text
        stats = httpx.get(f"{url}/rl/stats", timeout=10).json()
        assert (stats["calls_failed"], stats["sessions_open"], stats["errors_unavailable"]) == (2, 0, 2), stats


def test_health_and_stats(served):
    r = httpx.get(served.url.removesuffix("/v1") + "/health", timeout=10)
    assert r.status_code == 200 and r.json() == {"status": "ok", "workers": 1, "model": MODEL}
    stats = served.stats()
    assert stats["calls"] >= 1 and stats["calls_running"] == 0


def test_a_gateway_that_stops_publishes_its_last_counts(infra, tiny_model_cfg):
    # The run's summary takes the gateway's counts from what it last published, after the run's
    # processes stopped. It publishes every second and once more as it stops: a call and a reward
    # just before the stop are counted.
    from buffer import MonitorClient
    from rlhf_core import metric_names as M

    with _run(infra, tiny_model_cfg, "gw-last-counts", "w-last", lambda engine, tokenizer: None) as (cfg, _, _, url, _):
        with openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60) as client:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                           extra_headers={"X-Session-Id": "last"})
        assert httpx.post(f"{url}/rl/sessions/last/reward", json={"reward": 1.0}, timeout=10).status_code == 200
    buf = MonitorClient.connect(cfg.buffer.url, cfg.buffer.run_id, cfg.buffer)
    try:
        counts = buf.stats(M.GATEWAY_STATS)
    finally:
        buf.close()
    assert counts is not None and (counts["calls"], counts["sessions_rewarded"]) == (1, 1), counts


@pytest.fixture
def keyed(infra, tiny_model_cfg):
    """A gateway with API keys for a run that no worker serves."""
    from buffer import LearnerClient
    from gateway.server import GatewayServer

    cfg = _cfg(infra, tiny_model_cfg, "gw-no-worker", f"gateway.api_keys=[{KEY},{'j' * 16}]")
    with contextlib.closing(LearnerClient.connect(cfg.buffer.url, cfg.buffer.run_id, cfg.buffer)) as buf:
        buf.init_run(batch_size=4, group_size=GROUP, max_staleness=1, max_response_tokens=128, vocab_size=99)
        server = GatewayServer(cfg)
        try:
            yield server.start()
        finally:
            server.stop()


def test_keys_are_checked_and_a_run_without_workers_answers_503(keyed):
    url = keyed
    body = json.loads(_chat_body())
    for headers in ({}, {"Authorization": "Bearer wrong-key-of-some-length"}, {"Authorization": KEY},
                    {"Authorization": f"Basic {KEY}"}):
        r = httpx.post(f"{url}/chat/completions", json=body, headers=headers, timeout=10)
        assert r.status_code == 401, (headers, r.text)
        assert r.json()["error"]["type"] == "authentication_error" and r.json()["error"]["code"] == "invalid_api_key"
    for path in ("/models", "/rl/stats"):
        assert httpx.get(f"{url}{path}", timeout=10).status_code == 401
    with openai.OpenAI(base_url=url, api_key="not-the-key-at-all", max_retries=0) as wrong:
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()

    client = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=10)
    assert [m.id for m in client.models.list().data] == [MODEL]
    with openai.OpenAI(base_url=url, api_key="j" * 16, max_retries=0) as other:
        assert other.models.list().data[0].id == MODEL
    r = httpx.post(f"{url}/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    assert r.status_code == 503 and r.headers["retry-after"] == "2", r.text
    assert r.json()["error"]["code"] == "no_worker" and r.json()["error"]["type"] == "service_unavailable"
    with pytest.raises(openai.InternalServerError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    assert info.value.status_code == 503
    health = httpx.get(url.removesuffix("/v1") + "/health", timeout=10)  # health needs no key
    assert health.status_code == 503 and health.json()["status"] == "no_worker"
    stats = client.get("/rl/stats", cast_to=httpx.Response).json()
    assert stats["sessions_open"] == 0 and stats["calls"] == 0  # refused calls leave nothing behind
    client.close()
