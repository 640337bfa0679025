"""The `hf` engine with the tiny model: behaviour log-prob parity, continuous batching, stops,
in-flight weight updates, aborts. No servers; each test runs a few dozen tiny decoding steps."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_helpers import ids, recompute
from rlhf_core.config import Config, ConfigError
from rlhf_core.models import load_policy, load_tokenizer
from rollout_workers.engine import (
    EngineError,
    GenerationEngine,
    GenRequest,
    GenResult,
    RequestError,
    SamplingParams,
)
from rollout_workers.engine_factory import make_engine
from rollout_workers.hf_engine import HFEngine

PARITY_ATOL = 1e-4


@pytest.fixture(scope="module")
def tokenizer(tiny_model_cfg):
    return load_tokenizer(tiny_model_cfg)


@pytest.fixture(scope="module")
def policy(tiny_model_cfg):
    return load_policy(tiny_model_cfg).eval()


@pytest.fixture
def fresh_policy(tiny_model_cfg):
    """A private copy for tests that change weights or configs."""
    return load_policy(tiny_model_cfg).eval()


def run(engine: HFEngine) -> tuple[dict[str, GenResult], dict[str, int]]:
    """Step until idle; results by id and the step (1-based) each finished in."""
    results, finished_at = {}, {}
    while engine.has_work():
        for r in engine.step():
            results[r.request_id] = r
            finished_at[r.request_id] = engine.num_steps
        assert engine.num_steps < 1000
    return results, finished_at


PROMPTS = ["h", "hello world", "ab", "the quick brown fox jumps over the lazy dog, twice over", "xyz", "a b c d e f"]


def submit_parity_workload(engine, tokenizer, params_for):
    # Prompt lengths 1..56 and response lengths 4..29 in 3 slots: rows are refilled while others
    # run, a length-1 prompt is admitted with nothing to prefill, and the 56-token prompt arrives
    # when the batch cache is narrower than it (the cache grows on the left).
    for i, text in enumerate(PROMPTS):
        engine.add(GenRequest(f"r{i}", ids(engine.tokenizer, text), params_for(i)))


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_logprob_parity_with_a_plain_forward_pass(fresh_policy, tokenizer, attn):
    fresh_policy.set_attn_implementation(attn)
    engine = HFEngine(fresh_policy, tokenizer, slots=3, seed=1)
    params = {i: SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_new_tokens=4 + 5 * i, ignore_eos=True) for i in range(6)}
    submit_parity_workload(engine, tokenizer, params.__getitem__)
    results, finished_at = run(engine)
    assert sorted(results) == [f"r{i}" for i in range(6)]
    assert engine.num_prefills >= 3  # admissions happened at several different steps
    worst = 0.0
    for i in range(6):
        r = results[f"r{i}"]
        assert r.finish_reason == "length" and r.num_tokens == 4 + 5 * i
        assert r.token_ids.dtype == np.int32 and r.logprobs.dtype == np.float32 and r.versions.dtype == np.int64
        assert (r.logprobs <= 0).all() and np.isfinite(r.logprobs).all()
        assert r.text == tokenizer.decode(r.token_ids.tolist(), skip_special_tokens=True)
        ref = recompute(fresh_policy, r, params[i])
        worst = max(worst, float(np.abs(ref - r.logprobs).max()))
    assert worst < PARITY_ATOL, f"behaviour log-probs differ from the recomputation by {worst}"


def tiny_qwen2(vocab_size: int) -> torch.nn.Module:
    """A Qwen2 causal LM of the tiny model's size: biased q/k/v projections, 2 K/V heads for 4."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = Qwen2ForCausalLM(config).eval()
    for layer in model.model.layers:  # transformers zero-initialises biases: make them count
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
            torch.nn.init.normal_(proj.bias, std=0.5)
    return model


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_direct_forward_computes_what_the_models_own_forward_does(fresh_policy, tokenizer, arch):
    # The engine runs Llama and Qwen2 models through slot_kv.direct_forward (their modules, in
    # their order, without their forward's wrapping). The same workload with the model's own
    # forward (slot attention plugged in) must give the same tokens and log-probs, bit for bit:
    # the same operations on the same inputs in the same order.
    model = fresh_policy if arch == "llama" else tiny_qwen2(len(tokenizer))
    params = {i: SamplingParams(temperature=0.8, top_k=20, max_new_tokens=4 + 5 * i, ignore_eos=True) for i in range(6)}
    results = {}
    for direct in (True, False):
        engine = HFEngine(model, tokenizer, slots=3, seed=1)
        assert engine._direct
        engine._direct = direct
        submit_parity_workload(engine, tokenizer, params.__getitem__)
        results[direct] = run(engine)[0]
    for i in range(6):
        a, b = results[True][f"r{i}"], results[False][f"r{i}"]
        assert a.num_tokens == 4 + 5 * i
        assert a.token_ids.tolist() == b.token_ids.tolist()
        assert a.logprobs.tolist() == b.logprobs.tolist()


def test_models_the_direct_forward_does_not_know_run_their_own_forward(fresh_policy, tokenizer):
    from transformers import LlamaForCausalLM

    from rollout_workers.slot_kv import direct_forward_supported

    class Custom(LlamaForCausalLM):  # a subclass may change the forward pass
        pass

    assert direct_forward_supported(fresh_policy)
    assert not direct_forward_supported(Custom(fresh_policy.config))
    same_name = type("LlamaForCausalLM", (LlamaForCausalLM,), {})  # a user's class, named as the library's
    assert not direct_forward_supported(same_name(fresh_policy.config))
    windowed = tiny_qwen2(len(tokenizer))
    windowed.model.layers[1].self_attn.sliding_window = 16
    assert not direct_forward_supported(windowed)
    assert not HFEngine(Custom(fresh_policy.config).eval(), tokenizer, slots=2)._direct


