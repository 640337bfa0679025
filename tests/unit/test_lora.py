"""LoRA (``model.lora``) with the tiny model: settings refused with what to do, only the adapters
train and are published, the hf engine applies them in place with the learner's log-probs,
checkpoints hold the adapters alone, the export is the merged plain model."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch

from engine_helpers import ids, recompute
from learner.checkpoint import CheckpointError, export_hf, load_latest, save_checkpoint
from learner.engine_factory import make_engine
from learner.stats import flops_metrics
from learner.update import PolicyUpdater, prox_is_training_pass
from learner_helpers import digit_reward, generate_samples, tiny_config, train
from rlhf_core import lora
from rlhf_core.config import Config, ConfigError, LoraConfig, validate
from rlhf_core.models import check_lora, load_policy, load_tokenizer
from rollout_workers.engine import GenRequest, SamplingParams
from rollout_workers.hf_engine import HFEngine

# the head too: the random tiny model's frozen head caps its logits (see docs/real_models.md, LoRA)
LORA = LoraConfig(r=4, alpha=8.0, target_modules=["all-linear", "lm_head"])
LINEAR = ["down_proj", "gate_proj", "k_proj", "lm_head", "o_proj", "q_proj", "up_proj", "v_proj"]


@pytest.fixture(scope="module")
def lora_model_cfg(tiny_model_cfg):
    return dataclasses.replace(tiny_model_cfg, lora=LORA)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_cfg):
    return load_tokenizer(tiny_model_cfg)


@pytest.fixture(scope="module")
def base(tiny_model_cfg):
    return load_policy(tiny_model_cfg).eval()


@pytest.fixture(scope="module")
def batches(base):
    return [generate_samples(base, [[20 + i, 30], [21, 30 + i]], 4, 5, seed=i, reward_fn=digit_reward, tag=f"b{i}")
            for i in range(2)]


def policy(lora_model_cfg, seed: int | None = None) -> torch.nn.Module:
    """The LoRA policy; with ``seed``, adapters drawn at random (B != 0: not the base model any more)."""
    model = load_policy(lora_model_cfg).eval()
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in lora.adapter_parameters(model).values():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def logits(model, text_ids=(5, 40, 41, 42, 20, 21, 22)) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([list(text_ids)])).logits


# ------------------------------------------------------------------ settings
@pytest.mark.parametrize("key, value, message", [
    ("r", -1, "model.lora.r must be >= 0"),
    ("alpha", 0.0, "model.lora.alpha must be > 0"),
    ("alpha", -8.0, "model.lora.alpha must be > 0"),
    ("dropout", 1.0, "model.lora.dropout must be in [0, 1)"),
    ("dropout", -0.1, "model.lora.dropout must be in [0, 1)"),
    ("target_modules", [], "model.lora.target_modules must name layers"),
    ("target_modules", ["q_proj", " "], "model.lora.target_modules must name layers"),
])
def test_bad_lora_settings_are_refused_at_start_up(key, value, message):
    cfg = Config()
    cfg.model.lora = dataclasses.replace(LoraConfig(r=8), **{key: value})
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace(")", r"\)")):
        validate(cfg)


def test_lora_off_and_good_settings_pass_and_vllm_ranks_are_capped():
    for r in (0, None, 16):
        cfg = Config()
        cfg.model.lora.r = r
        validate(cfg)
    cfg = Config()
    cfg.rollout.engine = "vllm"
    cfg.model.lora.r = 1024
    with pytest.raises(ConfigError, match="above vLLM's largest LoRA rank 512"):
        validate(cfg)


def test_lora_without_peft_says_what_to_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "peft" else real(name, *a))
    cfg = Config()
    cfg.model.lora.r = 8
    with pytest.raises(ConfigError, match=r"needs peft.*pip install -e '\.\[lora\]'"):
        validate(cfg)


@pytest.mark.parametrize("targets, message", [
    (["qkv"], "not found in the base model"),  # matches nothing
    (["embed_tokens"], "names layers that are not linear"),  # peft wraps it, but neither merge nor vLLM would
    (["norm"], "is not supported"),  # peft cannot wrap an RMSNorm
])
def test_targets_that_do_not_fit_the_model_are_refused_before_anything_loads(tiny_model_cfg, targets, message):
    cfg = dataclasses.replace(tiny_model_cfg, lora=LoraConfig(r=4, target_modules=targets))
    with pytest.raises(ConfigError, match=message) as err:
        check_lora(cfg)
    assert "model.lora.target_modules" in str(err.value)
    if targets == ["qkv"]:  # the layers one could name instead
        assert str(LINEAR) in str(err.value)


def test_an_adapter_on_a_head_tied_to_the_embeddings_is_refused_before_anything_loads(tiny_model_cfg):
    # Qwen2.5-0.5B ties its head to its embeddings: [all-linear, lm_head] trained on, then the
    # export at the end of the run failed (the merge finds no head of its own); refused at start now
    from rlhf_core.models import tiny_model_config

    tied = tiny_model_config(tiny_model_cfg.tiny)
    tied.tie_word_embeddings = True
    with pytest.raises(ConfigError, match="shares its matrix with the input embeddings"):
        lora.check_targets(tied, LORA)
    assert lora.check_targets(tied, dataclasses.replace(LORA, target_modules=["all-linear"]))[0] > 0


def test_all_linear_leaves_the_head_out_unless_it_is_named(tiny_model_cfg):
    # tiny: hidden 64, intermediate 128, vocab 99, 2 layers. Per layer q,k,v,o: r * (64 + 64) each;
    # gate, up: r * (64 + 128); down: r * (128 + 64). Head: r * (64 + 99).
    per_layer = 4 * 4 * 128 + 3 * 4 * 192
    all_linear = check_lora(dataclasses.replace(tiny_model_cfg, lora=LoraConfig(r=4)))
    with_head = check_lora(dataclasses.replace(tiny_model_cfg, lora=LORA))
    assert all_linear[0] == 2 * per_layer
    assert with_head[0] == 2 * per_layer + 4 * (64 + 99)
    assert with_head[1] - with_head[0] == 94912  # all parameters minus the adapters: the base model
    assert check_lora(tiny_model_cfg) is None  # r = 0: nothing to check


# ------------------------------------------------------------------ training and publishing
def test_only_the_adapters_train_and_are_published(lora_model_cfg, base, batches):
    model = policy(lora_model_cfg)
    adapters = lora.adapter_parameters(model)
    assert adapters and all(".lora_A.default." in n or ".lora_B.default." in n for n in adapters)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == set(adapters)
    # B starts at zero: the initial policy is the base model, exactly
    assert torch.equal(logits(model), logits(base))
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    before = {n: p.detach().clone() for n, p in adapters.items()}
    cfg = tiny_config(lora_model_cfg, **{"learner.lr": 1e-2})
    up = PolicyUpdater(cfg, make_engine(cfg, model))
    for v, b in enumerate(batches):
        train(up, b, v)
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if not p.requires_grad)
    assert all(not torch.equal(p, before[n]) for n, p in adapters.items() if ".lora_B." in n)
    published = dict(up.engine.named_trainable_parameters())
    # the learner publishes exactly what a worker pulls into: the hf engine's target
    worker = HFEngine(policy(lora_model_cfg), load_tokenizer(lora_model_cfg), slots=2)
    target = worker.weights_target()
    assert isinstance(target, dict) and sorted(target) == sorted(published)
    assert all(target[n].shape == t.shape for n, t in published.items())
    assert sum(t.numel() for t in published.values()) == lora.counts(model)[0]


def test_lora_dropout_turns_the_prox_shortcut_off(lora_model_cfg, batches):
    cfg = tiny_config(lora_model_cfg)
    assert prox_is_training_pass(cfg, policy(lora_model_cfg))
    dropped = dataclasses.replace(lora_model_cfg, lora=dataclasses.replace(LORA, dropout=0.1))
    # training passes drop adapter inputs, pi_prox must not: its own pass runs, in eval mode
    model = load_policy(dropped)
    assert not prox_is_training_pass(tiny_config(dropped), model)
    up = PolicyUpdater(tiny_config(dropped), make_engine(tiny_config(dropped), model))
    assert train(up, batches[0], 0)["learner/prox_pass"] == 1.0


def test_flops_count_frozen_weights_without_their_weight_gradient():
    # 1e6 params of which 1e5 train, 1e4 tokens in 0.5 s: (4e6 + 2e5) * 1e4 / 0.5 = 8.4e10 FLOP/s
    assert flops_metrics(10**6, 1e4, 0.5, None, trainable=10**5) == pytest.approx({"learner/tflops": 0.084})
    assert flops_metrics(10**6, 1e4, 0.5, None) == pytest.approx({"learner/tflops": 0.12})  # all train: 6 N


# ------------------------------------------------------------------ the hf engine
def test_hf_engine_applies_adapters_in_place_with_the_learners_logprobs(lora_model_cfg, tokenizer, base):
    learner_v1, learner_v2 = policy(lora_model_cfg, seed=1), policy(lora_model_cfg, seed=2)
    engine = HFEngine(policy(lora_model_cfg), tokenizer, slots=3, seed=0)
    target = engine.weights_target()
    storage = {n: t.data_ptr() for n, t in target.items()}
    params = SamplingParams(temperature=0.9, top_k=30, max_new_tokens=12, ignore_eos=True)
    prompts = ["h", "hello world", "7:", "the quick brown fox"]

    def generate_with(learner, version):
        with torch.no_grad():  # what WeightSubscriber.pull(into=target) does: copy_ into the adapters
            for n, p in lora.adapter_parameters(learner).items():
                target[n].copy_(p)
        engine.update_weights(None, version)
        for i, text in enumerate(prompts):
            engine.add(GenRequest(f"v{version}-{i}", ids(tokenizer, text), params))
        results = {}
        while engine.has_work():
            results.update({r.request_id: r for r in engine.step()})
        return results

    for version, learner in ((1, learner_v1), (2, learner_v2)):
        results = generate_with(learner, version)
        assert len(results) == len(prompts)
        for r in results.values():
            assert r.versions.tolist() == [version] * 12
            mine = np.abs(recompute(learner, r, params) - r.logprobs).max()
            other = np.abs(recompute(base, r, params) - r.logprobs).max()
            assert mine < 1e-4, f"v{version}: behaviour log-probs differ from the learner's by {mine}"
            assert other > 0.05  # the adapters matter: the base model's log-probs are far off
    assert {n: t.data_ptr() for n, t in engine.weights_target().items()} == storage  # in place (CUDA graphs)


def test_hf_engine_update_weights_takes_adapter_tensors_and_refuses_others(lora_model_cfg, tokenizer):
    from rollout_workers.engine import EngineError

    learner = policy(lora_model_cfg, seed=3)
    engine = HFEngine(policy(lora_model_cfg), tokenizer, slots=2)
    tensors = {n: p.detach().clone() for n, p in lora.adapter_parameters(learner).items()}
    engine.update_weights(tensors, 5)
    assert engine.version == 5 and all(torch.equal(engine.weights_target()[n], t) for n, t in tensors.items())
    with pytest.raises(EngineError, match="this model does not have"):
        engine.update_weights({"model.embed_tokens.weight": torch.zeros(99, 64)}, 6)


# ------------------------------------------------------------------ checkpoints and export
def test_checkpoint_holds_the_adapters_alone_and_restores_them(lora_model_cfg, tiny_model_cfg, batches, tmp_path):
    cfg = tiny_config(lora_model_cfg, **{"learner.lr": 1e-2})
    up = PolicyUpdater(cfg, make_engine(cfg, policy(lora_model_cfg)))
    train(up, batches[0], 0)
    save_checkpoint(tmp_path, "v1", up.engine, extra={"version": 1})
    saved = torch.load(tmp_path / "v1" / "policy" / "model.pt", weights_only=True)
    assert sorted(saved) == sorted(lora.adapter_parameters(up.engine.module))  # no base weights: model.path has them
    fresh = make_engine(cfg, policy(lora_model_cfg))
    assert load_latest(tmp_path, fresh)["version"] == 1
    want = dict(up.engine.named_trainable_parameters())
    assert all(torch.equal(t, want[n]) for n, t in fresh.named_trainable_parameters())
    # a checkpoint of another model.lora setting is refused, naming the setting
    plain_cfg = tiny_config(tiny_model_cfg)
    with pytest.raises(CheckpointError, match="model.lora settings"):
        load_latest(tmp_path, make_engine(plain_cfg, load_policy(tiny_model_cfg)))


def test_export_is_the_merged_plain_model(lora_model_cfg, tokenizer, tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    model = policy(lora_model_cfg, seed=4)
    cfg = tiny_config(lora_model_cfg)
    out = export_hf(make_engine(cfg, model), tokenizer, tmp_path / "export")
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
    assert not [n for n in names if "lora_" in n or "base_layer" in n]
    assert "model.layers.0.self_attn.q_proj.weight" in names and "lm_head.weight" in names
    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    assert not lora.has_adapters(exported)
    # float32 rounding of W0 + s * B @ A against base(x) + s * B(A(x)): a few 1e-5 on logits of size ~1-5
    torch.testing.assert_close(logits(exported), logits(model), atol=1e-4, rtol=1e-4)
    assert (logits(exported) - logits(load_policy(dataclasses.replace(lora_model_cfg, lora=LoraConfig())))).abs().max() > 0.1


def test_saved_adapter_is_a_peft_adapter_directory(lora_model_cfg, base, tmp_path):
    from peft import PeftModel

    model = policy(lora_model_cfg, seed=5)
    tensors = {n: p.detach() for n, p in lora.adapter_parameters(model).items()}
    folder = lora.save_adapter(tmp_path / "adapter", tensors, LORA)
    assert sorted(p.name for p in folder.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert all((p.stat().st_mode & 0o777) == 0o600 for p in folder.iterdir())
    loaded = PeftModel.from_pretrained(copy.deepcopy(base), str(folder)).eval()
    torch.testing.assert_close(logits(loaded), logits(model), atol=1e-6, rtol=0)


def test_an_adapted_head_keeps_the_chunked_logprob_path(lora_model_cfg):
    # lm_parts accepts a LoRA layer over the linear head, so long responses still never hold all
    # the logits at once; chunks of 4 positions give the full path's numbers and adapter gradients
    from factories import sample
    from learner.batch import collate
    from learner.lm_head import chunked_response_logprobs, lm_parts, response_logits
    from rlhf_core.sampling import process_logits, token_logprobs

    model = policy(lora_model_cfg, seed=6)
    twin = copy.deepcopy(model)
    parts = lm_parts(twin)
    assert parts is not None and parts[1] is twin.lm_head and lora.has_adapters(parts[1])
    batch = collate([sample(prompt_ids=[1, 5 + i, 6], response_ids=[7 + j for j in range(3 + 2 * i)], group_id=f"g{i}")
                     for i in range(3)], pad_id=0, device=torch.device("cpu"), vocab_size=99)
    process = lambda x: process_logits(x, 0.8, 0, 1.0)  # noqa: E731
    want = token_logprobs(process(response_logits(model, batch)), batch.response_ids)
    got, _ = chunked_response_logprobs(*parts, batch, process, 4)
    mask = batch.response_mask
    torch.testing.assert_close(got[mask], want[mask], rtol=0, atol=1e-5)
    (want * mask).sum().backward()
    (got * mask).sum().backward()
    grads = dict(lora.adapter_parameters(twin))
    for name, p in lora.adapter_parameters(model).items():
        assert p.grad is not None and grads[name].grad is not None, name
        torch.testing.assert_close(grads[name].grad, p.grad, rtol=1e-3, atol=1e-5)  # float32, gradients of size ~0.1-1
