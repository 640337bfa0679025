"""The tiny model and tokenizer are built locally and loaded through from_pretrained."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from rlhf_core.config import ConfigError, ModelConfig
from rlhf_core import models


def test_tiny_builds_once_and_loads_through_from_pretrained(tiny_model_cfg):
    path = models.model_dir(tiny_model_cfg)
    assert (path / "config.json").exists() and (path / "tokenizer.json").exists()
    mtime = (path / "config.json").stat().st_mtime
    assert models.model_dir(tiny_model_cfg) == path  # cached: same dir, not rebuilt
    assert (path / "config.json").stat().st_mtime == mtime
    policy = models.load_policy(tiny_model_cfg)
    tok = models.load_tokenizer(tiny_model_cfg)
    assert policy.config.vocab_size == len(tok) == 99
    assert policy.config._name_or_path == str(path)  # really came from the directory


def test_tiny_is_deterministic_in_its_seed(tiny_model_cfg, tmp_path):
    a = models.load_policy(tiny_model_cfg)
    other = replace(tiny_model_cfg, cache_dir=str(tmp_path))
    b = models.load_policy(other)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and torch.equal(pa, pb)
    c = models.load_policy(replace(other, tiny=replace(other.tiny, seed=1)))
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)


def test_char_tokenizer_round_trips_text(tiny_model_cfg):
    tok = models.load_tokenizer(tiny_model_cfg)
    text = "count: 1 2 3 -> 4!"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)  # one token per character
    assert tok.decode(ids) == text
    assert tok.eos_token == models.EOS and tok.pad_token_id == 0 and tok.padding_side == "left"


def test_dtype_from_config(tiny_model_cfg):
    model = models.load_policy(replace(tiny_model_cfg, dtype="bfloat16"))
    assert next(model.parameters()).dtype == torch.bfloat16


def test_reference_is_frozen_and_critic_has_value_head(tiny_model_cfg):
    ref = models.load_reference(tiny_model_cfg)
    assert not any(p.requires_grad for p in ref.parameters()) and not ref.training
    critic = models.load_critic(tiny_model_cfg)
    out = critic(input_ids=torch.tensor([[5, 6, 7]]))
    assert out.logits.shape == (1, 3, 1)


def test_reward_model_from_local_dir(tiny_model_cfg, tmp_path):
    path = models.build_tiny_model(tiny_model_cfg.tiny, tmp_path / "rm", head="sequence")
    rm, tok = models.load_reward_model(path, tiny_model_cfg)
    out = rm(**tok(["ab", "abc"], return_tensors="pt", padding=True))
    assert out.logits.shape == (2, 1)


def test_errors_a_user_can_cause(tmp_path, tiny_model_cfg):
    with pytest.raises(ConfigError, match="not a local HF-format model directory"):
        models.model_dir(ModelConfig(path=str(tmp_path)))
    with pytest.raises(ConfigError, match="needs model.path"):
        models.model_dir(ModelConfig(name="qwen"))
    with pytest.raises(ConfigError, match="dtype 'float8' is not one of"):
        models.torch_dtype("float8")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA is not available"):
            models.resolve_device("cuda")
    with pytest.raises(ConfigError, match="has no config.json"):
        models.load_reward_model(tmp_path, tiny_model_cfg)