def other_families(vocab_size: int) -> dict[str, torch.nn.Module]:
    """Causal LMs of other families, 2 layers of 64 wide: whose attention transformers dispatches
    through its attention interface (StableLm, GPT-2) or not (the rest: their own eager attention
    code; Bloom's breaks on the slot cache), and one with multi-head latent attention (DeepSeek-V3:
    keys and values of other widths than its head_dim)."""
    import transformers as T

    v = vocab_size
    configs = {
        "stablelm": lambda: T.StableLmForCausalLM(T.StableLmConfig(vocab_size=v, hidden_size=64, intermediate_size=128,
                                                                  num_hidden_layers=2, num_attention_heads=4,
                                                                  num_key_value_heads=2)),
        "gpt2": lambda: T.GPT2LMHeadModel(T.GPT2Config(vocab_size=v, n_embd=64, n_layer=2, n_head=4, n_positions=256)),
        "falcon": lambda: T.FalconForCausalLM(T.FalconConfig(vocab_size=v, hidden_size=64, num_hidden_layers=2,
                                                             num_attention_heads=4)),
        "gptj": lambda: T.GPTJForCausalLM(T.GPTJConfig(vocab_size=v, n_embd=64, n_layer=2, n_head=4, rotary_dim=8,
                                                       n_positions=256)),
        "codegen": lambda: T.CodeGenForCausalLM(T.CodeGenConfig(vocab_size=v, n_embd=64, n_layer=2, n_head=4,
                                                                rotary_dim=8, n_positions=256)),
        "mpt": lambda: T.MptForCausalLM(T.MptConfig(vocab_size=v, d_model=64, n_layers=2, n_heads=4, max_seq_len=256)),
        "gptneo": lambda: T.GPTNeoForCausalLM(T.GPTNeoConfig(vocab_size=v, hidden_size=64, num_layers=2, num_heads=4,
                                                             attention_types=[[["global"], 2]],
                                                             max_position_embeddings=256)),
        "bloom": lambda: T.BloomForCausalLM(T.BloomConfig(vocab_size=v, hidden_size=64, n_layer=2, n_head=4)),
        "deepseek_v3": lambda: T.DeepseekV3ForCausalLM(T.DeepseekV3Config(
            vocab_size=v, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, max_position_embeddings=256, q_lora_rank=None, kv_lora_rank=16,
            qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, moe_intermediate_size=32, n_routed_experts=4,
            num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1)),
    }
    return configs


@pytest.mark.parametrize("family", ["stablelm", "gpt2"])
def test_other_families_whose_attention_takes_the_slot_attention_match_a_plain_forward_pass(tokenizer, family):
    # StableLm does not declare transformers' attention-backend support, yet dispatches through
    # it: the engine's probe (slot attention ran once per layer) lets it in, and it computes right.
    torch.manual_seed(0)
    model = other_families(len(tokenizer))[family]().eval()
    with torch.no_grad():  # make the attention matter
        for p in model.parameters():
            p.mul_(10.0) if p.ndim > 1 else None
    engine = HFEngine(model, tokenizer, slots=2, seed=0, max_model_len=100)
    assert not engine._direct
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    engine.add(GenRequest("a", list(range(3, 30)), params))
    engine.add(GenRequest("b", [5, 6, 7], params))
    for r in run(engine)[0].values():
        np.testing.assert_allclose(r.logprobs, recompute(model, r, params), rtol=0, atol=PARITY_ATOL, err_msg=r.request_id)


@pytest.mark.parametrize("family", ["falcon", "gptj", "codegen", "mpt", "gptneo", "bloom", "deepseek_v3"])
def test_models_whose_attention_the_slot_cache_cannot_serve_are_refused_at_start(tokenizer, family):
    # Their own attention code never calls the plugged-in slot attention: it would add the engine's
    # boolean mask to the scores (True = +1: nothing masked, a slot's stale columns read) and give
    # log-probs 0.4-3.4 nats off (Bloom's and DeepSeek-V3's crash on the first prefill instead).
    # A one-token probe at construction tells them apart and says what to use instead.
    torch.manual_seed(0)
    model = other_families(len(tokenizer))[family]().eval()
    with pytest.raises(EngineError, match=r"(?s)cannot run .*ForCausalLM.*rollout\.engine=vllm"):
        HFEngine(model, tokenizer, slots=2, max_model_len=100)


def left_padded_prefill(model, tokenizer, **engine_kwargs) -> None:
    """A long and a short prompt admitted together (one prefill pass: the short row left-padded)
    give the log-probs of a plain forward pass."""
    engine = HFEngine(model, tokenizer, slots=2, seed=0, **engine_kwargs)
    params = SamplingParams(max_new_tokens=5, ignore_eos=True)
    engine.add(GenRequest("long", list(range(3, 90)), params))
    engine.add(GenRequest("short", [5, 6, 7], params))
    results = run(engine)[0]
    assert engine.num_prefills == 1 and sorted(results) == ["long", "short"]
    for r in results.values():
        np.testing.assert_allclose(r.logprobs, recompute(model, r, params), rtol=0, atol=PARITY_ATOL, err_msg=r.request_id)


def test_padding_is_embedded_at_a_position_the_model_has(tokenizer):
    # Padding writes the cache's scratch column (319 here: round_up(256 + 1, 64) - 1), past the
    # model's context when the engine's is the model's whole context (the default). It used to be
    # fed at that position too: GPT-2's learned position table (256 rows) raised IndexError.
    torch.manual_seed(0)
    model = other_families(len(tokenizer))["gpt2"]().eval()
    left_padded_prefill(model, tokenizer)


@pytest.mark.parametrize("rope", [
    {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0},
    {"rope_type": "longrope", "rope_theta": 10000.0, "factor": 2.0, "original_max_position_embeddings": 128,
     "short_factor": [1.0] * 8, "long_factor": [4.0] * 8},
])
def test_rope_scaled_by_the_longest_position_sees_only_real_positions(tokenizer, rope):
    # Dynamic and LongRoPE rotary embeddings size their frequencies from max(position_ids) of the
    # pass: a pad at the scratch column (319 > 256, 128) rescaled the real tokens' rotations too,
    # 3.5-4.4 nats off.
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         rope_parameters=rope, initializer_range=0.2)
    left_padded_prefill(LlamaForCausalLM(config).eval(), tokenizer)


