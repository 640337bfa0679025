"""Rewards that are real work, in a worker against a real redis-server and weight server: a
TRL-style batched function fed whole groups with the data columns, a reward model scored a batch
per forward pass, an LLM judge over HTTP (a stub of the chat API on loopback), a reward that
keeps timing out stopping the worker with its message, and the cost of scoring in the heartbeat.

The test plays the learner (:class:`worker_helpers.FakeLearner`), as in ``test_worker.py``.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

import reward_fns
from chat_stub import ChatStub
from rlhf_core.records import Sample
from rollout_workers.worker import RolloutWorker
from worker_helpers import FakeLearner, check_sample

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def texts_of(learner: FakeLearner, groups: list[list[Sample]]) -> dict[str, str]:
    return {s.sample_id: learner.tokenizer.decode(s.response_ids.tolist(), skip_special_tokens=True)
            for g in groups for s in g}


def test_a_trl_style_reward_scores_whole_groups_with_the_data_columns(run):
    # empty_response=score: an end-of-sequence-only response is scored too, so all 24 reach the function
    cfg, learner = run(reward__batch_size=8, reward__empty_response="score",
                       extra=["~reward.functions.count_up", "+reward.functions.len._target_=reward_fns.trl_length"])
    learner.publish(0)
    prompts = {p.prompt_id: p for p in learner.enqueue(6, tag="x")}
    reward_fns.batched_calls.clear()
    worker = RolloutWorker(cfg, "w-trl")
    stats = worker.run(max_prompts=6)
    groups = learner.read_groups(6)
    texts = texts_of(learner, groups)
    for g in groups:
        for s in g:
            check_sample(s, prompts[s.prompt_id], learner.tokenizer, 4, 8, {0})
            # 0.1 * len(completion) + the prompt's `start` column
            expected = 0.1 * len(texts[s.sample_id]) + prompts[s.prompt_id].metadata["start"]
            assert s.reward_components == {"len": pytest.approx(expected)} and s.reward == pytest.approx(expected)
    calls = reward_fns.batched_calls
    # whole groups of 4, at most reward.batch_size=8 per call, every sample scored once
    assert all(c["n"] in (4, 8) for c in calls) and sum(c["n"] for c in calls) == 24, calls
    assert all(c["columns"] == ["tag"] and all(c["ids_match"]) for c in calls)
    assert stats.reward_calls == len(calls) and stats.t_score > 0 and stats.reward_timeouts == 0
    st = learner.consumer("w-trl")["stats"]  # what the monitor, the live line and summary.json read
    assert st["reward_calls"] == len(calls) and st["reward_calls_per_s"] > 0 and 0 < st["score_share"] <= 1
    assert st["scoring_threads"] == 1


def test_a_reward_model_scores_each_batch_in_one_forward_pass(run, tiny_model_cfg, tmp_path):
    from rlhf_core.models import build_tiny_model

    rm = build_tiny_model(replace(tiny_model_cfg.tiny, seed=5), tmp_path / "rm", head="sequence")
    cfg, learner = run(reward__batch_size=8, extra=["~reward.functions.count_up", f"+reward.models.rm.path={rm}"])
    learner.publish(0)
    learner.enqueue(4)
    stats = RolloutWorker(cfg, "w-rm").run(max_prompts=4)
    groups = learner.read_groups(4)
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(rm).eval()
    worst = 0.0
    for g in groups:
        for s in g:
            # the score of prompt + response alone, unpadded, at its last token
            text = learner.tokenizer.decode(s.prompt_ids.tolist()) + texts_of(learner, [[s]])[s.sample_id]
            ids = learner.tokenizer(text, return_tensors="pt")["input_ids"]
            with torch.no_grad():
                alone = float(model(input_ids=ids).logits[0, 0])
            worst = max(worst, abs(s.reward_components["rm"] - alone))
            assert s.reward == pytest.approx(s.reward_components["rm"])
    assert worst < 1e-4
    assert 2 <= stats.reward_calls <= 4  # 16 samples in batches of up to 8: one forward pass per batch


def test_an_llm_judge_over_http_scores_a_worker_s_samples(run):
    with ChatStub() as stub:
        cfg, learner = run(extra=["~reward.functions.count_up",
                                  "+reward.functions.judge._target_=rollout_workers.rewards_remote.ChatJudge",
                                  f"+reward.functions.judge.url={stub.url}", "+reward.functions.judge.model=length",
                                  "+reward.functions.judge.template='{response}'", "+reward.functions.judge.scale=0.1"])
        learner.publish(0)
        learner.enqueue(3)
        RolloutWorker(cfg, "w-judge").run(max_prompts=3)
        groups = learner.read_groups(3)
    texts = texts_of(learner, groups)
    # the stub says "I'd say <len>/10": the first number, times scale 0.1; an empty text goes unjudged (0)
    for g in groups:
        for s in g:
            text = texts[s.sample_id]
            assert s.reward_components == ({"judge": pytest.approx(0.1 * len(text))} if text.strip() else {})
            assert s.reward == pytest.approx(0.1 * len(text) if text.strip() else 0.0)
    asked = sorted(r["body"]["messages"][-1]["content"] for r in stub.requests)
    assert asked == sorted(t for t in texts.values() if t.strip())


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_the_judge_is_asked_the_question_not_the_policy_s_rendering_of_it(run):
    # {prompt} held the chat template's rendering: role markers and special tokens as text, which a
    # judge of the policy's family reads as turn boundaries of its own
    from rlhf_core.records import Prompt

    with ChatStub() as stub:
        cfg, learner = run(reward__empty_response="score", rollout__max_prompt_tokens=128,  # the rendering's characters
                           extra=["~reward.functions.count_up",
                                  "+reward.functions.judge._target_=rollout_workers.rewards_remote.ChatJudge",
                                  f"+reward.functions.judge.url={stub.url}", "+reward.functions.judge.model=length"])
        learner.publish(0)
        learner.buffer.producer.enqueue_prompts([Prompt("text", "What is 2+2?", metadata={"start": 0}),
                                                 Prompt("chat", "", [{"role": "system", "content": "Be brief."},
                                                                     {"role": "user", "content": "What is 3+3?"}], {"start": 0})])
        worker = RolloutWorker(cfg, "w-judge-question")
        worker.tokenizer.chat_template = CHATML  # what an instruct policy's tokenizer carries
        worker.run(max_prompts=2)
        asked = [r["body"]["messages"][-1]["content"] for r in stub.requests]
    assert len(asked) == 8, asked  # 2 prompts x 4 responses, empty ones judged too (empty_response=score)
    questions = sorted(text.split("Question:\n", 1)[1].split("\n\nAnswer:", 1)[0] for text in asked)
    assert questions == ["What is 2+2?"] * 4 + ["What is 3+3?"] * 4


def silent_state(learner: FakeLearner) -> dict[str, torch.Tensor]:
    """Weights under which the tiny policy answers end-of-sequence at once: the residual stream is
    the input embedding (all ones), and the output head sees only the end-of-sequence row."""
    state = {k: v.detach().clone() for k, v in learner.base.state_dict().items()}
    for k, v in state.items():
        if k.endswith(("o_proj.weight", "down_proj.weight")):
            v.zero_()
    state["model.embed_tokens.weight"].fill_(1.0)
    state["model.norm.weight"].fill_(1.0)
    state["lm_head.weight"].zero_()
    state["lm_head.weight"][learner.tokenizer.eos_token_id] = 1.0  # eos logit 64, every other 0
    return state


def test_empty_responses_dead_lettered_by_choice_do_not_stop_the_worker_as_a_failing_reward(run):
    # each counted as a reward failure: a policy that mostly answers nothing stopped the worker
    # (exit 2) with "Fix the reward function"
    cfg, learner = run(reward__empty_response="dead_letter", reward__failure_window=8,
                       extra=["~reward.functions.count_up", "+reward.functions.c._target_=reward_fns.constant"])
    learner.publisher.publish(0, silent_state(learner))
    learner.enqueue(4)
    stats = RolloutWorker(cfg, "w-silent").run(max_prompts=4)
    assert (stats.empty_responses, stats.dead_letters) == (16, 16)
    dead = learner.buffer.monitor.dead_letters(20)
    assert len(dead) == 16 and all("reward.empty_response=dead_letter" in d["reason"] for d in dead)


def test_a_reward_that_keeps_timing_out_stops_the_worker_with_that_message(run):
    from rollout_workers.rewards import RewardFailing

    cfg, learner = run(reward__timeout_s=0.2, reward__failure_window=8, reward__batch_size=4,
                       extra=["~reward.functions.count_up", "+reward.functions.slow._target_=reward_fns.slow",
                              "+reward.functions.slow.delay_s=1.0"])
    learner.publish(0)
    learner.enqueue(6)
    with pytest.raises(RewardFailing) as err:
        RolloutWorker(cfg, "w-slow").run(max_prompts=6)
    timeout = ("reward function 'slow' did not return within reward.timeout_s=0.2 s (a batch of 4 sample(s)); the call "
               "was abandoned and runs on in the background")
    assert "8 of the last 8 samples could not be scored" in str(err.value) and timeout in str(err.value)
    dead = learner.buffer.monitor.dead_letters(20)
    assert len(dead) == 8 and all(d["reason"].startswith(timeout) for d in dead)
    assert all(np.isnan(Sample.decode(d["raw"]).reward) for d in dead)
    c = learner.counters()
    assert (c["samples_dead_lettered"], c["samples_appended"]) == (8, 0)
    assert learner.consumer("w-slow")["stats"]["reward_timeouts"] == 2


def test_the_evaluator_holds_a_hanging_reward_to_reward_timeout_s(run, tmp_path):
    # it called score_batch on its main thread without a limit: a hanging reward hung the
    # evaluation, and a stop request waited for it forever
    from rollout_workers.evaluator import Evaluator

    gate = tmp_path / "gate"
    gate.touch()  # reward_fns.gate with free=0: every call waits while the file exists
    cfg, learner = run(reward__timeout_s=0.5, reward__empty_response="score", eval__every=1, eval__num_prompts=2,
                       eval__n=2, eval__k="[1]",
                       extra=["~reward.functions.count_up", "+reward.functions.gate._target_=reward_fns.gate",
                              f"+reward.functions.gate.path='{gate}'", "+reward.functions.gate.free=0"])
    evaluator = Evaluator(cfg, buffer=learner.buffer.monitor, output_dir=tmp_path)
    try:
        metrics = evaluator.evaluate()
    finally:
        gate.unlink()
        evaluator.close()
    assert (metrics["eval/samples"], metrics["eval/failed"]) == (4, 4)  # 2 prompts x 2, each call abandoned
