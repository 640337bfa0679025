"""ChatJudge, the remote reward, against a stub of the OpenAI chat API on a random loopback port
(``chat_stub.py``): scores parsed from replies, data columns in the template, requests of a batch
sent together, and each way a judge fails (slow, garbage, no number, overloaded, wrong key),
reported per completion with what to check."""

from __future__ import annotations

import pytest

from chat_stub import ChatStub
from rlhf_core.config import RewardConfig
from rollout_workers.rewards import RewardError, ScoreItem, Scorer
from rollout_workers.rewards_remote import ChatJudge

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


@pytest.fixture
def stub():
    with ChatStub() as s:
        yield s


def judge_scorer(tiny_model_cfg, **kwargs) -> Scorer:
    spec = {"_target_": "rollout_workers.rewards_remote.ChatJudge", "weight": 2.0, **kwargs}
    return Scorer(RewardConfig(functions={"judge": spec}), tiny_model_cfg)


def test_scores_come_from_the_replies_with_data_columns_in_the_template(stub, tiny_model_cfg):
    s = judge_scorer(tiny_model_cfg, url=stub.url, model="match", template="{reference}|{response}", scale=0.1,
                     system="You grade answers.")
    batch = [ScoreItem("1:", "2345", [1], {"reference": "23456"}), ScoreItem("5:", "6x", [1], {"reference": "678"})]
    # "2345" shares 4 leading characters with "23456" -> 0.4; "6x" shares 1 with "678" -> 0.1; weight 2
    assert s.score_batch(batch) == [(pytest.approx(0.8), {"judge": pytest.approx(0.4)}),
                                    (pytest.approx(0.2), {"judge": pytest.approx(0.1)})]
    first = min(stub.requests, key=lambda r: r["body"]["messages"][-1]["content"])
    assert first["path"] == "/v1/chat/completions" and "Authorization" not in first["headers"]
    assert first["body"] == {"model": "match", "temperature": 0.0, "max_tokens": 16, "messages": [
        {"role": "system", "content": "You grade answers."}, {"role": "user", "content": "23456|2345"}]}


def test_a_batch_is_judged_concurrently(stub, tiny_model_cfg):
    # the stub answers "together" only once 4 requests are inside at once: one at a time would fail
    s = judge_scorer(tiny_model_cfg, url=stub.url + "/chat/completions", model="together", template="{response}",
                     concurrency=4, timeout_s=15)
    out = s.score_batch([ScoreItem("p", "a" * n, [1], {}) for n in (1, 2, 3, 4)])
    assert [parts["judge"] for _, parts in out] == [1.0, 2.0, 3.0, 4.0]  # "I'd say <len>/10": the first number


def test_an_overloaded_server_is_retried_with_backoff(stub):
    judge = ChatJudge(stub.url, "flaky", template="{response}", max_retries=2, backoff_s=0.01)
    assert judge(["p"], ["abc"]) == [3.0]
    assert len(stub.requests) == 3  # 503, 503, then the answer
    fails = ChatJudge(stub.url, "flaky", template="{response}", max_retries=1, backoff_s=0.01)
    (err,) = fails(["p"], ["xyz"])
    assert str(err) == (f"no answer from {stub.url}/chat/completions after 2 attempt(s) (timeout_s=30 each), the last: "
                        "HTTP 503 Service Unavailable: '{\"error\": {\"message\": \"overloaded\"}}'")


@pytest.mark.parametrize("model, message", [
    ("slow", "reward function 'judge' failed for this completion: JudgeError: no answer from {url}/chat/completions "
             "after 2 attempt(s) (timeout_s=0.2 each), the last: TimeoutError: timed out"),
    ("garbage", "reward function 'judge' failed for this completion: JudgeError: the reply from {url}/chat/completions "
                "is not a chat completion (choices[0].message.content): b'<html>not json at all</html>'"),
    ("wordy", "reward function 'judge' failed for this completion: JudgeError: the judge's reply 'An excellent "
              "answer!' holds no number (pattern '[-+]?\\\\d+(?:\\\\.\\\\d+)?')"),
])
def test_a_failing_judge_fails_that_completion_with_what_happened(stub, tiny_model_cfg, model, message):
    s = judge_scorer(tiny_model_cfg, url=stub.url, model=model, timeout_s=0.2, max_retries=1, backoff_s=0.0)
    (out,) = s.score_batch([ScoreItem("p", "answer", [1], {})])
    assert isinstance(out, RewardError) and str(out) == message.format(url=stub.url)


def test_a_chat_prompt_is_asked_as_its_last_user_turn(stub):
    # TRL's conversational form, which a batched function gets for a prompt that came as turns
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 3+3?"}]
    judge = ChatJudge(stub.url, "length", template="Q: {prompt} A: {response}")
    assert judge([chat, "What is 2+2?"], [[{"role": "assistant", "content": "6"}], "4"]) == [20.0, 20.0]
    assert sorted(r["body"]["messages"][-1]["content"] for r in stub.requests) == ["Q: What is 2+2? A: 4",
                                                                                  "Q: What is 3+3? A: 6"]


def test_a_template_naming_a_missing_column_says_so(stub):
    (err,) = ChatJudge(stub.url, "length", template="{reference} vs {response}")(["p"], ["a"])
    assert str(err).startswith("the judge's template names {reference}, which this prompt's data does not have")
    assert stub.requests == []  # nothing sent