def reference_decode(models, result: GenResult, params: SamplingParams) -> tuple[list[int], np.ndarray]:
    """Batch-1 incremental decoding with a DynamicCache: no slots, no padding, no batching. The
    input that predicts token t is fed with the weights of ``versions[t]`` (the engine's in-flight
    update: columns already cached keep the K/V of the weights that wrote them), and the prompt's
    prefill with ``versions[0]``. Returns each step's argmax of the processed distribution and the
    log-probs of the engine's tokens."""
    from transformers import DynamicCache

    from rlhf_core.sampling import process_logits, token_logprobs

    prompt, tokens, versions = result.prompt_ids.tolist(), result.token_ids.tolist(), result.versions.tolist()
    cache = DynamicCache(config=models[0].config)
    argmax, logps = [], []
    with torch.no_grad():
        if len(prompt) > 1:
            models[versions[0]](input_ids=torch.tensor([prompt[:-1]]), past_key_values=cache, use_cache=True)
        for t, (x, v) in enumerate(zip([prompt[-1]] + tokens[:-1], versions)):
            logits = models[v](input_ids=torch.tensor([[x]]), past_key_values=cache, use_cache=True).logits[:, -1]
            processed = process_logits(logits, params.temperature, params.top_k, params.top_p)
            argmax.append(int(processed.argmax()))
            logps.append(float(token_logprobs(processed, torch.tensor([tokens[t]]))[0]))
    return argmax, np.array(logps, dtype=np.float32)


@pytest.mark.parametrize("prefill_chunk", [4096, 7])
def test_tokens_and_logprobs_match_an_unbatched_reference_across_admissions_aborts_and_updates(
        fresh_policy, tokenizer, prefill_chunk):
    # 3 slots, 7 requests: rows are refilled while others run; with prefill_chunk=7 the 56-token
    # prompt is prefilled over 8 steps while the other slots keep decoding. Even requests decode
    # greedily (tokens comparable with the reference), odd ones sample with every filter on.
    import copy

    v0 = copy.deepcopy(fresh_policy)
    v1 = copy.deepcopy(fresh_policy)
    with torch.no_grad():
        for p in v1.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    engine = HFEngine(fresh_policy, tokenizer, slots=3, seed=5, prefill_chunk=prefill_chunk)
    params = {i: SamplingParams(temperature=0.0, max_new_tokens=4 + 5 * i, ignore_eos=True) if i % 2 == 0 else
              SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_new_tokens=4 + 5 * i, ignore_eos=True)
              for i in range(7)}
    for i, text in enumerate(PROMPTS + ["late arrival"]):
        engine.add(GenRequest(f"r{i}", ids(tokenizer, text), params[i]))
    results = {}
    for _ in range(3):
        results.update({r.request_id: r for r in engine.step()})
    results["r1"] = engine.abort("r1")  # running: its slot goes to the next request
    results["r6"] = engine.abort("r6")  # still waiting
    # The update lands between steps when no prompt is half-prefilled, so each prompt's columns
    # come from one weight version (the reference prefills a prompt in one pass).
    while any(not s.prefilled for s in engine._running):
        results.update({r.request_id: r for r in engine.step()})
    unfinished = set(engine._known)
    engine.update_weights(dict(v1.state_dict()), version=1)
    more, _ = run(engine)
    results.update(more)
    assert results["r6"].num_tokens == 0 and results["r1"].finish_reason == "abort"
    assert len(unfinished) >= 4 and {results[i].versions[-1] for i in unfinished} == {1}  # all saw the update
    assert any(r.versions[0] == 0 for r in results.values() if r.num_tokens)  # ... and some started before it
    for i in range(6):
        r = results[f"r{i}"]
        argmax, logps = reference_decode({0: v0, 1: v1}, r, params[i])
        if params[i].temperature == 0:
            assert r.token_ids.tolist() == argmax, f"r{i}"
        np.testing.assert_allclose(r.logprobs, logps, rtol=0, atol=PARITY_ATOL, err_msg=f"r{i}")


def test_logprob_parity_with_different_settings_per_row(policy, tokenizer):
    # Rows with different temperature / top-k / top-p decode in the same step (the per-row tensor path).
    settings = [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.2, 0, 0.8), (0.9, 30, 0.95), (0.5, 0, 1.0), (1.0, 3, 0.5)]
    params = {i: SamplingParams(temperature=t, top_k=k, top_p=p, max_new_tokens=12, ignore_eos=True)
              for i, (t, k, p) in enumerate(settings)}
    engine = HFEngine(policy, tokenizer, slots=4, seed=3)
    submit_parity_workload(engine, tokenizer, params.__getitem__)
    results, _ = run(engine)
    for i in range(6):
        r = results[f"r{i}"]
        assert r.num_tokens == 12
        np.testing.assert_allclose(r.logprobs, recompute(policy, r, params[i]), rtol=0, atol=PARITY_ATOL)


def test_greedy_matches_model_generate_and_has_logprob_zero(policy, tokenizer):
    prompt = ids(tokenizer, "hello there")
    engine = HFEngine(policy, tokenizer, slots=2)
    engine.add(GenRequest("g", prompt, SamplingParams(temperature=0.0, max_new_tokens=15, ignore_eos=True)))
    engine.add(GenRequest("other", ids(tokenizer, "zz"), SamplingParams(max_new_tokens=7, ignore_eos=True)))
    results, _ = run(engine)
    with torch.no_grad():
        ref = policy.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=15, eos_token_id=None,
                              pad_token_id=tokenizer.pad_token_id)
    assert results["g"].token_ids.tolist() == ref[0, len(prompt):].tolist()
    assert results["g"].logprobs.tolist() == [0.0] * 15


def test_same_seed_same_tokens(policy, tokenizer):
    def once():
        engine = HFEngine(policy, tokenizer, slots=2, seed=7)
        for i in range(3):
            engine.add(GenRequest(f"s{i}", ids(tokenizer, f"prompt {i}"), SamplingParams(max_new_tokens=9, ignore_eos=True)))
        return {k: v.token_ids.tolist() for k, v in run(engine)[0].items()}

    first, second = once(), once()
    assert first == second
    assert first["s0"] != first["s1"]  # different prompts, different samples


