"""rlhf-gateway without servers: the OpenAI request checks, sessions (token in, token out) with the
tiny tokenizer, the Redis records, the tool-call path of a reply and the worker's side of calls."""

from __future__ import annotations

import json
import time

import msgpack
import pytest

from buffer.gateway import KIND_CALL, KIND_CHUNK, CallChunk, GatewayCall
from buffer.keys import RunKeys
from gateway.openai_api import ApiError, normal_message, parse_chat, parse_completion, parse_json, parse_sampling
from gateway.sessions import PLAIN_TEMPLATE, SessionError, Sessions
from rlhf_core.config import Config
from rlhf_core.wire import WireError, encode_record

MODEL = "tiny"
CAPS = dict(max_tokens_cap=32, n_cap=4)


def chat(**body):
    return parse_chat({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **body}, MODEL, **CAPS)


def refused(fn, *args, **kwargs) -> ApiError:
    with pytest.raises(ApiError) as info:
        fn(*args, **kwargs)
    return info.value


# ---------------------------------------------------------------------------------------------- requests


def test_a_plain_chat_request_gets_the_defaults():
    req = chat(frequency_penalty=0, presence_penalty=0, seed=3, user="u1")  # fields clients send: ignored
    s = req.sampling
    assert (s.n, s.max_tokens, s.temperature, s.top_p, s.stop, s.stream, s.include_usage, s.logprobs) == \
        (1, None, 1.0, 1.0, [], False, False, False)
    assert req.user == "u1" and req.tools is None and req.messages == [{"role": "user", "content": "hi"}]


def test_sampling_settings_within_the_caps_are_taken():
    s = parse_sampling({"n": 4, "max_tokens": 32, "temperature": 0, "top_p": 0.5, "stop": "]", "stream": True,
                        "stream_options": {"include_usage": True}, "logprobs": True}, 32, 4)
    assert (s.n, s.max_tokens, s.temperature, s.top_p, s.stop, s.stream, s.include_usage, s.logprobs) == \
        (4, 32, 0.0, 0.5, ["]"], True, True, True)
    assert parse_sampling({"max_completion_tokens": 7, "max_tokens": 30}, 32, 4).max_tokens == 7
    assert parse_sampling({"stop": ["a", "b"], "logprobs": 0}, 32, 4).stop == ["a", "b"]
    assert parse_sampling({"logprobs": 2}, 32, 4).logprobs is True
    assert parse_sampling({"response_format": {"type": "text"}}, 32, 4).n == 1


@pytest.mark.parametrize("body, param, code", [
    ({"n": 5}, "n", "over_cap"),
    ({"n": 0}, "n", "invalid_value"),
    ({"n": True}, "n", "invalid_value"),
    ({"max_tokens": 33}, "max_tokens", "over_cap"),
    ({"max_completion_tokens": 1000}, "max_completion_tokens", "over_cap"),
    ({"max_tokens": 0}, "max_tokens", "invalid_value"),
    ({"max_tokens": 2.5}, "max_tokens", "invalid_value"),
    ({"temperature": 2.5}, "temperature", "invalid_value"),
    ({"temperature": -0.1}, "temperature", "invalid_value"),
    ({"temperature": "hot"}, "temperature", "invalid_value"),
    ({"temperature": float("nan")}, "temperature", "invalid_value"),
    ({"temperature": 10 ** 400}, "temperature", "invalid_value"),  # a JSON integer too large for a float
    ({"top_p": -10 ** 400}, "top_p", "invalid_value"),
    ({"top_p": 0}, "top_p", "invalid_value"),
    ({"top_p": 1.5}, "top_p", "invalid_value"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "invalid_value"),
    ({"stop": [""]}, "stop", "invalid_value"),
    ({"stop": 3}, "stop", "invalid_value"),
    ({"stream_options": "yes"}, "stream_options", "invalid_value"),
    ({"logit_bias": {"5": 10}}, "logit_bias", "unsupported"),
    ({"response_format": {"type": "json_object"}}, "response_format", "unsupported"),
    ({"echo": True}, "echo", "unsupported"),
    ({"best_of": 3}, "echo", "unsupported"),
])
def test_sampling_settings_over_the_caps_or_out_of_range_are_refused(body, param, code):
    err = refused(chat, **body)
    assert (err.status, err.type, err.param, err.code) == (400, "invalid_request_error", param, code)
    assert err.body() == {"error": {"message": err.message, "type": err.type, "code": code, "param": param}}
    assert param in err.message