def test_a_prompt_without_the_column_is_not_judged_whatever_its_batch(stub, tiny_model_cfg):
    # beside a prompt with a reference, one without was judged against the literal text "None"
    s = judge_scorer(tiny_model_cfg, url=stub.url, model="match", template="{reference}|{response}")
    out = s.score_batch([ScoreItem("1:", "23", [1], {"reference": "234"}), ScoreItem("5:", "6", [1], {})])
    assert out[0] == (4.0, {"judge": 2.0})  # "23" shares 2 leading characters with "234", weight 2
    assert str(out[1]).startswith("reward function 'judge' failed for this completion: JudgeError: the judge's "
                                  "template names {reference}, which this prompt's data does not have")
    assert [r["body"]["messages"][-1]["content"] for r in stub.requests] == ["234|23"]


def test_the_api_key_comes_from_the_environment_and_a_wrong_one_says_what_to_check(tiny_model_cfg, monkeypatch):
    with ChatStub(api_key="sekrit") as stub:
        (err,) = ChatJudge(stub.url, "length", template="{response}")(["p"], ["a"])
        assert str(err) == (f"{stub.url}/chat/completions refused the request (HTTP 401 Unauthorized: "
                            "'{\"error\": {\"message\": \"invalid api key\"}}'): check api_key / api_key_env")
        monkeypatch.setenv("JUDGE_KEY", "sekrit")
        assert ChatJudge(stub.url, "length", template="{response}", api_key_env="JUDGE_KEY")(["p"], ["ab"]) == [2.0]
        assert stub.requests[-1]["headers"]["Authorization"] == "Bearer sekrit"
        monkeypatch.delenv("JUDGE_KEY")
        with pytest.raises(ValueError, match="api_key_env='JUDGE_KEY' names an environment variable that is not set"):
            ChatJudge(stub.url, "length", api_key_env="JUDGE_KEY")


def test_without_a_model_name_the_request_leaves_it_out(stub):
    # a server of one model (vLLM's, llama.cpp's) answers with that one
    assert ChatJudge(stub.url, template="{response}")(["p", "q"], ["abc", ""]) == [3.0, 0.0]
    assert all("model" not in r["body"] for r in stub.requests) and len(stub.requests) == 2


def test_an_error_reply_whose_body_stalls_is_retried_and_fails_its_own_completion_only(tiny_model_cfg):
    # the read of the 503's body timed out inside the except clause: that TimeoutError escaped the
    # judge and failed the whole batch, without a retry
    with ChatStub(slow_s=3.0) as stub:
        s = judge_scorer(tiny_model_cfg, url=stub.url, model="stall", template="{response}", timeout_s=0.5,
                         max_retries=1, backoff_s=0.0)
        out = s.score_batch([ScoreItem("p", "fine", [1], {}), ScoreItem("p", "stall here", [1], {})])
        stalled = [r for r in stub.requests if r["body"]["messages"][-1]["content"] == "stall here"]
    assert out[0] == (8.0, {"judge": 4.0})  # "fine": "I'd say 4/10", weight 2
    assert isinstance(out[1], RewardError) and len(stalled) == 2  # retried once, as a 503 is
    assert str(out[1]) == (f"reward function 'judge' failed for this completion: JudgeError: no answer from {stub.url}"
                           "/chat/completions after 2 attempt(s) (timeout_s=0.5 each), the last: HTTP 503 Service "
                           "Unavailable (its body could not be read: TimeoutError: timed out)")


def test_a_pattern_with_a_group_reads_the_group(stub):
    # a reply that restates the scale before its verdict: group(0) was "Score: 8", never a number
    judge = ChatJudge(stub.url, "echo", template="{response}", pattern=r"Score:\s*(\d+)")
    assert judge(["p"], ["On a 0-10 scale. Score: 8"]) == [8.0]
    (err,) = ChatJudge(stub.url, "echo", template="{response}", pattern=r"Score:\s*(\d+)?")(["p"], ["Score: none"])
    assert str(err) == "the judge's reply 'Score: none' holds no number (pattern 'Score:\\\\s*(\\\\d+)?')"


@pytest.mark.parametrize("status", [500, 520, 524, 529])
def test_a_transient_5xx_is_retried(status):
    # Cloudflare's 520-524 and Anthropic's 529 failed at once with "check url and model"
    with ChatStub(flaky_status=status) as stub:
        assert ChatJudge(stub.url, "flaky", template="{response}", max_retries=2, backoff_s=0.01)(["p"], ["abc"]) == [3.0]
        assert len(stub.requests) == 3


@pytest.mark.parametrize("status", [400, 404, 501, 505])
def test_a_status_a_retry_cannot_change_fails_at_once(status):
    with ChatStub(flaky_status=status) as stub:
        (err,) = ChatJudge(stub.url, "flaky", template="{response}", max_retries=2, backoff_s=0.01)(["p"], ["abc"])
        assert str(err).startswith(f"{stub.url}/chat/completions answered HTTP {status} ") and len(stub.requests) == 1
        assert str(err).endswith("; check url and model")


def test_retry_after_of_an_overloaded_server_is_waited_for_up_to_max_backoff():
    with ChatStub(retry_after="1") as stub:
        judge = ChatJudge(stub.url, "flaky", template="{response}", max_retries=2, backoff_s=0.01, max_backoff_s=5.0)
        assert judge(["p"], ["abc"]) == [3.0]
        at = [r["at"] for r in stub.requests]
    assert len(at) == 3 and min(b - a for a, b in zip(at, at[1:])) >= 1.0  # not the 0.01 s and 0.02 s of backoff_s
    with ChatStub(retry_after="3600") as stub:  # an hour: capped at max_backoff_s
        judge = ChatJudge(stub.url, "flaky", template="{response}", max_retries=2, backoff_s=0.01, max_backoff_s=0.1)
        assert judge(["p"], ["abc"]) == [3.0]