def test_a_freed_slot_is_refilled_while_a_long_sequence_keeps_running(policy, tokenizer):
    engine = HFEngine(policy, tokenizer, slots=2)
    fixed = lambda n: SamplingParams(max_new_tokens=n, ignore_eos=True)  # noqa: E731
    engine.add(GenRequest("long", ids(tokenizer, "long one"), fixed(12)))
    for name in ("s1", "s2", "s3"):
        engine.add(GenRequest(name, ids(tokenizer, name), fixed(3)))
    engine.step()
    assert (engine.num_active(), engine.num_waiting()) == (2, 2)
    results, finished_at = run(engine)
    # A sequence's first token comes from its prefill, its second from the same step's decoding
    # pass: s1 runs steps 1-2, s2 takes its slot for 3-4, s3 for 5-6, while "long" runs 1-11.
    assert finished_at == {"s1": 2, "s2": 4, "s3": 6, "long": 11}
    assert engine.num_steps == 11  # static batches of 2 would need 11 + 2 = 13 steps
    assert {k: r.num_tokens for k, r in results.items()} == {"long": 12, "s1": 3, "s2": 3, "s3": 3}


def test_running_sequences_move_down_into_freed_slots_and_keep_their_logprobs(policy, tokenizer):
    # 4 slots: a (3 tokens) ends early with nothing waiting, so the highest running sequence
    # moves down into its slot (K/V columns copied) and decoding reads rows 0..n-1; late arrives
    # mid-run and takes the lowest free slot, above the running ones. Every token's log-prob
    # is still that of one plain forward pass over prompt + response.
    engine = HFEngine(policy, tokenizer, slots=4, seed=3)
    params = {"a": 3, "b": 14, "c": 5, "d": 12, "late": 6}
    sp = {k: SamplingParams(temperature=0.9, max_new_tokens=n, ignore_eos=True) for k, n in params.items()}
    for name in ("a", "b", "c", "d"):
        engine.add(GenRequest(name, ids(tokenizer, f"prompt {name} " * (1 + len(name))), sp[name]))
    slots, results = [], {}
    while engine.has_work():
        if engine.num_steps == 4:
            engine.add(GenRequest("late", ids(tokenizer, "a late one"), sp["late"]))
        results.update((r.request_id, r) for r in engine.step())
        slots.append({s.request.request_id: s.slot for s in engine._running if not s.done})
    # (an n-token response ends at step n - 1: its first two tokens come from one step)
    assert slots[2] == {"b": 1, "c": 2, "d": 0}  # a ended at step 2: d moved from slot 3 to 0
    assert slots[4] == {"b": 1, "d": 0, "late": 2}  # c ended at step 4; late took the lowest free slot
    assert slots[10:12] == [{"b": 1}, {"b": 0}]  # d and late ended: b moved down too
    for name, n in params.items():
        r = results[name]
        assert r.num_tokens == n
        np.testing.assert_allclose(r.logprobs, recompute(policy, r, sp[name]), rtol=0, atol=PARITY_ATOL)


def next_turn(tokenizer, r: GenResult, text: str) -> list[int]:
    """An agent's next prompt: the last one, the reply as sampled, then what it adds."""
    return [*r.prompt_ids.tolist(), *r.token_ids.tolist(), *ids(tokenizer, text)]


def test_a_prompt_extending_a_finished_sequence_prefills_only_its_new_tokens(policy, tokenizer):
    # Two conversations of three turns in 2 slots; each turn's prompt is the last prompt, the
    # reply and a user message. The K/V its slot kept covers all but the reply's last token (never
    # fed), so a turn prefills that token and the message: reused = len(last prompt) + reply - 1.
    # The log-probs are still those of one plain forward pass over prompt + response.
    engine = HFEngine(policy, tokenizer, slots=2, seed=7)
    sp = SamplingParams(temperature=0.9, max_new_tokens=6, ignore_eos=True)
    last = {}
    for name in ("a", "b"):
        engine.add(GenRequest(f"{name}0", ids(tokenizer, f"start {name}"), sp))
    last.update(run(engine)[0])
    for turn in (1, 2):
        expected = 0
        for name in ("a", "b"):
            prev = last[f"{name}{turn - 1}"]
            expected += prev.num_tokens + len(prev.prompt_ids) - 1
            engine.add(GenRequest(f"{name}{turn}", next_turn(tokenizer, prev, " go on"), sp))
        before = engine.num_reused_tokens
        last.update(run(engine)[0])
        assert engine.num_reused_tokens - before == expected
    for r in last.values():
        np.testing.assert_allclose(r.logprobs, recompute(policy, r, sp), rtol=0, atol=PARITY_ATOL, err_msg=r.request_id)


def test_parked_k_v_survives_packing_and_slot_pressure(fresh_policy, tokenizer):
    # 4 slots, 3 requests. "a" ends first: its slot 0 is parked and the highest running sequence
    # moves down into it, a's K/V moving up in exchange. A newcomer with an unrelated prompt takes
    # the free slot 3, not the parked one; a's next turn then finds a's K/V where it went.
    engine = HFEngine(fresh_policy, tokenizer, slots=4, seed=11)
    fixed = lambda n: SamplingParams(temperature=0.9, max_new_tokens=n, ignore_eos=True)  # noqa: E731
    for name, n in (("a", 3), ("b", 12), ("c", 12)):
        engine.add(GenRequest(name, ids(tokenizer, f"prompt {name}"), fixed(n)))
    results = {}
    while "a" not in results:
        results.update((r.request_id, r) for r in engine.step())
    engine.step()
    assert {s.request.request_id: s.slot for s in engine._running} == {"b": 1, "c": 0}
    assert list(engine._parked) == [2]  # a's K/V, moved up from slot 0
    a = results["a"]
    engine.add(GenRequest("other", ids(tokenizer, "unrelated"), fixed(4)))
    engine.add(GenRequest("a1", next_turn(tokenizer, a, " more"), fixed(5)))
    more, _ = run(engine)
    assert engine.num_reused_tokens == len(a.prompt_ids) + a.num_tokens - 1
    for r in (*more.values(), a):
        np.testing.assert_allclose(r.logprobs, recompute(fresh_policy, r, SamplingParams(temperature=0.9)), rtol=0,
                                   atol=PARITY_ATOL, err_msg=r.request_id)
    # After a weight update a request that does not say how old its conversation's tokens are
    # (min_kv_version None) reuses nothing the old weights wrote: prefilled whole, with the new ones.
    engine.update_weights(None, version=1)
    engine.add(GenRequest("a2", next_turn(tokenizer, more["a1"], " again"), fixed(3)))
    a2 = run(engine)[0]["a2"]
    assert engine.num_reused_tokens == len(a.prompt_ids) + a.num_tokens - 1  # unchanged
    np.testing.assert_allclose(a2.logprobs, recompute(fresh_policy, a2, SamplingParams(temperature=0.9)), rtol=0,
                               atol=PARITY_ATOL)