def test_a_request_for_another_model_is_refused_naming_the_served_one():
    err = refused(parse_chat, {"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]}, MODEL, **CAPS)
    assert (err.status, err.code, err.param) == (400, "model_not_found", "model")
    assert "gpt-4o" in err.message and "'tiny'" in err.message
    err = refused(parse_completion, {"prompt": "x"}, MODEL, **CAPS)
    assert (err.status, err.code, err.param) == (400, "missing_model", "model")


@pytest.mark.parametrize("messages", [[], None, "hi", [{"content": "x"}], [{"role": "robot", "content": "x"}],
                                      [{"role": "user", "content": 5}], ["hi"],
                                      [{"role": "assistant", "content": "x", "tool_calls": 5}],
                                      [{"role": "assistant", "content": "x", "tool_calls": ["add"]}],
                                      [{"role": "assistant", "content": "x", "tool_calls": [{"function": "add"}]}]])
def test_chat_messages_must_be_a_non_empty_list_of_role_content_objects(messages):
    err = refused(parse_chat, {"model": MODEL, "messages": messages}, MODEL, **CAPS)
    assert err.status == 400 and err.param.startswith("messages")


def test_tools_must_be_a_list_of_objects():
    assert refused(chat, tools="add").param == "tools"
    assert refused(chat, tools=["add"]).param == "tools"
    req = chat(tools=[{"type": "function", "function": {"name": "add"}}], tool_choice="auto")
    assert req.tools == [{"type": "function", "function": {"name": "add"}}] and req.tool_choice == "auto"


@pytest.mark.parametrize("body", [b"{not json", b"", b"\xff\xfe", b"[1, 2]", b'"text"', b"null",
                                  b'{"reward": 1' + b"0" * 5000 + b"}",  # more digits than Python reads
                                  b'{"a": ' * 100_000, b"[" * 100_000])  # nested deeper than Python reads (RecursionError)
def test_a_body_that_is_not_a_json_object_is_refused(body):
    err = refused(parse_json, body)
    assert (err.status, err.code) == (400, "invalid_json")


def test_nan_in_the_body_is_read_and_then_refused_as_a_value():
    obj = parse_json(b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}')
    assert refused(parse_chat, obj, MODEL, **CAPS).param == "temperature"


def test_completion_prompts_are_one_string_or_one_list_of_token_ids():
    def prompt(p):
        return parse_completion({"model": MODEL, "prompt": p}, MODEL, **CAPS).prompt

    assert prompt("abc") == "abc"
    assert prompt(["abc"]) == "abc"
    assert prompt([5, 6, 7]) == [5, 6, 7]
    assert prompt([[5, 6]]) == [5, 6]
    for bad in ["", [], ["a", "b"], [[1], [2]], [1, "a"], [True, 2], None, 3]:
        assert refused(parse_completion, {"model": MODEL, "prompt": bad}, MODEL, **CAPS).param == "prompt"


def test_normal_message_makes_what_clients_send_back_compare_equal():
    as_string = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": [2, 3]}'}}]}
    as_object = {"role": "assistant", "content": "", "refusal": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": {"b": [2, 3], "a": 1}}}]}
    assert normal_message(as_string) == normal_message(as_object) == {
        "role": "assistant", "content": "",
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": [2, 3]}}}]}
    assert normal_message({"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}) == \
        normal_message({"role": "user", "content": "ab"}) == {"role": "user", "content": "ab"}
    assert normal_message({"role": "tool", "content": "3", "tool_call_id": "call_1", "name": "add"}) == \
        {"role": "tool", "content": "3", "tool_call_id": "call_1", "name": "add"}
    # arguments that are not JSON stay as they were (the comparison is then textual)
    odd = normal_message({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]})
    assert odd["tool_calls"][0]["function"]["arguments"] == "{oops"
    for text in ("[" * 100_000, "1" * 5000):  # nested deeper, or more digits, than Python reads
        odd = normal_message({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": text}}]})
        assert odd["tool_calls"][0]["function"]["arguments"] == text
    # an empty argument string is an empty object
    assert normal_message({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": ""}}]}) == \
        normal_message({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]})


# ---------------------------------------------------------------------------------------------- sessions


@pytest.fixture(scope="module")
def tokenizer(tiny_model_cfg):
    from rlhf_core.models import load_tokenizer

    tok = load_tokenizer(tiny_model_cfg)
    tok.chat_template = PLAIN_TEMPLATE
    return tok


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def sampled_turn(sessions, s, token_ids, version=3):
    """What the gateway does with a call's result: record it and remember the returned message."""
    text = sessions.tokenizer.decode(token_ids, skip_special_tokens=True)
    lps = [-0.25 - 0.01 * i for i in range(len(token_ids))]
    sessions.record(s, token_ids, lps, [version] * len(token_ids), text, "stop")
    return {"role": "assistant", "content": text}, lps


def test_a_call_extending_the_session_continues_from_the_sampled_ids(tokenizer):
    tok = tokenizer
    sessions = Sessions(tok, ttl_s=60, group_size=1, max_response_tokens=200)
    s = sessions.open("s", None)
    first_msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "count"}]
    ctx1 = sessions.chat_context(s, first_msgs, None)
    assert tok.decode(ctx1, skip_special_tokens=False) == "[system] be brief [user] count [assistant] "
    # the sampled ids include a special token that text would drop: ids are kept, never re-tokenised
    turn = [tok.pad_token_id, *ids(tok, "12"), tok.eos_token_id]
    reply, lps = sampled_turn(sessions, s, turn)
    assert reply["content"] == "12"
    s.expected = [*first_msgs, normal_message(reply)]
    added = [{"role": "user", "content": "go on"}]
    ctx2 = sessions.chat_context(s, [*first_msgs, reply, *added], None)
    assert ctx2[:len(ctx1) + len(turn)] == ctx1 + turn
    assert tok.decode(ctx2[len(ctx1) + len(turn):], skip_special_tokens=False) == " [user] go on [assistant] "
    assert sessions.counters.sessions_restarted == 0
    assert sessions.counters.retokenisation_drift == 0  # counted when the call's check has run (the gateway: on a thread)
    sessions.count_drift(s, s.drift_check())
    assert sessions.counters.retokenisation_drift == 1 and s.drift_check is None  # the <pad> the template's text does not have
    t = s.transcript
    n_added = len(ctx2) - len(ctx1) - len(turn)
    assert t.prompt_ids == ctx1 and t.response_ids == ctx2[len(ctx1):]
    assert t.mask == [1] * len(turn) + [0] * n_added
    assert t.logprobs == pytest.approx(lps + [0.0] * n_added)
    assert t.versions == [3] * (len(turn) + n_added)
    assert sessions.room(s) == 200 - len(turn) - n_added


def test_a_turn_cut_after_a_literal_angle_bracket_still_gets_the_whole_turn_end(tokenizer):
    # the template closes an assistant turn with "<eos> "; this turn (a <pad> inside it makes the
    # template's text differ, so the turn's end comes from the fixed two-message rendering) was cut
    # after the character "<", which is not the first character of the EOS token: the turn end is
    # the EOS token and " ", never the characters "e", "o", "s", ">" (the start "<" matched as text only)
    tok = tokenizer
    sessions = Sessions(tok, ttl_s=60, group_size=1, max_response_tokens=200)
    s = sessions.open("lt", None)
    first = [{"role": "user", "content": "count"}]
    ctx1 = sessions.chat_context(s, first, None)
    turn = [tok.pad_token_id, *ids(tok, "1<")]
    reply, _ = sampled_turn(sessions, s, turn)
    s.expected = [*first, normal_message(reply)]
    ctx2 = sessions.chat_context(s, [*first, reply, {"role": "user", "content": "go"}], None)
    added = ctx2[len(ctx1) + len(turn):]
    assert added[0] == tok.eos_token_id
    assert tok.decode(added, skip_special_tokens=False) == "<eos> [user] go [assistant] "


def test_a_sessions_next_call_may_reuse_k_v_as_old_as_its_oldest_token(tokenizer):
    # The call carries the oldest version of the session's tokens so far (none on its first call):
    # a worker's engine may reuse K/V written by that version or later (the sample's staleness
    # counts from there already).
    from types import SimpleNamespace

    from gateway.routing import CallRouter

    sessions = Sessions(tokenizer, ttl_s=60, group_size=1, max_response_tokens=200)
    router = CallRouter(Config(), RunKeys.for_run("r"), "gw-1", sessions, max_context=1000)  # not connected
    sampling = SimpleNamespace(max_tokens=4, temperature=1.0, top_p=1.0, stop=[], stream=False)
    s = sessions.open("s", None)
    msgs = [{"role": "user", "content": "a"}]
    (first,) = router.make_calls([s], lambda s: sessions.chat_context(s, msgs, None), sampling)
    assert first.call.min_kv_version is None
    for turn, (text, version) in enumerate((("xy", 3), ("z", 7))):  # the next turn sampled by a newer version
        reply, _ = sampled_turn(sessions, s, ids(tokenizer, text), version=version)
        s.expected = [*msgs, normal_message(reply)]
        msgs = [*s.expected, {"role": "user", "content": f"b{turn}"}]
        (call,) = router.make_calls([s], lambda s, msgs=msgs: sessions.chat_context(s, msgs, None), sampling)
        assert call.call.min_kv_version == 3


def test_a_call_that_does_not_extend_the_session_restarts_it(tokenizer):
    sessions = Sessions(tokenizer, ttl_s=60, group_size=1, max_response_tokens=200)
    s = sessions.open("s", None)
    msgs = [{"role": "user", "content": "a"}]
    sessions.chat_context(s, msgs, None)
    reply, _ = sampled_turn(sessions, s, ids(tokenizer, "xy"))
    s.expected = [*msgs, normal_message(reply)]
    # the agent edited its reply
    ctx = sessions.chat_context(s, [*msgs, {"role": "assistant", "content": "zz"}, {"role": "user", "content": "b"}], None)
    assert sessions.counters.sessions_restarted == 1
    assert s.transcript.response_ids == [] and s.transcript.prompt_ids == ctx and s.turns == 0
    assert tokenizer.decode(ctx, skip_special_tokens=False) == "[user] a [assistant] zz<eos> [user] b [assistant] "
    # the same messages again (a retry, nothing added) also start over
    reply, _ = sampled_turn(sessions, s, ids(tokenizer, "q"))
    s.expected = [{"role": "user", "content": "a"}, normal_message(reply)]
    sessions.chat_context(s, s.expected, None)
    assert sessions.counters.sessions_restarted == 2
    # other tools: another conversation
    reply, _ = sampled_turn(sessions, s, ids(tokenizer, "r"))
    s.expected = [*msgs, normal_message(reply)]
    tools = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
    ctx = sessions.chat_context(s, [*msgs, reply, {"role": "user", "content": "c"}], tools)
    assert sessions.counters.sessions_restarted == 3
    assert tokenizer.decode(ctx, skip_special_tokens=False).startswith("[tools] [{")


def test_a_call_may_leave_its_sessions_tools_out_but_other_tools_restart_it_with_a_warning(tokenizer, caplog):
    sessions = Sessions(tokenizer, ttl_s=60, group_size=1, max_response_tokens=200)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
    s = sessions.open("s", None)
    msgs = [{"role": "user", "content": "a"}]
    ctx1 = sessions.chat_context(s, msgs, tools)
    reply, _ = sampled_turn(sessions, s, ids(tokenizer, "xy"))
    s.expected = [*msgs, normal_message(reply)]
    msgs = [*s.expected, {"role": "user", "content": "b"}]
    ctx2 = sessions.chat_context(s, msgs, None)  # no tools: the turn follows the prompt that holds them
    assert sessions.counters.sessions_restarted == 0 and ctx2[:len(ctx1)] == ctx1
    assert tokenizer.decode(ctx2[len(ctx1):], skip_special_tokens=False) == "xy<eos> [user] b [assistant] "
    reply, _ = sampled_turn(sessions, s, ids(tokenizer, "z"))
    s.expected = [*msgs, normal_message(reply)]
    other = [{"type": "function", "function": {"name": "mul", "parameters": {}}}]
    with caplog.at_level("WARNING", logger="gateway.sessions"):
        ctx3 = sessions.chat_context(s, [*s.expected, {"role": "user", "content": "c"}], other)
    assert sessions.counters.sessions_restarted == 1 and s.transcript.response_ids == [] and ctx3 == s.transcript.prompt_ids
    assert "session s: the call's tools differ from those of its session's prompt" in caplog.text
    assert "its 2 earlier turn(s) are not trained" in caplog.text


def test_completions_extend_their_session_by_text_or_by_token_ids(tokenizer):
    sessions = Sessions(tokenizer, ttl_s=60, group_size=1, max_response_tokens=200)
    s = sessions.open("c", None)
    ctx1 = sessions.completion_context(s, "Q: 1+1")
    assert ctx1 == ids(tokenizer, "Q: 1+1")
    turn = ids(tokenizer, " =2")
    sampled_turn(sessions, s, turn)
    s.text += " =2"  # the server adds the completion's text
    ctx2 = sessions.completion_context(s, "Q: 1+1 =2 Q: 2+2")
    assert ctx2 == ctx1 + turn + ids(tokenizer, " Q: 2+2") and s.transcript.mask == [1] * 3 + [0] * 7
    sampled_turn(sessions, s, ids(tokenizer, "=4"))
    as_ids = ctx2 + ids(tokenizer, "=4") + ids(tokenizer, "!")
    assert sessions.completion_context(s, as_ids) == as_ids and sessions.counters.sessions_restarted == 0
    assert sessions.completion_context(s, "another prompt") == ids(tokenizer, "another prompt")
    assert sessions.counters.sessions_restarted == 1


def reward(sessions, sid, value, components=None, group=None):
    """What the gateway does with a reward post, the buffer left out: end the session, keep its
    sample (here: nowhere), add it to its group; returns (group, its samples if it is due now)."""
    r = sessions.end(sid, value, components or {}, group)
    sessions.rewarded(r)
    if r.group not in sessions.due():
        return r.group, None
    keys, samples = sessions.group(r.group)
    sessions.appended(r.group, keys)
    return r.group, samples


def rewarded_session(sessions, tokenizer, sid, group=None, text="r"):
    s = sessions.open(sid, group)
    sessions.chat_context(s, [{"role": "user", "content": "q"}], None)
    sampled_turn(sessions, s, ids(tokenizer, text))
    return s


def test_rewards_end_sessions_once(tokenizer):
    sessions = Sessions(tokenizer, ttl_s=60, group_size=1, max_response_tokens=200)
    with pytest.raises(SessionError) as info:
        sessions.end("nobody", 1.0, {}, None)
    assert info.value.status == 404
    s = sessions.open("s", None)
    with pytest.raises(SessionError) as info:  # no call yet
        sessions.end("s", 1.0, {}, None)
    assert info.value.status == 400
    sessions.chat_context(s, [{"role": "user", "content": "a"}], None)
    sampled_turn(sessions, s, ids(tokenizer, "b"))
    s.busy = True
    with pytest.raises(SessionError) as info:
        sessions.end("s", 1.0, {}, None)
    assert info.value.status == 409
    with pytest.raises(SessionError) as info:  # a second call of a busy session
        sessions.open("s", None)
    assert info.value.status == 409
    s.busy = False
    # a reward the buffer could not keep: the session goes on as it was, and its reward may be posted again
    r = sessions.end("s", 0.75, {"a": 0.5, "b": 0.25}, None)
    with pytest.raises(SessionError) as info:  # held while its reward is being kept
        sessions.end("s", 0.75, {}, None)
    assert info.value.status == 409
    sessions.reopen(r)
    assert sessions.sessions["s"] is s and not s.busy and not sessions.groups
    name, samples = reward(sessions, "s", 0.75, {"a": 0.5, "b": 0.25})
    assert name == "s" and len(samples) == 1
    assert samples[0].reward == 0.75 and samples[0].reward_components == {"a": 0.5, "b": 0.25}
    for again in (lambda: sessions.end("s", 1.0, {}, None), lambda: sessions.open("s", None)):
        with pytest.raises(SessionError) as info:
            again()
        assert info.value.status == 409
    assert sessions.counters.sessions_rewarded == 1 and not sessions.groups


def test_a_group_is_appended_when_its_last_session_is_rewarded(tokenizer):
    sessions = Sessions(tokenizer, ttl_s=60, group_size=3, max_response_tokens=200)
    for i in range(3):
        s = sessions.open(f"g/{i}", "g")
        sessions.chat_context(s, [{"role": "user", "content": "q"}], None)
        sampled_turn(sessions, s, ids(tokenizer, "ab"[: i % 2 + 1]) + [tokenizer.eos_token_id])
    assert reward(sessions, "g/0", 1.0) == ("g", None)
    assert reward(sessions, "g/2", 0.0) == ("g", None)  # rewarded in any order
    name, samples = reward(sessions, "g/1", -1.0)
    assert name == "g" and len(samples) == 3 and not sessions.groups
    assert [s.group_index for s in samples] == [0, 1, 2]
    assert len({s.group_id for s in samples}) == 1 and samples[0].group_id.startswith("gw:g:")
    assert [s.sample_id for s in samples] == [f"{samples[0].group_id}/{i}" for i in range(3)]
    assert [s.metadata["session"] for s in samples] == ["g/0", "g/2", "g/1"]
    assert [s.reward for s in samples] == [1.0, 0.0, -1.0]
    assert {s.group_size for s in samples} == {3} and {s.prompt_id for s in samples} == {"gw:g"}
    for s in samples:
        assert s.loss_mask.tolist() == [1] * s.num_response_tokens and s.finish_reason == "stop"
        assert [tuple(v) for v in s.versions] == [(3, s.num_response_tokens)] and (s.behaviour_logprobs < 0).all()
    # a session's reward may name its group; sessions of the same name fill it
    for sid in ("x", "y"):
        rewarded_session(sessions, tokenizer, sid, text="z")
    assert reward(sessions, "x", 1.0, group="h") == ("h", None)
    assert reward(sessions, "y", 1.0, group="h")[1] is None  # 2 of 3
    assert sessions.counters.sessions_rewarded == 5


def test_a_session_without_a_group_is_appended_as_it_is_rewarded(tokenizer):
    # Once: it waited gateway.session_ttl_s (600 s) for a group of one to fill
    from rlhf_core.records import Sample

    sessions = Sessions(tokenizer, ttl_s=60, group_size=3, max_response_tokens=200)
    rewarded_session(sessions, tokenizer, "lone")
    name, samples = reward(sessions, "lone", 1.0)
    assert name == "lone" and [(s.metadata["session"], s.group_size) for s in samples] == [("lone", 1)]
    # one that named its group, on its call or with its reward, waits for the group
    rewarded_session(sessions, tokenizer, "a", group="g")
    rewarded_session(sessions, tokenizer, "b")
    assert reward(sessions, "a", 1.0) == ("g", None) and reward(sessions, "b", 1.0, group="g") == ("g", None)
    # kept by a gateway that died before appending it: due at once in the next one
    first = Sessions(tokenizer, ttl_s=60, group_size=3, max_response_tokens=200)
    rewarded_session(first, tokenizer, "kept")
    r = first.end("kept", 0.5, {}, None)
    second = Sessions(tokenizer, ttl_s=60, group_size=3, max_response_tokens=200)
    second.recovered(r.key, Sample.decode(r.sample.encode()))
    assert second.due() == ["kept"]


def test_kept_rewards_found_at_start_go_back_into_their_groups(tokenizer):
    """What one gateway kept and did not append (it died with groups filling), the next one takes
    up: the same samples in the same groups, their sessions ended, their TTL running from their reward."""
    from rlhf_core.records import Sample

    first = Sessions(tokenizer, ttl_s=60, group_size=3, max_response_tokens=200)
    kept = {}
    for sid in ("a", "b"):
        rewarded_session(first, tokenizer, sid, group="g")
        r = first.end(sid, {"a": 1.0, "b": 0.5}[sid], {}, None)
        first.rewarded(r)
        kept[r.key] = r.sample.encode()  # what GatewayClient.keep_rewarded stores
    assert first.due() == []
    second = Sessions(tokenizer, ttl_s=60, group_size=3, max_response_tokens=200)
    for key, raw in kept.items():
        second.recovered(key, Sample.decode(raw))
    assert second.counters.rewards_recovered == 2 and list(second.groups) == ["g"]
    with pytest.raises(SessionError) as info:  # rewarded by the first gateway: not again
        second.end("a", 1.0, {}, None)
    assert info.value.status == 409
    rewarded_session(second, tokenizer, "c", group="g")
    name, samples = reward(second, "c", 0.0)
    assert name == "g" and [s.metadata["session"] for s in samples] == ["a", "b", "c"]
    assert [s.reward for s in samples] == [1.0, 0.5, 0.0] and [s.group_index for s in samples] == [0, 1, 2]
    assert samples[0].response_ids.tolist() == Sample.decode(next(iter(kept.values()))).response_ids.tolist()
    # a kept reward older than the TTL: its group is due at once
    third = Sessions(tokenizer, ttl_s=60, group_size=3, max_response_tokens=200)
    old = Sample.decode(next(iter(kept.values())))
    old.finished_at -= 120
    third.recovered("k", old)
    assert third.due() == ["g"]


def test_idle_sessions_expire_and_short_groups_are_appended_after_the_ttl(tokenizer):
    sessions = Sessions(tokenizer, ttl_s=10, group_size=4, max_response_tokens=200)
    for sid in ("a", "b", "idle"):
        rewarded_session(sessions, tokenizer, sid, group="g")
    busy = sessions.open("busy", None)
    busy.busy = True
    reward(sessions, "a", 1.0)
    reward(sessions, "b", 0.5)
    now = time.monotonic()
    sessions.expire(now=now)
    assert sessions.due(now=now) == [] and sessions.counters.sessions_expired == 0
    sessions.expire(now=now + 11)
    assert sessions.counters.sessions_expired == 1 and set(sessions.sessions) == {"busy"}  # a running call stays
    assert sessions.due(now=now + 11) == ["g"]
    keys, group = sessions.group("g")
    assert [s.metadata["session"] for s in group] == ["a", "b"] and len(set(keys)) == 2
    assert [s.group_size for s in group] == [2, 2] and [s.group_index for s in group] == [0, 1]
    sessions.appended("g", keys)
    assert sessions.groups == {} and sessions.due(now=now + 30) == []
    with pytest.raises(SessionError) as info:  # expired: nothing to reward
        sessions.end("idle", 1.0, {}, None)
    assert info.value.status == 404
    with pytest.raises(SessionError) as info:  # nor to continue
        sessions.open("idle", None)
    assert info.value.status == 409


def test_restore_puts_back_what_a_failed_call_changed(tokenizer):
    sessions = Sessions(tokenizer, ttl_s=60, group_size=1, max_response_tokens=200)
    # a first call that fails leaves no session
    s = sessions.open("new", None)
    snap = sessions.snapshot(s)
    sessions.chat_context(s, [{"role": "user", "content": "a"}], None)
    sessions.restore(s, snap)
    assert "new" not in sessions.sessions
    # a later call that fails leaves the session as it was before it
    s = sessions.open("s", None)
    msgs = [{"role": "user", "content": "a"}]
    sessions.chat_context(s, msgs, None)
    reply, _ = sampled_turn(sessions, s, ids(tokenizer, "xy"))
    s.expected = [*msgs, normal_message(reply)]
    before = (list(s.transcript.prompt_ids), list(s.transcript.response_ids), list(s.transcript.mask),
              list(s.transcript.logprobs), list(s.transcript.turns), list(s.conversation.messages),
              s.conversation.rendered, list(s.expected), s.turns, s.last_turn)
    snap = sessions.snapshot(s)
    longer = [*msgs, reply, {"role": "user", "content": "b"}]
    sessions.chat_context(s, longer, None)
    sampled_turn(sessions, s, ids(tokenizer, "zz"))
    s.expected = longer + [{"role": "assistant", "content": "zz"}]
    assert len(s.transcript.response_ids) > len(before[1])
    sessions.restore(s, snap)
    after = (s.transcript.prompt_ids, s.transcript.response_ids, s.transcript.mask, s.transcript.logprobs,
             s.transcript.turns, s.conversation.messages, s.conversation.rendered, s.expected, s.turns, s.last_turn)
    assert after == before and sessions.sessions["s"] is s
    # and the retried call extends it as the first try would have
    ctx = sessions.chat_context(s, longer, None)
    assert ctx[:len(before[0]) + len(before[1])] == before[0] + before[1] and sessions.counters.sessions_restarted == 0
    # a failed call that had restarted the session: restore brings the old transcript back
    snap = sessions.snapshot(s)
    sessions.chat_context(s, [{"role": "user", "content": "other"}], None)
    sessions.restore(s, snap)
    assert s.transcript.context_ids == ctx
    # a failed call whose drift check found drift (a <pad> sampled in the turn before it, which
    # the reply's text leaves out): the flag that ends later checks is put back with the rest,
    # and the retried call checks (and counts) again
    reply, _ = sampled_turn(sessions, s, [*ids(tokenizer, "p"), tokenizer.pad_token_id, *ids(tokenizer, "q")])
    s.expected = [*longer, normal_message(reply)]
    nxt = [*s.expected, {"role": "user", "content": "c"}]
    snap = sessions.snapshot(s)
    sessions.chat_context(s, nxt, None)
    assert s.drift_check() is True and s.conversation.drifted
    sessions.restore(s, snap)
    assert not s.conversation.drifted
    sessions.chat_context(s, nxt, None)
    assert s.drift_check() is True


# ---------------------------------------------------------------------------------------------- a reply's tool calls


@pytest.fixture(scope="module")
def finisher(tokenizer):
    """The gateway's reply builder (``Replies.finish``) on the tiny tokenizer, without a server."""
    from gateway.handlers import Replies
    from gateway.routing import Choice

    replies = Replies(tokenizer)

    def finish(text, stops=(), tools=True, reason="stop", eos=True):
        token_ids = ids(tokenizer, text) + ([tokenizer.eos_token_id] if eos else [])
        final = CallChunk("c", token_ids, final=True, logprobs=[-0.1] * len(token_ids), versions=[0] * len(token_ids),
                          finish_reason=reason)
        choice = Choice(0, None, None, None, final=final)  # type: ignore[arg-type]
        return replies.finish(choice, list(stops), tools)

    return finish


def test_a_reply_with_a_hermes_tool_call_finishes_with_tool_calls(finisher):
    text, calls, reason = finisher('let me add <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>')
    assert reason == "tool_calls" and text == "let me add"
    assert len(calls) == 1 and calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert calls[0]["function"]["name"] == "add" and json.loads(calls[0]["function"]["arguments"]) == {"a": 1}
    text, calls, reason = finisher('<tool_call>{"name": "a", "arguments": {}}</tool_call>'
                                   '<tool_call>{"name": "b", "arguments": "{\\"x\\": 2}"}</tool_call>')
    assert reason == "tool_calls" and text == ""
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [("a", {}), ("b", {"x": 2})]
    assert calls[0]["id"] != calls[1]["id"]


def test_a_reply_without_tools_or_without_a_call_is_plain_text(finisher):
    body = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    assert finisher(body, tools=False) == (body, [], "stop")  # the request had no tools
    assert finisher("just text") == ("just text", [], "stop")
    assert finisher("<tool_call>{broken</tool_call>") == ("<tool_call>{broken</tool_call>", [], "stop")
    assert finisher("abc", reason="length", eos=False) == ("abc", [], "length")


def test_a_stop_string_cuts_the_reply(finisher):
    assert finisher("abc]def]", stops=["]"], tools=False) == ("abc", [], "stop")
    assert finisher("abcdef", stops=["x", "cd"], tools=False) == ("ab", [], "stop")
    # a reply cut by length is not searched for stop strings (the worker stopped it for length)
    assert finisher("ab]c", stops=["]"], tools=False, reason="length", eos=False) == ("ab]c", [], "length")


# ---------------------------------------------------------------------------------------------- records


def test_calls_and_chunks_round_trip():
    call = GatewayCall("c1", "gw-1", [1, 2, 3], 8, temperature=0.7, top_p=0.9, stop=["]", "\n"], stream=True)
    assert GatewayCall.decode(call.encode()) == call
    later = GatewayCall("c2", "gw-1", [1, 2, 3, 4], 8, min_kv_version=0)  # a session's next call
    assert GatewayCall.decode(later.encode()) == later
    chunk = CallChunk("c1", [5, 6], final=True, logprobs=[-0.5, 0.0], versions=[2, 3], finish_reason="stop",
                      worker_id="w0")
    assert CallChunk.decode(chunk.encode()) == chunk
    delta = CallChunk("c1", [7])  # a streamed delta carries no log-probs
    assert CallChunk.decode(delta.encode()) == delta
    failed = CallChunk("c1", [], final=True, error="too long")
    assert CallChunk.decode(failed.encode()) == failed
    timed = CallChunk("c1", [5], final=True, logprobs=[-0.5], versions=[2], started_at=1.5e9, finished_at=1.5e9 + 0.25)
    assert CallChunk.decode(timed.encode()) == timed
    for bad in ("soon", float("nan"), True):  # a worker's clock reading is a finite number or nothing
        with pytest.raises(WireError, match="started_at"):
            CallChunk.decode(encode_record(KIND_CHUNK, _chunk_fields(started_at=bad)))


def _call_fields(**change):
    fields = {"call_id": "c", "reply_to": "g", "prompt_ids": [1, 2], "max_tokens": 4, "temperature": 1.0,
              "top_p": 1.0, "stop": [], "stream": False, "created_at": 0.0}
    fields.update(change)
    return {k: v for k, v in fields.items() if v is not ...}


def _chunk_fields(**change):
    fields = {"call_id": "c", "token_ids": [1, 2], "final": True, "logprobs": [-0.1, -0.2], "versions": [0, 0],
              "finish_reason": "stop", "error": None, "worker_id": "w"}
    fields.update(change)
    return {k: v for k, v in fields.items() if v is not ...}


@pytest.mark.parametrize("change", [
    {"call_id": 5}, {"call_id": ...}, {"reply_to": None}, {"prompt_ids": "abc"}, {"prompt_ids": [1, -2]},
    {"prompt_ids": [1, True]}, {"prompt_ids": [1.5]}, {"max_tokens": 0}, {"max_tokens": "8"}, {"max_tokens": True},
    {"temperature": "hot"}, {"top_p": None}, {"stop": ["a", 1]}, {"stop": "a"}, {"stream": "yes"},
    {"min_kv_version": -1}, {"min_kv_version": 1.5}, {"min_kv_version": True},
])
def test_bad_calls_are_refused(change):
    with pytest.raises(WireError):
        GatewayCall.decode(encode_record(KIND_CALL, _call_fields(**change)))


@pytest.mark.parametrize("change", [
    {"logprobs": [-0.1, 0.5]}, {"logprobs": [-0.1, float("nan")]}, {"logprobs": [-0.1]}, {"versions": [0]},
    {"token_ids": [1, 2, 3]}, {"token_ids": [1, -1]}, {"token_ids": "ab"}, {"final": 1}, {"final": ...},
    {"versions": [0, "1"]}, {"finish_reason": 3}, {"error": 5}, {"call_id": None},
    {"logprobs": [-0.1, None]}, {"logprobs": [-0.1, [1]]}, {"logprobs": "ab"}, {"logprobs": [True, -0.1]},
    {"versions": [0, False]},
])
def test_bad_chunks_are_refused(change):
    with pytest.raises(WireError):
        CallChunk.decode(encode_record(KIND_CHUNK, _chunk_fields(**change)))


def test_records_of_another_kind_or_not_records_at_all_are_refused():
    call = GatewayCall("c", "g", [1], 1).encode()
    for data in (call, b"", b"\x00garbage", msgpack.packb([1, 2]), msgpack.packb({"kind": KIND_CHUNK})):
        with pytest.raises(WireError):
            CallChunk.decode(data)
    with pytest.raises(WireError):
        GatewayCall.decode(CallChunk("c", [1]).encode())


# ---------------------------------------------------------------------------------------------- the worker's side


class _Channel:
    """WorkerChannel's surface, in memory: queued calls, chunks sent, cancelled call ids."""

    def __init__(self):
        self.queued: list[bytes] = []
        self.sent: list[tuple[str, CallChunk]] = []
        self.cancelled: set[str] = set()

    def take(self, n):
        from rollout_workers.gateway_calls import read_calls

        got, self.queued = self.queued[:max(n, 0)], self.queued[max(n, 0):]
        return read_calls(got)  # decoded as the background channel's taker thread decodes them

    def send(self, chunks):
        self.sent += [(g, CallChunk.decode(c.encode())) for g, c in chunks]  # what goes on the wire must decode

    def exchange(self, chunks, take, running):
        self.send(chunks)
        return self.take(take), [c for c, _ in running if c in self.cancelled]


class _Engine:
    """An engine whose requests sample the token 10 + i at step i and never finish on their own."""

    def __init__(self, max_len=16):
        self.max_len = max_len
        self.requests: dict[str, tuple[list[int], list[int]]] = {}
        self.version = 4
        self.min_kv_versions: dict[str, int | None] = {}

    def add(self, request):
        from rollout_workers.engine import RequestError

        if len(request.prompt_ids) >= self.max_len:
            raise RequestError(f"prompt has {len(request.prompt_ids)} tokens but the model's context is {self.max_len}")
        self.requests[request.request_id] = (list(request.prompt_ids), [])
        self.min_kv_versions[request.request_id] = request.min_kv_version

    def step(self):
        for _, tokens in self.requests.values():
            tokens.append(10 + len(tokens))
        return []

    def sampled(self, request_id):
        return self.requests[request_id][1] if request_id in self.requests else []

    def finish(self, request_id, reason="stop"):
        from rollout_workers.engine import make_result

        prompt, tokens = self.requests.pop(request_id)
        return make_result(request_id, prompt, tokens, [-0.5] * len(tokens), [self.version] * len(tokens), reason, "")

    def abort(self, request_id):
        return self.finish(request_id, "abort") if request_id in self.requests else None


def test_the_worker_streams_answers_refuses_and_aborts_calls(monkeypatch):
    from rollout_workers import gateway_calls
    from rollout_workers.engine import make_result

    monkeypatch.setattr(gateway_calls, "CANCEL_CHECK_S", 0.0)  # every step asks for cancellations
    channel, engine = _Channel(), _Engine()
    calls = gateway_calls.GatewayCalls(channel, engine, "w0")
    channel.queued = [GatewayCall("streamed", "gw-a", [1, 2], 8, stream=True).encode(),
                      GatewayCall("plain", "gw-b", [1], 8, min_kv_version=2).encode(),
                      GatewayCall("toolong", "gw-a", list(range(20)), 8).encode(),
                      b"not a record",
                      GatewayCall("later", "gw-a", [1], 8).encode()]
    calls.take(4)
    assert len(calls) == 2 and set(engine.requests) == {"gw/streamed", "gw/plain"} and len(channel.queued) == 1
    assert engine.min_kv_versions == {"gw/streamed": None, "gw/plain": 2}  # a session's next call: its oldest version
    # the one the engine refused is answered with why (which worker holds a call, the background
    # channel says as it takes it: the next test)
    assert [(g, c.call_id, c.started, c.final, c.error is not None, c.worker_id) for g, c in channel.sent] == [
        ("gw-a", "toolong", False, True, True, "w0")]
    assert calls.stats["gateway_refused"] == 1 and calls.stats["gateway_bad_records"] == 1
    channel.sent.clear()
    own = make_result("lease/0", [1], [3], [-0.1], [4], "stop", "")  # the run's own request passes through
    engine.step()
    assert calls.after_step([own], 0) == [own]
    engine.step()
    assert calls.after_step([], 0) == []
    # the streamed call got its tokens as they came, the plain call nothing yet
    assert [(g, c.call_id, c.token_ids, c.final) for g, c in channel.sent] == [
        ("gw-a", "streamed", [10], False), ("gw-a", "streamed", [11], False)]
    channel.sent.clear()
    channel.cancelled.add("streamed")  # its client went away
    assert calls.after_step([engine.finish("gw/plain")], 0) == []
    finals = {c.call_id: (g, c) for g, c in channel.sent if c.final}
    assert set(finals) == {"plain", "streamed"} and len(calls) == 0
    assert finals["plain"][0] == "gw-b" and finals["plain"][1].token_ids == [10, 11]
    assert finals["plain"][1].finish_reason == "stop" and finals["plain"][1].versions == [4, 4]
    assert finals["streamed"][1].finish_reason == "abort" and finals["streamed"][1].token_ids == [10, 11]
    assert (calls.stats["gateway_done"], calls.stats["gateway_aborted"]) == (1, 1)
    assert not engine.requests  # the aborted call's slot is free
    # a busy worker takes new calls after a step, up to its free slots
    channel.sent.clear()
    calls.after_step([], 1)
    assert set(engine.requests) == {"gw/later"} and not channel.queued and not channel.sent
    # at exit every call still running ends as an abort
    calls.abort_all()
    assert [(c.call_id, c.finish_reason) for _, c in channel.sent] == [("later", "abort")] and not engine.requests


def test_the_background_channel_takes_on_demand_says_who_holds_what_it_took_and_gives_back_what_it_did_not_start():
    import threading
    import time

    from rollout_workers.gateway_calls import BackgroundChannel

    class Redisless:
        """WorkerChannel's primitives over lists; wait_take blocks on a condition like BRPOP."""

        def __init__(self):
            self.calls, self.sent, self.given_back, self.cond = [], [], [], threading.Condition()

        def push(self, *raws):
            with self.cond:
                self.calls += raws
                self.cond.notify_all()

        def wait_take(self, n, block_s):
            with self.cond:
                self.cond.wait_for(lambda: self.calls, timeout=block_s)
                got, self.calls = self.calls[:n], self.calls[n:]
                return got

        def send(self, chunks, running):
            self.sent += chunks
            return [c for c, _ in running if c == "gone"]

        def give_back(self, raws):
            self.given_back += raws

    def until(fn):
        deadline = time.monotonic() + 5
        while not (out := fn()):
            assert time.monotonic() < deadline
            time.sleep(0.001)
        return out

    inner = Redisless()
    ch = BackgroundChannel(inner, "w7")
    assert ch.take(0) == [] and ch.demand == 0  # no free slot: nothing is fetched
    c2 = GatewayCall("c2", "gw-b", [1], 4).encode()
    before = time.time()
    inner.push(b"c1", c2, b"c3")  # c1, c3: not records (the main thread counts them)
    taken = ch.take(2, wait_s=5.0)  # an idle worker waits for the first call; at most 2
    assert taken and len(taken) <= 2
    while len(taken) < 3:  # later steps take the rest, oldest first, as slots free up
        taken += until(lambda: ch.exchange([], 1, [])[0])
    assert [raw for raw, _ in taken] == [b"c1", c2, b"c3"]  # each decoded once, by the thread, or why not
    assert [type(call).__name__ for _, call in taken] == ["WireError", "GatewayCall", "WireError"]
    # the gateway of each call learns which worker holds it as the thread takes it, before the
    # main thread starts it: a worker killed with calls still in its inbox fails them too
    held = until(lambda: [(g, c) for g, c in inner.sent if c.call_id == "c2"])
    assert [(g, c.started, c.worker_id) for g, c in held] == [("gw-b", True, "w7")] and held[0][1].started_at >= before
    inner.sent.clear()
    chunks = [("gw", CallChunk(f"x{i}", [i], final=True, logprobs=[-0.1], versions=[1])) for i in range(5)]
    ch.exchange(chunks, 0, [("gone", "gw"), ("kept", "gw")])
    assert until(lambda: ch.exchange([], 0, [])[1]) == ["gone"]  # the sender read the cancellations
    late = GatewayCall("late", "gw-a", [1], 4).encode()
    inner.push(late)  # taken by the thread, never started: given back when the worker stops
    ch._ask(1)
    until(lambda: ch.inbox)
    ch.close()
    assert inner.given_back == [late]
    # in order, all of them; the given-back call is held by nobody now (another worker takes it)
    assert [(c.call_id, c.started and c.worker_id) for _, c in inner.sent] == \
        [*((f"x{i}", False) for i in range(5)), ("late", "w7"), ("late", "")]


def test_a_call_of_n_choices_over_the_context_is_refused_after_rendering_one(tokenizer):
    # Once: every choice's context was rendered and tokenised before any was checked; a 900 kB
    # chat message with n=8 held the gateway's event loop for 9.4 s (8 times 1.2 s), then got a 400
    from gateway.routing import CallRouter

    store = Sessions(tokenizer, 60.0, 4, 32)
    router = CallRouter(Config(), RunKeys.for_run("r"), "gw-1", store, max_context=64)  # not connected
    sessions = [store.open(f"long/{i}", None) for i in range(4)]
    rendered = []

    def context(s):
        rendered.append(s.session_id)
        return store.completion_context(s, "x" * 100)

    with pytest.raises(ApiError) as info:
        router.make_calls(sessions, context, parse_sampling({"n": 4}, 32, 4))
    assert info.value.code == "context_length_exceeded" and "100 tokens" in info.value.message
    assert rendered == ["long/0"]


def test_a_stopping_worker_says_it_holds_a_call_no_more_before_it_gives_the_call_back():
    """Another worker may take a given-back call at once and say it holds it: had this worker's
    "held by nobody" come after that, the gateway would think nobody holds the call and, that
    worker dying, wait out gateway.call_timeout_s instead of failing it at once."""
    import threading

    from rollout_workers.gateway_calls import BackgroundChannel

    call = GatewayCall("c", "gw-a", [1], 4).encode()

    class Channel:
        def __init__(self):
            self.log, self.queued, self.stop = [], [call], threading.Event()

        def wait_take(self, n, block_s):
            if self.queued:
                got, self.queued = self.queued, []
                return got
            self.stop.wait(block_s)
            return []

        def send(self, chunks, running):
            self.log += [("held by", c.worker_id) for _, c in chunks]
            return []

        def give_back(self, raws):
            self.log.append(("given back", raws))

    inner = Channel()
    ch = BackgroundChannel(inner, "w1")
    ch._ask(1)  # the worker has a free slot: the taker takes the call; the worker stops before it starts it
    with ch._got:
        assert ch._got.wait_for(lambda: ch.inbox, timeout=10)
    ch.close()
    inner.stop.set()
    assert inner.log == [("held by", "w1"), ("held by", ""), ("given back", [call])]


def test_a_streamed_call_that_fails_winds_its_calls_up_before_it_puts_its_sessions_back():
    """A choice answered with an error ends the stream early; the calls' own ending (the drift
    check awaited, unfinished calls cancelled) must come before the sessions are put back and
    freed. Left to the garbage collector, it came after: the drift check thread still ran on a
    conversation already put back (or taken by the session's next call), and its late count
    landed in the restored session."""
    import asyncio
    import types

    from gateway.handlers import Handlers

    log = []

    class Router:
        async def run(self, choices):
            try:
                for c in choices:
                    c.final = types.SimpleNamespace(error="refused", finish_reason="stop")
                    yield c, types.SimpleNamespace(final=True, token_ids=[])
            finally:
                log.append("calls wound up")

    class Stub:
        router = Router()

        def _error_event(self, err):
            return b"error"

        def _settle(self, choices, ok):
            log.append(("settled", ok))

    async def stream():
        choices = [types.SimpleNamespace(final=None), types.SimpleNamespace(final=None)]
        events = Handlers._sse(Stub(), choices, types.SimpleNamespace(include_usage=False), "id", 0, "kind", [],
                               lambda c: b"final", lambda c, tokens: None)
        return [e async for e in events]

    assert asyncio.run(stream()) == [b"error"]
    assert log == ["calls wound up", ("settled", False)]