def test_relocate_applies_a_packings_moves_and_swaps_at_once(policy):
    from rollout_workers.slot_kv import SlotKVCache

    cache = SlotKVCache(policy.config, slots=6, max_len=8, dtype=torch.float32, device=torch.device("cpu"))
    for t in (*cache.keys, *cache.values):  # slot s, column c holds 1000 * s + c everywhere
        t.copy_((1000 * torch.arange(6)[:, None, None, None] + torch.arange(t.shape[2])[None, None, :, None]).expand_as(t))
    before = [t.clone() for t in (*cache.keys, *cache.values)]
    # as a packing makes them: running slot 5 moves down into free slot 0 (3 columns); running slot 4
    # and parked slot 1 exchange (4 and 2 columns)
    cache.relocate(moves=[(5, 0, 3)], swaps=[(4, 1, 4, 2)])
    for t, old in zip((*cache.keys, *cache.values), before):
        assert torch.equal(t[0, :, :3], old[5, :, :3])  # the moved sequence's K/V
        assert torch.equal(t[1, :, :4], old[4, :, :4])  # the swapped running sequence's, in the parked slot
        assert torch.equal(t[4, :, :2], old[1, :, :2])  # the parked K/V, where the running one was
        assert torch.equal(t[2:4], old[2:4])  # other slots untouched
        assert torch.equal(t[5], old[5])  # a move's source keeps its bytes (it is free now)


def test_k_v_of_older_weights_is_reused_only_by_conversations_as_old(fresh_policy, tokenizer):
    # "done" ends before the update but is released (parked) only at the next step, after it;
    # "across" runs through the update (in flight: its K/V mixes both weights). Both are parked
    # as written by version 0, the oldest that wrote any of their K/V.
    engine = HFEngine(fresh_policy, tokenizer, slots=4, seed=2)
    sp = lambda n: SamplingParams(max_new_tokens=n, ignore_eos=True)  # noqa: E731
    engine.add(GenRequest("done", ids(tokenizer, "first one"), sp(2)))
    engine.add(GenRequest("across", ids(tokenizer, "second one"), sp(6)))
    results = {}
    while "done" not in results:
        results.update((r.request_id, r) for r in engine.step())
    engine.update_weights(None, version=1)
    results.update(run(engine)[0])
    done, across = results["done"], results["across"]
    assert done.versions.tolist() == [0, 0] and across.versions.min() == 0 and across.versions.max() == 1
    # Next turns first by requests that say nothing of their tokens (a new prompt: only version
    # 1's K/V would do) or whose tokens are all version 1: prefilled whole, each into a free slot,
    # and the parked K/V stays.
    engine.add(GenRequest("new", next_turn(tokenizer, done, " then"), sp(2)))
    engine.add(GenRequest("young", next_turn(tokenizer, across, " then"), sp(2), min_kv_version=1))
    first = run(engine)[0]
    assert engine.num_reused_tokens == 0 and len(engine._parked) == 2
    # Then as the conversations' next turns: their oldest token is version 0, the version their
    # staleness counts from, so version 0's K/V hides nothing and is reused.
    engine.add(GenRequest("d1", next_turn(tokenizer, done, " on"), sp(2), min_kv_version=done.versions.min()))
    engine.add(GenRequest("a1", next_turn(tokenizer, across, " on"), sp(2), min_kv_version=across.versions.min()))
    out = run(engine)[0]
    reused = len(done.prompt_ids) + done.num_tokens - 1 + len(across.prompt_ids) + across.num_tokens - 1
    assert engine.num_reused_tokens == reused
    assert engine.num_prompt_tokens == sum(len(r.prompt_ids) for r in (done, across, *first.values(), *out.values()))
    # the weights did not change (update_weights(None)): the reused K/V gives the log-probs of one pass
    for r in out.values():
        np.testing.assert_allclose(r.logprobs, recompute(fresh_policy, r, sp(2)), rtol=0, atol=PARITY_ATOL)
        # every token says the weights that sampled it: their conversation counts its staleness
        # from version 0 already (min_kv_version), the K/V's version hides nothing
        assert r.versions.tolist() == [1, 1]
    # d1 and a1 parked again, still as version 0's. New weights under a number not above the last
    # (a reload) leave no version to tell K/V apart by: every parked slot is dropped.
    engine.step()
    assert sorted(kv for _, kv, _ in engine._parked.values()) == [0, 0, 1, 1]
    engine.update_weights({k: v.clone() for k, v in fresh_policy.state_dict().items()}, version=1)
    assert not engine._parked and sorted(engine._free) == [0, 1, 2, 3]


def test_a_conversation_older_than_the_engine_reuses_only_k_v_as_new_as_the_engine(fresh_policy, tokenizer):
    # A worker whose weights lag behind the conversation's (an earlier turn ran on another worker at
    # version 3): the turn's tokens will say version 1, the engine's, so K/V of version 1 may serve it.
    engine = HFEngine(fresh_policy, tokenizer, slots=2, seed=4)
    engine.update_weights(None, version=1)
    sp = SamplingParams(max_new_tokens=3, ignore_eos=True)
    engine.add(GenRequest("t0", ids(tokenizer, "hello there"), sp))
    t0 = run(engine)[0]["t0"]
    engine.add(GenRequest("t1", next_turn(tokenizer, t0, " on"), sp, min_kv_version=3))
    t1 = run(engine)[0]["t1"]
    assert engine.num_reused_tokens == len(t0.prompt_ids) + t0.num_tokens - 1
    assert t1.versions.tolist() == [1, 1, 1]


def test_a_groups_next_sample_leaves_a_parked_conversation_alone_while_a_slot_is_free(policy, tokenizer):
    # "sibling" has a's prompt (a group's next sample admitted later). Taking a's parked slot would
    # save prefilling its prompt but lose the rest of a's K/V, which a's next turn needs: with a
    # slot free it takes that one; with none free, a's slot (reusing all but the prompt's last token).
    sp = SamplingParams(max_new_tokens=3, ignore_eos=True)
    prompt = ids(tokenizer, "the same prompt")
    for slots, sibling_reuses in ((1, len(prompt) - 1), (2, 0)):
        engine = HFEngine(policy, tokenizer, slots=slots, seed=3)
        engine.add(GenRequest("a", prompt, sp))
        a = run(engine)[0]["a"]
        engine.add(GenRequest("sibling", prompt, sp))  # a's slot is parked at this step
        run(engine)
        assert engine.num_reused_tokens == sibling_reuses, slots
    # (2 slots) a's K/V is still parked for a's next turn
    engine.add(GenRequest("a1", next_turn(tokenizer, a, " on"), sp, min_kv_version=0))
    run(engine)
    assert engine.num_reused_tokens == len(prompt) + a.num_tokens - 1


def test_with_no_free_slot_a_newcomer_takes_the_least_recently_parked(policy, tokenizer):
    engine = HFEngine(policy, tokenizer, slots=2, seed=1)
    sp = SamplingParams(max_new_tokens=3, ignore_eos=True)
    done = {}
    for name in ("p", "q"):  # p is parked first, then q
        engine.add(GenRequest(name, ids(tokenizer, f"session {name}"), sp))
        done.update(run(engine)[0])
    engine.step()  # a finished sequence's slot is released (here: parked) at the next step
    assert not engine._free and len(engine._parked) == 2
    engine.add(GenRequest("r", ids(tokenizer, "unrelated"), sp))  # takes p's slot
    engine.add(GenRequest("q1", next_turn(tokenizer, done["q"], " on"), sp))
    run(engine)
    q = done["q"]
    assert engine.num_reused_tokens == len(q.prompt_ids) + q.num_tokens - 1
    engine.add(GenRequest("p1", next_turn(tokenizer, done["p"], " on"), sp))
    run(engine)
    assert engine.num_reused_tokens == len(q.prompt_ids) + q.num_tokens - 1  # p's K/V was gone


def test_versions_change_exactly_at_the_update_step(fresh_policy, tokenizer):
    engine = HFEngine(fresh_policy, tokenizer, slots=2)
    engine.add(GenRequest("a", ids(tokenizer, "first"), SamplingParams(max_new_tokens=10, ignore_eos=True)))
    engine.add(GenRequest("b", ids(tokenizer, "second prompt"), SamplingParams(max_new_tokens=6, ignore_eos=True)))
    engine.add(GenRequest("c", ids(tokenizer, "third"), SamplingParams(max_new_tokens=3, ignore_eos=True)))
    for _ in range(4):
        assert engine.step() == []
    # In-place pull: the weight client copies into weights_target(), then announces the version.
    target = engine.weights_target()
    assert target is fresh_policy
    with torch.no_grad():
        target.lm_head.weight.mul_(0.5)
    engine.update_weights(None, version=1)
    assert engine.version == 1
    results, _ = run(engine)
    # 4 steps: the prefill's token and one per decoding pass
    assert results["a"].versions.tolist() == [0] * 5 + [1] * 5
    assert results["b"].versions.tolist() == [0] * 5 + [1] * 1
    assert results["c"].versions.tolist() == [1] * 3  # admitted after the update


def test_a_prompt_prefilled_across_an_update_keeps_the_version_it_was_admitted_at(fresh_policy, tokenizer):
    # 40 prompt tokens in chunks of 8: version 0 writes the first 8 columns, version 1 the rest and
    # samples every token. Stamped with version 1 alone, the sample would hide version 0's part of
    # its context (staleness counts from the oldest token): its first token says version 0, the
    # version at its admission (over-counted by that one token, never under), the rest the
    # version that sampled them.
    engine = HFEngine(fresh_policy, tokenizer, slots=2, prefill_chunk=8)
    engine.add(GenRequest("p", list(range(3, 43)), SamplingParams(max_new_tokens=6, ignore_eos=True)))
    assert engine.step() == [] and engine.num_prefills == 1
    engine.update_weights(None, version=1)
    assert run(engine)[0]["p"].versions.tolist() == [0] + [1] * 5
    engine.step()
    assert [kv for _, kv, _ in engine._parked.values()] == [0]  # parked as version 0's, as its first token says


def test_update_weights_copies_tensors_and_refuses_mismatches_before_copying(fresh_policy, tokenizer):
    engine = HFEngine(fresh_policy, tokenizer, slots=1)
    names = [n for n, _ in fresh_policy.named_parameters()]
    new = {n: torch.full_like(p, 0.01) for n, p in fresh_policy.named_parameters() if n.endswith("norm.weight")}
    engine.update_weights(new, version=3)
    assert engine.version == 3
    for n in new:
        assert torch.equal(fresh_policy.get_parameter(n), new[n])
    before = {n: p.detach().clone() for n, p in fresh_policy.named_parameters()}
    bad_name = {names[0]: torch.zeros_like(before[names[0]]), "not.a.weight": torch.zeros(2)}
    with pytest.raises(EngineError, match="not.a.weight"):
        engine.update_weights(bad_name, version=4)
    bad_shape = {names[0]: torch.zeros_like(before[names[0]]), names[1]: torch.zeros(3, 3)}
    with pytest.raises(EngineError, match="shape mismatch"):
        engine.update_weights(bad_shape, version=4)
    assert engine.version == 3
    assert all(torch.equal(before[n], p) for n, p in fresh_policy.named_parameters())  # nothing half-applied


def greedy_reference(policy, tokenizer, prompt, n) -> GenResult:
    engine = HFEngine(policy, tokenizer, slots=1)
    engine.add(GenRequest("ref", prompt, SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)))
    return run(engine)[0]["ref"]


def test_stop_token_ends_the_sequence_and_is_kept(policy, tokenizer):
    prompt = ids(tokenizer, "stop token test")
    ref = greedy_reference(policy, tokenizer, prompt, 20).token_ids.tolist()
    i = next(j for j in range(2, 20) if ref[j] not in ref[:j])  # first occurrence at j
    engine = HFEngine(policy, tokenizer, slots=1)
    engine.add(GenRequest("s", prompt, SamplingParams(temperature=0.0, max_new_tokens=20, stop_token_ids=(ref[i],), ignore_eos=True)))
    r = run(engine)[0]["s"]
    assert (r.finish_reason, r.token_ids.tolist()) == ("stop", ref[: i + 1])


def test_eos_from_generation_config_stops_unless_ignored(fresh_policy, tokenizer):
    prompt = ids(tokenizer, "eos test")
    ref = greedy_reference(fresh_policy, tokenizer, prompt, 20).token_ids.tolist()
    i = next(j for j in range(2, 20) if ref[j] not in ref[:j])
    fresh_policy.generation_config.eos_token_id = [tokenizer.eos_token_id, ref[i]]  # e.g. Llama-3's <|eot_id|>
    engine = HFEngine(fresh_policy, tokenizer, slots=2)
    assert engine.eos_ids == {tokenizer.eos_token_id, ref[i]}
    engine.add(GenRequest("stops", prompt, SamplingParams(temperature=0.0, max_new_tokens=20)))
    engine.add(GenRequest("ignores", prompt, SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True)))
    results, _ = run(engine)
    assert (results["stops"].finish_reason, results["stops"].num_tokens) == ("stop", i + 1)
    assert (results["ignores"].finish_reason, results["ignores"].num_tokens) == ("length", 20)


def test_stop_string_ends_the_sequence_on_decoded_text(policy, tokenizer):
    prompt = ids(tokenizer, "stop string test")
    ref = greedy_reference(policy, tokenizer, prompt, 24)
    text = ref.text
    # a 2-character stop string whose first occurrence ends at character e (> 3)
    e = next(j for j in range(4, len(text)) if text[j - 1 : j + 1] not in text[: j])
    stop = text[e - 1 : e + 1]
    engine = HFEngine(policy, tokenizer, slots=1)
    engine.add(GenRequest("s", prompt, SamplingParams(temperature=0.0, max_new_tokens=24, stop_strings=(stop,), ignore_eos=True)))
    r = run(engine)[0]["s"]
    assert r.finish_reason == "stop"
    assert r.text == text[: e + 1] and r.text.endswith(stop) and stop not in r.text[:-1]
    assert r.token_ids.tolist() == ref.token_ids.tolist()[: r.num_tokens]


def byte_tokenizer():
    """One token per UTF-8 byte (byte-level BPE without merges), as byte-fallback vocabularies
    spell characters they lack: a character is up to 4 tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<eos>"] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>", pad_token="<eos>")


def test_a_stop_string_of_multi_byte_characters_stops_the_sequence():
    # "日本語です" is 5 characters and 15 byte tokens. The decoded tail searched for it was
    # 5 + 8 = 13 tokens long, so it began inside the string (its first character decoded as
    # U+FFFD) and the sequence ran on to max_new_tokens with the stop string in its text.
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = byte_tokenizer()
    prompt = tok("Q:")["input_ids"]
    script = tok("ok 日本語です。 and then more")["input_ids"]

    class Scripted(LlamaForCausalLM):
        """Its own forward, whose logits then favour script[k] at the k-th response position."""

        def forward(self, input_ids=None, position_ids=None, **kwargs):
            out = super().forward(input_ids=input_ids, position_ids=position_ids, **kwargs)
            out.logits = torch.zeros_like(out.logits)
            for i, k in enumerate((position_ids[:, -1] + 1 - len(prompt)).tolist()):
                if 0 <= k < len(script):
                    out.logits[i, -1, script[k]] = 50.0
            return out

    config = LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, max_position_embeddings=128)
    engine = HFEngine(Scripted(config).eval(), tok, slots=1)
    stop = "日本語です"
    engine.add(GenRequest("s", prompt, SamplingParams(temperature=0.0, max_new_tokens=40, stop_strings=(stop,))))
    r = run(engine)[0]["s"]
    assert (r.finish_reason, r.text, r.num_tokens) == ("stop", "ok 日本語です", 3 + len(stop.encode()))


def test_length_limits(policy, tokenizer):
    engine = HFEngine(policy, tokenizer, slots=2, max_model_len=20)
    engine.add(GenRequest("new", ids(tokenizer, "abc"), SamplingParams(max_new_tokens=5, ignore_eos=True)))
    engine.add(GenRequest("ctx", ids(tokenizer, "x" * 15), SamplingParams(max_new_tokens=50, ignore_eos=True)))
    results, _ = run(engine)
    assert (results["new"].finish_reason, results["new"].num_tokens) == ("length", 5)
    assert (results["ctx"].finish_reason, results["ctx"].num_tokens) == ("length", 5)  # 15 + 5 fills the context
    with pytest.raises(RequestError, match="context is 20"):
        engine.add(GenRequest("long", ids(tokenizer, "y" * 20), SamplingParams()))


def test_abort_frees_the_slot_for_the_next_request(policy, tokenizer):
    engine = HFEngine(policy, tokenizer, slots=2)
    p = SamplingParams(max_new_tokens=8, ignore_eos=True)
    for name in ("a", "b", "c", "d"):
        engine.add(GenRequest(name, ids(tokenizer, name * 3), p))
    engine.step()
    engine.step()
    waiting_abort = engine.abort("d")
    assert (waiting_abort.finish_reason, waiting_abort.num_tokens) == ("abort", 0)
    assert waiting_abort.prompt_ids.tolist() == ids(tokenizer, "ddd")
    active_abort = engine.abort("a")
    assert (active_abort.finish_reason, active_abort.num_tokens) == ("abort", 3)  # the prefill's + 2 decoded
    assert active_abort.versions.tolist() == [0, 0, 0] and (active_abort.logprobs <= 0).all()
    assert engine.abort("a") is None and engine.abort("never-added") is None
    assert (engine.num_active(), engine.num_waiting()) == (1, 1)
    engine.step()  # "c" takes the slot "a" held
    assert (engine.num_active(), engine.num_waiting()) == (2, 0)
    results, finished_at = run(engine)
    assert finished_at == {"b": 7, "c": 9}
    assert "a" not in results and "d" not in results


def test_abort_all_empties_the_engine(policy, tokenizer):
    engine = HFEngine(policy, tokenizer, slots=2)
    for name in ("a", "b", "c"):
        engine.add(GenRequest(name, ids(tokenizer, name), SamplingParams(max_new_tokens=8, ignore_eos=True)))
    engine.step()
    aborted = {r.request_id: r.num_tokens for r in engine.abort_all()}
    assert aborted == {"a": 2, "b": 2, "c": 0}
    assert not engine.has_work() and engine.step() == []
    # and it keeps working afterwards
    engine.add(GenRequest("later", ids(tokenizer, "later"), SamplingParams(max_new_tokens=3, ignore_eos=True)))
    assert run(engine)[0]["later"].num_tokens == 3


def test_bad_requests_are_refused_with_a_clear_error(policy, tokenizer):
    engine = HFEngine(policy, tokenizer, slots=1)
    engine.add(GenRequest("x", [5, 6], SamplingParams()))
    with pytest.raises(RequestError, match="already queued"):
        engine.add(GenRequest("x", [5, 6], SamplingParams()))
    with pytest.raises(RequestError, match="empty prompt"):
        engine.add(GenRequest("e", [], SamplingParams()))
    with pytest.raises(RequestError, match=r"\[0, 99\)"):
        engine.add(GenRequest("v", [5, 99], SamplingParams()))
    with pytest.raises(RequestError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(RequestError, match="temperature"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(RequestError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
    assert engine.num_waiting() == 1


def test_make_engine_builds_the_configured_engine(tiny_model_cfg, policy, tokenizer):
    cfg = Config()
    cfg.model = tiny_model_cfg
    cfg.rollout.slots, cfg.rollout.stop_strings, cfg.rollout.max_new_tokens = 5, ["\n\n"], 21
    engine = make_engine(cfg, policy, tokenizer)
    assert isinstance(engine, HFEngine) and isinstance(engine, GenerationEngine)
    assert engine.slots == 5 and engine.model is policy
    params = SamplingParams.from_config(cfg.rollout)
    assert (params.max_new_tokens, params.stop_strings, params.key) == (21, ("\n\n",), (1.0, 0, 1.0))
    cfg.rollout.engine = "tgi"
    with pytest.raises(ConfigError, match="tgi"):
        make_engine(cfg, policy, tokenizer)


def arrivals_one_by_one(engine: HFEngine, tokenizer) -> tuple[dict[str, GenResult], dict[str, int]]:
    """4 long sequences (20 tokens) start together; newcomers n1..n4 (4 tokens) arrive before steps
    2, 3, 4 and 5, one each (agents' turns). Returns the results and the step at which each
    newcomer got its first token (its prefill pass)."""
    params = {"long": SamplingParams(temperature=0.9, max_new_tokens=20, ignore_eos=True),
              "n": SamplingParams(temperature=0.9, max_new_tokens=4, ignore_eos=True)}
    for i in range(4):
        engine.add(GenRequest(f"long{i}", ids(tokenizer, f"a long one {i}"), params["long"]))
    results, first_token = {}, {}
    for step in range(1, 100):
        if 2 <= step <= 5:
            engine.add(GenRequest(f"n{step - 1}", ids(tokenizer, f"turn {step}"), params["n"]))
        results.update((r.request_id, r) for r in engine.step())
        for i in range(1, 5):
            if f"n{i}" not in first_token and (engine.sampled(f"n{i}") or f"n{i}" in results):
                first_token[f"n{i}"] = step
        if not engine.has_work():
            break
    for r in results.values():
        np.testing.assert_allclose(r.logprobs, recompute(engine.model, r, params[r.request_id.rstrip("0123456789")]),
                                   rtol=0, atol=PARITY_ATOL)
    return results, first_token


def test_newcomers_arriving_one_by_one_are_prefilled_at_their_arrival_step(policy, tokenizer):
    # Four long sequences decode; each newcomer (an agent's turn) gets its prefill pass, and its
    # first token, in the step it arrived before: one pass at step 1, then one per newcomer (5).
    engine = HFEngine(policy, tokenizer, slots=8, seed=2)
    results, first = arrivals_one_by_one(engine, tokenizer)
    assert first == {"n1": 2, "n2": 3, "n3": 4, "n4": 5} and engine.num_prefills == 5
    assert {r.request_id: r.num_tokens for r in results.values()} == {**{f"long{i}": 20 for i in range(4)},
                                                                       **{f"n{i}": 4 for i in range(1, 5)}}


def test_a_long_prompt_is_prefilled_in_chunks_step_after_step_beside_decoding_rows(policy, tokenizer):
    # 40 prompt tokens in chunks of at most 16, beside 4 rows decoding: 16, 32, then the last 8
    # in the step that also samples its first token (its next input's column: 41).
    engine = HFEngine(policy, tokenizer, slots=8, seed=2, prefill_chunk=16)
    for i in range(4):  # short prompts: prefilled in one pass, then decoding
        engine.add(GenRequest(f"long{i}", [1, 2, 3 + i], SamplingParams(max_new_tokens=20, ignore_eos=True)))
    engine.step()
    engine.add(GenRequest("big", list(range(1, 41)), SamplingParams(max_new_tokens=5, ignore_eos=True)))
    cached = []
    for _ in range(3):
        engine.step()
        cached.append(next(s.n_cached for s in engine._running if s.request.request_id == "big"))
    assert cached == [16, 32, 41]


def test_a_one_token_response_comes_from_the_prefill_alone(policy, tokenizer):
    # The prefill's last column predicts the first token: a response that ends there (length 1,
    # or an EOS first) never enters a decoding pass, and its slot is free at the next step.
    engine = HFEngine(policy, tokenizer, slots=1)
    engine.add(GenRequest("one", ids(tokenizer, "one"), SamplingParams(max_new_tokens=1, ignore_eos=True)))
    engine.add(GenRequest("next", ids(tokenizer, "next"), SamplingParams(max_new_tokens=2, ignore_eos=True)))
    first = engine.step()
    assert [(r.request_id, r.num_tokens, r.finish_reason) for r in first] == [("one", 1, "length")]
    assert (engine.num_prefills, engine.num_steps) == (1, 0)
    assert [(r.request_id, r.num_tokens) for r in engine.step()] == [("next", 2)]  # prefill + one decoding pass
    assert (engine.num_prefills, engine.num_steps) == (2, 1)
